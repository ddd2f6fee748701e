"""A format-following task: turn a sentence that lists things into a bulleted list.

The prompt is one user turn: the instruction (one item per line, each line starting with
``- ``, in the order given, nothing else), then ``Text: `` and a sentence from a few templates
that names 3 to 5 items from a closed vocabulary ("For the trip, pack a map, sunscreen and a
torch."). The list itself is never in the prompt in its answer form; the verifier
(:func:`bullets_reward`, ``"tasks.bullets:bullets_reward"``) parses the sentence with the
generator's own templates. What a small model has to learn is the reply's shape and picking the
right spans, not knowledge.
"""

from __future__ import annotations

import random
import re
from functools import cache
from typing import Any

from tasks.common import lcs_share, prompt_loader, task_data, user_turn

__all__ = ["bullets_reward", "expected_items", "generate_prompts", "load_prompts"]

DEFAULT_COUNT = 480
DEFAULT_SEED = 20250113
INSTRUCTION = (
    'Rewrite the text below as a bulleted list: one item per line, each line starting with "- ", '
    "in the order given. Reply with only the list."
)
MARKER = "\n\nText: "
# Measured (SmolLM2-135M-Instruct, temperature 1.0): it mostly copies the sentence or writes a
# numbered list, and a reward for list lines alone was 0 for 8 groups in 9. So a quarter is for
# naming the items at all, wherever they are; the rest is the shape that was asked for.
ANYWHERE_WEIGHT = 0.25  # the items named in the reply, in order, wherever they are
LINES_WEIGHT = 0.35  # the items, in order, each on a list line of any common marker
DASH_WEIGHT = 0.2  # every list line starts with "- " as asked
ALONE_WEIGHT = 0.2  # and the reply holds nothing but list lines

_ITEMS = (
    "a map", "sunscreen", "a torch", "two towels", "a rain jacket", "some snacks", "a notebook",
    "the tickets", "a water bottle", "spare socks", "a phone charger", "the passports",
    "eggs", "flour", "butter", "sugar", "fresh basil", "olive oil", "a lemon", "brown rice",
    "the laundry", "the dishes", "the front lawn", "the garage", "the windows", "the car",
)  # fmt: skip
# Each template's {items} is the items joined as English writes them: "a, b and c".
_TEMPLATES = (
    "For the trip, pack {items}.",
    "Please buy {items} on your way home.",
    "Today we need to clean {items}.",
    "Don't forget {items}!",
    "The box should contain {items}.",
    "Remember to bring {items} tomorrow.",
    "On the list for this week: {items}.",
    "Could you check {items} before Friday?",
)
_MARKERS = re.compile(r"^\s*(?:[-*•+]|\d{1,2}[.)])\s+(.*?)\s*$")
_END = re.compile(r"[\s.;,!]+$")


def _join(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]


def generate_prompts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``count`` distinct prompts ``{"messages": [...], "expected": [items in order]}``; the same
    seed gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        items = rng.sample(_ITEMS, rng.randint(3, 5))
        text = rng.choice(_TEMPLATES).format(items=_join(items))
        if text in seen:
            continue
        seen.add(text)
        out.append({"messages": user_turn(INSTRUCTION, MARKER, text), "expected": items})
    return out


# Generated at load (seeded, so always the same set, in a fixed order).
load_prompts = prompt_loader(generate_prompts)


@cache
def _parsers() -> tuple[re.Pattern[str], ...]:
    item = "(?:" + "|".join(re.escape(i) for i in sorted(_ITEMS, key=len, reverse=True)) + ")"
    items = f"(?P<items>{item}(?:, {item})* and {item})"
    return tuple(re.compile(re.escape(t).replace(re.escape("{items}"), items)) for t in _TEMPLATES)


def expected_items(prompt_messages: list[dict[str, Any]]) -> list[str]:
    """The items the prompt's sentence names, in order; ValueError for a prompt this task did
    not write."""
    text = task_data(prompt_messages, INSTRUCTION, MARKER, "bullets_reward")
    for pattern in _parsers():
        match = pattern.fullmatch(text)
        if match:
            head, _, last = match.group("items").rpartition(" and ")
            return [*head.split(", "), last]
    raise ValueError(f"bullets_reward: no template matches {text[:80]!r}")


def _norm(text: str) -> str:
    return " ".join(_END.sub("", text).split()).casefold()


def bullets_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """How well the reply is the asked-for list, in [0, 1].

    ``ANYWHERE_WEIGHT`` x the expected items the reply names anywhere, in order (longest common
    subsequence of the items in the order they first occur in the reply); ``LINES_WEIGHT`` x the
    same for the items of bulleted or numbered lines (any common marker), one item per line,
    extra lines costing their share; ``DASH_WEIGHT`` when there are list lines and every one
    starts with ``- ``; ``ALONE_WEIGHT`` when there are list lines and no other non-empty line.
    Case and a trailing full stop do not matter.
    """
    want = [_norm(i) for i in expected_items(prompt_messages)]
    content = sample.get("content")
    text = (content if isinstance(content, str) else "")[:8000]
    folded = text.casefold()
    found = sorted((folded.find(i), i) for i in set(want) if i in folded)
    anywhere = lcs_share([i for _, i in found], want) if found else 0.0
    lines = [ln for ln in text.splitlines() if ln.strip()]
    listed = [(ln, m.group(1)) for ln in lines if (m := _MARKERS.match(ln))]
    if not listed:
        return ANYWHERE_WEIGHT * anywhere
    on_lines = lcs_share([_norm(item) for _, item in listed], want)
    dashes = all(ln.lstrip().startswith("- ") for ln, _ in listed)
    alone = len(listed) == len(lines)
    score = (
        ANYWHERE_WEIGHT * anywhere
        + LINES_WEIGHT * on_lines
        + DASH_WEIGHT * dashes
        + ALONE_WEIGHT * alone
    )
    return min(1.0, score)  # the weights sum to 1, which floats can overshoot

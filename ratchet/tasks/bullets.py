"""A format-following task: turn a sentence that lists things into a bulleted list.

The prompt is one user turn: the instruction (one item per line, each line starting with
``- ``, in the order given, nothing else), then ``Text: `` and a sentence from a few templates
that names 3 to 5 items from a closed vocabulary ("For the trip, pack a map, sunscreen and a
torch."). The list itself is never in the prompt in its answer form; the verifier
(:func:`bullets_reward`, ``"ratchet.tasks.bullets:bullets_reward"``) parses the sentence with the
generator's own templates. What a small model has to learn is the reply's shape and picking the
right spans, not knowledge.
"""

from __future__ import annotations

import random
import re
from functools import cache
from typing import Any

from ratchet.tasks.common import lcs_share, prompt_loader, task_data, user_turn

__all__ = ["bullets_reward", "expected_items", "generate_prompts", "load_prompts"]

DEFAULT_COUNT = 480
DEFAULT_SEED = 20250113
INSTRUCTION = (
    'Rewrite the text below as a bulleted list: one item per line, each line starting with "- ", '
    "in the order given. Reply with only the list."
)
MARKER = "\n\nText: "
ITEMS_WEIGHT = 0.6  # the items, in order, on bulleted lines of any common marker
DASH_WEIGHT = 0.2  # every item line starts with "- " as asked
ALONE_WEIGHT = 0.2  # and the reply holds nothing but those lines

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

    ``ITEMS_WEIGHT`` x the items on bulleted or numbered lines (any common marker), compared in
    order with the expected ones (longest common subsequence over the longer list; case and a
    trailing full stop do not matter); ``DASH_WEIGHT`` when every such line starts with ``- ``
    and ``ALONE_WEIGHT`` when the reply has no other non-empty line. A reply without a single
    list line scores 0.
    """
    want = [_norm(i) for i in expected_items(prompt_messages)]
    content = sample.get("content")
    lines = [ln for ln in (content if isinstance(content, str) else "")[:8000].splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    listed = [(ln, m.group(1)) for ln in lines if (m := _MARKERS.match(ln))]
    if not listed:
        return 0.0
    share = lcs_share([_norm(text) for _, text in listed], want)
    dashes = all(ln.lstrip().startswith("- ") for ln, _ in listed)
    alone = len(listed) == len(lines)
    score = ITEMS_WEIGHT * share + DASH_WEIGHT * dashes + ALONE_WEIGHT * alone
    return min(1.0, score)  # the weights sum to 1, which floats can overshoot

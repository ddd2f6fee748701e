"""The bundled demo task: pull a customer's order out of a short message, as a JSON object.

A seeded generator writes short messages ("Hi, Maria Lopez here, please ship 3 blue mugs to
Lisbon.") from a few templates and small vocabularies, each with its ground truth: 2 to 4 of the
fields ``name``, ``item``, ``quantity`` (an integer) and ``city``. The prompt is one user message:
an instruction naming the keys to reply with, then the customer's text. The answer is never in the
prompt (no example values, no expected line), so a model cannot copy it.

:func:`extraction_reward` is the verifier (``reward.verifier: "tasks.demo:extraction_reward"``):
it recovers the ground truth by parsing the user message with the generator's own templates and
gives the share of fields the answer gets exactly right. ``tasks/demo/prompts.jsonl`` holds the
shipped prompt set (``scripts/make_demo_prompts.py`` writes it; :func:`load_prompts` reads it).
"""

from __future__ import annotations

import json
import random
import re
import string
from functools import cache
from importlib import resources
from typing import Any

from ratchet.rewards.ruler import strip_code_fence

__all__ = [
    "FIELDS",
    "PROMPTS_FILE",
    "expected_fields",
    "extraction_reward",
    "generate_prompts",
    "load_prompts",
    "prompts_jsonl",
]

PROMPTS_FILE = "prompts.jsonl"
DEFAULT_COUNT = 400
DEFAULT_SEED = 20240611

FIELDS = ("name", "item", "quantity", "city")

_FIRST = (
    "Maria", "James", "Aisha", "Kenji", "Olga", "Pedro", "Lena", "Tom",
    "Sofia", "Omar", "Chen", "Nina", "Lucas", "Priya", "Jonas", "Emma",
)  # fmt: skip
_LAST = (
    "Lopez", "Smith", "Khan", "Tanaka", "Petrova", "Silva", "Berg", "Brown",
    "Rossi", "Haddad", "Wei", "Novak", "Martin", "Patel", "Meyer", "Dubois",
)  # fmt: skip
_COLOURS = ("blue", "red", "green", "black", "white", "yellow")
# (singular, plural): the item is the phrase as the message writes it, so it agrees with quantity.
_PRODUCTS = (
    ("mug", "mugs"), ("lamp", "lamps"), ("notebook", "notebooks"), ("chair", "chairs"),
    ("backpack", "backpacks"), ("umbrella", "umbrellas"), ("candle", "candles"),
    ("towel", "towels"), ("teapot", "teapots"), ("scarf", "scarves"),
)  # fmt: skip
_CITIES = (
    "Lisbon", "Oslo", "Berlin", "Madrid", "Toronto", "Nairobi", "Osaka", "Lima",
    "Dublin", "Prague", "Seattle", "Cairo", "Vienna", "Denver", "Porto", "Helsinki",
)  # fmt: skip

# Each template names the fields it holds: that set is exactly the ground truth's keys.
_TEMPLATES = (
    "Hi, {name} here, please ship {quantity} {item} to {city}.",
    "Hello! This is {name}. I'd like {quantity} {item} delivered to {city}, thanks.",
    "Order for {name}: {quantity} {item}, shipping to {city}.",
    "{name} from {city} wants to order {quantity} {item}.",
    "Can you send {quantity} {item} to {city}? Thanks, {name}",
    "Please ship {quantity} {item} to {city}.",
    "I need {quantity} {item} sent to our office in {city}.",
    "{name} here. Add {quantity} {item} to my order, please.",
    "Could I get {quantity} {item}, please?",
    "Hi, it's {name}. I moved to {city}, please update my address.",
)

# The instruction goes in the user turn: with it in a system message SmolLM2-135M-Instruct
# ignores it (measured: mean score 0.0 greedy, against 0.3-0.4 in the user turn).
_INSTRUCTION = (
    "Extract the order details from this customer message. Reply with only a JSON object with "
    "the keys {keys}."
)
MESSAGE_MARKER = "\n\nMessage: "


def _template_fields(template: str) -> tuple[str, ...]:
    return tuple(f for f in FIELDS if "{" + f + "}" in template)


def user_message(text: str, fields: tuple[str, ...]) -> str:
    """The prompt's one user turn: the instruction naming the keys, then the customer's text."""
    keys = ", ".join(f'"{f}"' for f in fields)
    return _INSTRUCTION.format(keys=keys) + MESSAGE_MARKER + text


def generate_prompts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``count`` distinct prompts, each ``{"messages": [...], "expected": {...}}``; the same
    ``seed`` always gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        template = rng.choice(_TEMPLATES)
        quantity = rng.randint(1, 12)
        singular, plural = rng.choice(_PRODUCTS)
        values: dict[str, Any] = {
            "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "item": f"{rng.choice(_COLOURS)} {singular if quantity == 1 else plural}",
            "quantity": quantity,
            "city": rng.choice(_CITIES),
        }
        fields = _template_fields(template)
        text = template.format(**values)
        if text in seen:
            continue
        seen.add(text)
        messages = [{"role": "user", "content": user_message(text, fields)}]
        out.append({"messages": messages, "expected": {f: values[f] for f in fields}})
    return out


def prompts_jsonl(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> str:
    """The shipped file's exact text: one prompt per line, keys sorted, UTF-8."""
    return "".join(
        json.dumps(p, sort_keys=True, ensure_ascii=False) + "\n"
        for p in generate_prompts(count, seed)
    )


def load_prompts() -> list[dict[str, Any]]:
    """The shipped prompt set, in its fixed order."""
    text = resources.files("tasks.demo").joinpath(PROMPTS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --- the verifier ----------------------------------------------------------------------------


def _alternation(words: Any) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


@cache
def _parsers() -> tuple[tuple[re.Pattern[str], tuple[str, ...]], ...]:
    """One full-match regex per template; vocabularies are closed, so a match is unambiguous."""
    items = [f"{c} {p}" for c in _COLOURS for pair in _PRODUCTS for p in pair]
    groups = {
        "name": f"(?P<name>(?:{_alternation(_FIRST)}) (?:{_alternation(_LAST)}))",
        "item": f"(?P<item>{_alternation(items)})",
        "quantity": r"(?P<quantity>[1-9][0-9]?)",
        "city": f"(?P<city>{_alternation(_CITIES)})",
    }
    parsers = []
    for template in _TEMPLATES:
        pattern = ""
        for literal, field, _, _ in string.Formatter().parse(template):
            pattern += re.escape(literal) + (groups[field] if field else "")
        parsers.append((re.compile(pattern), _template_fields(template)))
    return tuple(parsers)


def expected_fields(prompt_messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The ground truth of a demo prompt, parsed from its last user message with the
    generator's templates; ValueError when the message is not one the generator writes."""
    users = [m for m in prompt_messages if m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise ValueError("extraction_reward: the prompt has no user message with text content")
    instruction, marker, text = users[-1]["content"].rpartition(MESSAGE_MARKER)
    if not marker or not instruction:
        raise ValueError("extraction_reward: not a demo prompt, no 'Message: ' part")
    for pattern, fields in _parsers():
        match = pattern.fullmatch(text)
        if match:
            if instruction != user_message("", fields).removesuffix(MESSAGE_MARKER):
                raise ValueError("extraction_reward: the instruction does not match the message")
            found = match.groupdict()
            return {f: int(found[f]) if f == "quantity" else found[f] for f in fields}
    raise ValueError(f"extraction_reward: not a demo prompt, no template matches {text[:80]!r}")


FORMAT_WEIGHT = 0.2  # the share of the reward for answering with nothing but the JSON object


def extraction_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """How well the answer extracts the order, in [0, 1].

    ``1 - FORMAT_WEIGHT`` of the reward is the share of expected fields right in the first JSON
    object of the answer, wherever it is (prose around it is tolerated here, so a small model's
    "Here is the JSON: {...}" already earns something to learn from); the other
    ``FORMAT_WEIGHT`` is for an answer that is that JSON object alone (a ```json fence is fine).
    Strings match ignoring case and runs of whitespace; ``quantity`` must be a JSON number equal
    to the integer (``"3"`` is wrong). Extra keys cost nothing. A prompt the generator did not
    write raises ValueError: that is a broken task, not a bad answer.
    """
    expected = expected_fields(prompt_messages)
    content = sample.get("content")
    text = content if isinstance(content, str) else ""
    answer, alone = _first_object(text)
    if answer is None:
        return 0.0
    right = sum(1 for f, want in expected.items() if f in answer and _same(answer[f], want))
    share = right / len(expected)
    # min(): 0.8 * (3 / 3) + 0.2 is 1.0000000000000002 in floats, which a verifier must not return
    return min(1.0, (1.0 - FORMAT_WEIGHT) * share + (FORMAT_WEIGHT if alone else 0.0))


def _first_object(text: str) -> tuple[dict[str, Any] | None, bool]:
    """(the answer's first JSON object, whether the answer is nothing but that object)."""
    try:
        whole = json.loads(strip_code_fence(text))
    except (ValueError, RecursionError):
        whole = None
    if isinstance(whole, dict):
        return whole, True
    decoder = json.JSONDecoder()
    for start in (i for i, char in enumerate(text) if char == "{"):
        try:
            found, _ = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        if isinstance(found, dict):
            return found, False
    return None, False


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, int):
        return (
            isinstance(got, int | float) and not isinstance(got, bool) and got == want
        )  # 3 and 3.0, never "3" or true
    return isinstance(got, str) and _norm(got) == _norm(want)


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()

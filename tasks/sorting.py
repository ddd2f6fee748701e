"""A correctness task: sort a few numbers from smallest to largest.

The prompt is one user turn: the instruction, then ``Numbers: 42, 7, 19, 88`` (4 to 6 distinct
integers from 1 to 99, in a seeded random order). The sorted list is never in the prompt; the
verifier (:func:`sorting_reward`, ``"tasks.sorting:sorting_reward"``) reads the numbers
back from the prompt and sorts them itself. What a small model has to learn is ordering and
the reply's shape, not knowledge.
"""

from __future__ import annotations

import random
import re
from typing import Any

from tasks.common import lcs_share, prompt_loader, task_data, user_turn

__all__ = ["expected_order", "generate_prompts", "load_prompts", "sorting_parts", "sorting_reward"]

DEFAULT_COUNT = 480
DEFAULT_SEED = 20250112
INSTRUCTION = (
    "Sort these numbers from smallest to largest. Reply with only the sorted numbers, "
    "separated by commas."
)
MARKER = "\n\nNumbers: "
FORMAT_WEIGHT = 0.2  # the share of the reward for a reply that is the comma-separated list alone

_NUMBER = re.compile(r"\d+")
_LIST_ALONE = re.compile(r"\s*\d+(?:\s*,\s*\d+)*\s*\.?\s*")


def generate_prompts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``count`` distinct prompts ``{"messages": [...], "expected": [sorted ints]}``; the same
    seed gives the same list."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        numbers = rng.sample(range(1, 100), rng.randint(4, 6))
        if tuple(numbers) in seen or numbers == sorted(numbers):
            continue  # an already sorted list would reward copying the prompt
        seen.add(tuple(numbers))
        data = ", ".join(str(n) for n in numbers)
        out.append({"messages": user_turn(INSTRUCTION, MARKER, data), "expected": sorted(numbers)})
    return out


# Generated at load (seeded, so always the same set, in a fixed order).
load_prompts = prompt_loader(generate_prompts)


def expected_order(prompt_messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's numbers, sorted; ValueError for a prompt this task did not write."""
    data = task_data(prompt_messages, INSTRUCTION, MARKER, "sorting_reward")
    parts = data.split(", ")
    if not 2 <= len(parts) <= 20 or not all(p.isdigit() and len(p) <= 3 for p in parts):
        raise ValueError(f"sorting_reward: not a list of numbers: {data[:80]!r}")
    return sorted(int(p) for p in parts)


def sorting_parts(
    prompt_messages: list[dict[str, Any]], sample: dict[str, Any]
) -> tuple[float, bool]:
    """The reward's two parts: (the order share: the longest run of the sorted numbers that the
    reply's integers follow in order, over the longer of the two lists; whether the reply is
    nothing but the comma-separated list)."""
    want = expected_order(prompt_messages)
    content = sample.get("content")
    text = content if isinstance(content, str) else ""
    got = [int(n) for n in _NUMBER.findall(text[:4000])]
    return lcs_share(got, want), _LIST_ALONE.fullmatch(text) is not None


def sorting_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """How well the reply sorts the numbers, in [0, 1].

    ``1 - FORMAT_WEIGHT`` is the order share of :func:`sorting_parts` (a missing, extra or
    misplaced number costs its share; prose around the numbers is tolerated); ``FORMAT_WEIGHT``
    more for a reply that is nothing but the comma-separated list.
    """
    share, alone = sorting_parts(prompt_messages, sample)
    if share == 0.0:
        return 0.0
    return min(1.0, (1.0 - FORMAT_WEIGHT) * share + (FORMAT_WEIGHT if alone else 0.0))

"""What the bundled tasks share: the prompt's one user turn (an instruction, a marker, the data),
how a verifier finds that data again, and an order-aware partial-credit measure."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["lcs_share", "prompt_loader", "task_data", "user_turn"]

Prompts = list[dict[str, Any]]


def prompt_loader(generate: Callable[[], Prompts]) -> Callable[[], Prompts]:
    """A task's ``load_prompts``: its seeded prompt set, generated once, a fresh copy per call
    (a caller may edit its copy)."""
    made = cache(lambda: tuple(generate()))

    def load_prompts() -> Prompts:
        return copy.deepcopy(list(made()))

    return load_prompts


def user_turn(instruction: str, marker: str, data: str) -> list[dict[str, Any]]:
    """The prompt's messages. The instruction goes in the user turn: SmolLM2-135M-Instruct
    ignores one in a system message (measured on the demo)."""
    return [{"role": "user", "content": instruction + marker + data}]


def task_data(
    prompt_messages: list[dict[str, Any]], instruction: str, marker: str, who: str
) -> str:
    """The data part of a prompt this task wrote; ValueError naming ``who`` for any other
    prompt (a verifier given a foreign prompt is a broken configuration, not a bad answer)."""
    users = [m for m in prompt_messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise ValueError(f"{who}: the prompt has no user message with text content")
    content: str = users[-1]["content"]
    head, found, data = content.partition(marker)
    if not found or head != instruction:
        raise ValueError(f"{who}: not a prompt of this task")
    return data


def lcs_share(got: list[Any], want: list[Any]) -> float:
    """Longest common subsequence over the longer of the two lists, in [0, 1]: 1 only for the
    same list; a missing, extra or misplaced element costs its share."""
    if not got or not want:
        return 0.0
    previous = [0] * (len(want) + 1)
    for g in got:
        row = [0]
        for j, w in enumerate(want):
            row.append(previous[j] + 1 if g == w else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1] / max(len(got), len(want))

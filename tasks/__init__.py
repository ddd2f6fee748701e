"""The bundled tasks: each a seeded prompt set and a verifier, so the loop can be measured on
tasks nobody tuned it for (``bench/loop_speed.py``, ``bench/demo_learning.py --task``).

:data:`TASKS` maps a task's name to its :class:`Task`; the demo (``tasks.demo``) is listed by
reference. A task's prompts are ``{"messages": [...], "expected": ...}``, with ``"tools"`` when
the task offers function tools (whoever sends the prompt sends them too); ``expected`` is for
people reading the set: each verifier recovers the ground truth from the prompt itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratchet.rewards.verifiers import Verifier, load_verifier
from tasks import bullets, demo, sorting, tool_use, triage

__all__ = ["TASKS", "Task", "get_task", "request_fields"]


@dataclass(frozen=True)
class Task:
    name: str  # also a valid alias name
    verifier: str  # "package.module:function", as ratchet.yaml's reward.verifier names it
    load_prompts: Callable[[], list[dict[str, Any]]]
    description: str  # one line

    def reward(self) -> Verifier:
        return load_verifier(self.verifier)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "demo",
            "tasks.demo:extraction_reward",
            demo.load_prompts,
            "extraction: order details out of a short customer message, as a JSON object",
        ),
        Task(
            "sorting",
            "tasks.sorting:sorting_reward",
            sorting.load_prompts,
            "correctness: 4 to 6 numbers sorted from smallest to largest, comma-separated",
        ),
        Task(
            "bullets",
            "tasks.bullets:bullets_reward",
            bullets.load_prompts,
            'format: the items a sentence names as a "- " bulleted list, in order, nothing else',
        ),
        Task(
            "tool_use",
            "tasks.tool_use:tool_use_reward",
            tool_use.load_prompts,
            "tool use: the right one of three function tools, with the request's arguments",
        ),
        Task(
            "triage",
            "tasks.triage:triage_reward",
            triage.load_prompts,
            "classification: which of five teams a support message goes to, the name alone",
        ),
    )
}


# What a prompt may carry besides its messages, sent with them as an app would send them.
REQUEST_FIELDS = ("tools", "tool_choice")


def request_fields(prompt: dict[str, Any]) -> dict[str, Any]:
    """The chat request fields a task's prompt carries (``tools``, ``tool_choice``), to send
    with its ``messages``; empty for a prompt of messages alone."""
    return {key: prompt[key] for key in REQUEST_FIELDS if prompt.get(key) is not None}


def get_task(name: str) -> Task:
    """The task called ``name``; KeyError listing the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no task {name!r}; tasks are {sorted(TASKS)}") from None

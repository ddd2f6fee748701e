"""What the canary's reward-hacking guard last said of a version, shared by the learner (which
writes it when it asks the guard, before a promotion: learner/reward_guard.py), the console and
`ratchet status` (which show it).

``ratchet:canary:<alias>:reward_guard`` (string, JSON): the version the guard looked at and its
:class:`GuardResult`. One per alias, replaced by the next look and kept a week: after the
version was promoted it still tells that it was promoted without a check, if it was.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import redis

GuardOutcome = Literal["blocked", "checked", "unchecked"]
GUARD_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class GuardResult:
    """The guard's answer: ``blocked`` (``reason`` says why the canary fooled the reward
    model), ``checked`` (it looked, and found nothing), or ``unchecked`` (it could not look:
    ``reason`` says why, e.g. too few raters)."""

    outcome: GuardOutcome
    reason: str

    @property
    def checked(self) -> bool:
        return self.outcome != "unchecked"

    def blocks(self, block_unchecked: bool) -> str | None:
        """The reason to roll the canary back instead of promoting it, or None: a ``blocked``
        result always; an ``unchecked`` one when the alias asks for a check
        (``feedback.require_reward_check``)."""
        if self.outcome == "blocked":
            return self.reason
        if self.outcome == "unchecked" and block_unchecked:
            return f"reward_unchecked: {self.reason} (feedback.require_reward_check is on)"
        return None


def guard_key(alias: str) -> str:
    return f"ratchet:canary:{alias}:reward_guard"


def write_guard(client: redis.Redis, alias: str, version: int, result: GuardResult) -> None:
    entry = {"version": version, **asdict(result)}
    client.set(guard_key(alias), json.dumps(entry), ex=GUARD_TTL_S)


def read_guard(client: redis.Redis, alias: str) -> tuple[int, GuardResult] | None:
    """(the version looked at, what the guard said), or None: never asked, or unreadable."""
    raw: Any = client.get(guard_key(alias))
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
        outcome = entry["outcome"]
        if outcome not in ("blocked", "checked", "unchecked"):
            return None
        return int(entry["version"]), GuardResult(outcome, str(entry["reason"]))
    except (ValueError, KeyError, TypeError):
        return None


def guard_line(client: redis.Redis, alias: str, versions: tuple[int | None, ...]) -> str | None:
    """One line for the console and `ratchet status` when the guard last looked at one of
    ``versions`` (the canary, or the active version it was promoted as), else None."""
    found = read_guard(client, alias)
    if found is None or found[0] not in versions:
        return None
    version, result = found
    return f"reward guard on v{version}: {result.reason}"

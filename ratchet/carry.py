"""Where a round starts: the live version, or a rejected candidate not shown worse.

A round on a few dozen groups moves a small model a little. A gate that sees about a hundred
held-out pairs cannot tell a 0.6 win rate from a coin at a 5% error rate, so such a candidate is
rejected and, if every round started from the live version, its learning would be thrown away:
each round would gain the same little and be rejected the same way (measured: five rounds in a
row at 0.53 to 0.62). So a candidate the gate rejected without showing it worse (its upper
confidence bound still reaches the threshold: not proven better, not proven worse) is
*carried*: the next round trains on from its weights and optimizer state, and the gate compares
the result with the live version again, until a candidate passes, one is shown worse, or one
holds ``learner.max_candidate_rounds`` rounds. Not only those that leaned better: a first round
often moves the greedy answers little (sorting's won 0.45 and 0.55 of its pairs in two runs)
while its sampled answers have moved, and the round after it is where the gain shows.

The judge samples the next round's groups from the same place the round starts
(:func:`start_of_round`), so a carried round trains on its own answers, as GRPO assumes, not on
the live version's: sampling is offline, so nothing carried is ever served to a user. It still
has to pass the gate against the live version, on held-out prompts no round trains on, and then
the canary.

A candidate that passed its gate and serves as the canary is carried too, while its canary runs:
the next round trains on from it meanwhile instead of waiting (a canary waits for ratings for
minutes; on the sorting task's ratings run, 17 of 45 minutes), and its candidate is gated once
the canary ends, against what is live then (learner/service.py). Such a carry is void as soon as
the alias no longer has that canary: promoted, the candidate is the live version and the round
starts from it anyway; rolled back, the round starts from the live version again.

The carry is one Redis hash per alias (``ratchet:learner:<alias>:carry``), written by the
learner in the same transaction as the round's outcome and read by the learner and the judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis


def carry_key(alias: str) -> str:
    return f"ratchet:learner:{alias}:carry"


@dataclass(frozen=True)
class Carry:
    version: int  # the rejected candidate the next round starts from
    live: int  # the version it was gated against: a carry is void once another is live
    rounds: int  # rounds of training it holds beyond ``live``
    win_rate: float  # its gate win rate, for the log and status
    canary: bool = False  # it passed its gate and is the alias's canary: carried while it is


@dataclass(frozen=True)
class Start:
    """A round's starting weights: ``version`` (the live one, or a carried candidate), and how
    many rounds of training beyond the live version it already holds (0: the live version)."""

    version: int
    rounds: int = 0

    @property
    def carried(self) -> bool:
        return self.rounds > 0


def start_of_round(
    carry: Carry | None, live: int, max_rounds: int, canary: int | None = None
) -> Start:
    """The carried candidate when it was gated against today's live version and one more round
    keeps it within ``max_rounds`` (a carried canary: while it is the alias's ``canary``; it
    passed its gate, so ``max_rounds`` does not bound it); else the live version."""
    if carry is None or carry.live != live:
        return Start(live)
    if carry.canary:
        return Start(carry.version, carry.rounds) if canary == carry.version else Start(live)
    if carry.rounds < max_rounds:
        return Start(carry.version, carry.rounds)
    return Start(live)


def carry_after(
    start: Start,
    live: int,
    version: int,
    passed: bool,
    win_rate: float | None,
    upper: float | None,
    threshold: float,
    to_canary: bool = False,
) -> Carry | None:
    """What the next round may start from after the gate's verdict on ``version``: the
    candidate itself when it was rejected but not shown worse (``upper``, the win rate's upper
    confidence bound, at or above ``threshold``), or when it passed and goes ``to_canary`` (a
    carried canary). One promoted at once is the live version, which makes any carry void; one
    shown worse, or whose gate failed (no win rate), carries nothing."""
    if win_rate is None:
        return None
    if passed:
        if not to_canary:
            return None
        return Carry(version, live, start.rounds + 1, win_rate, canary=True)
    if upper is not None and upper < threshold:
        return None
    return Carry(version=version, live=live, rounds=start.rounds + 1, win_rate=win_rate)


def read_carry(client: redis.Redis, alias: str) -> Carry | None:
    raw: dict[bytes, bytes] = client.hgetall(carry_key(alias))  # type: ignore[assignment]
    return carry_from_hash(raw)


def carry_from_hash(raw: Mapping[Any, Any]) -> Carry | None:
    """The carry in a hash read from :func:`carry_key` (by a sync or an async client)."""
    try:
        return Carry(
            version=int(raw[b"version"]),
            live=int(raw[b"live"]),
            rounds=int(raw[b"rounds"]),
            win_rate=float(raw[b"win_rate"]),
            canary=raw.get(b"canary") == b"1",
        )
    except (KeyError, ValueError):
        return None  # none, or not ours: start from the live version


def write_carry(pipe: Any, alias: str, carry: Carry | None) -> None:
    """Queue the carry's new value on a Redis pipeline (None: clear it)."""
    pipe.delete(carry_key(alias))
    if carry is not None:
        pipe.hset(
            carry_key(alias),
            mapping={
                "version": carry.version,
                "live": carry.live,
                "rounds": carry.rounds,
                "win_rate": carry.win_rate,
                "canary": int(carry.canary),
            },
        )

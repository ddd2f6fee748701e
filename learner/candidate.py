"""Where a candidate version stands, in one value, moved in one place.

A version the learner trained (or one ``ratchet import`` queued) goes through these stages::

    trained --> gating --> canary --> promoted
       |  \\         \\         \\
       |   held --> gating      +--> rejected  (rolled back)
       |      \\         \\
       +-------+---------+-------> rejected

- ``trained``: written to the store, its ``candidate`` event recorded; its gate comes next;
- ``held``: trained on from the alias's canary while it ran (written held, never ``trained``
  first: a restart keeps it); gated once the canary ends;
- ``gating``: its gate runs against the live version;
- ``canary``: it serves a share of the alias's traffic (learner/canary.py decides);
- ``promoted`` / ``rejected``: settled; nothing moves it again.

:func:`move` is the only way a stage changes; a move not in :data:`MOVES` raises
:class:`WrongMove`. Where the lifecycle itself has moved (a promotion, a rejection, a canary,
written in its transaction: :meth:`Candidates.reached`), the record follows it and never blocks
it: a wrong move there is logged as an error, counted, and the record overwritten to the stage
the lifecycle reached. :class:`Candidates` keeps each alias's candidates in Redis
(``ratchet:learner:<alias>:candidates``, a hash: version -> the candidate's JSON), written in the
transaction of the lifecycle change where there is one, so a restarted learner reads where each
stands: a held one is settled once its canary ends (learner/held.py), one caught in ``trained``
or ``gating`` by the restart was never settled (its groups are trained again; the import queue
gates an import again), and a canary's end, whoever decided it (the canary watcher, an operator
in the console or the CLI), is read from the alias's route (:meth:`Candidates.follow_route`).

The history events (``candidate``, ``gate``, ``canary``, ``promote``, ``reject``, ``rollback``)
stay what the console and the CLI read; this is the learner's own view of the same story.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

import redis
from prometheus_client import Counter

from ratchet.registry import AliasRoute

log = logging.getLogger(__name__)

KEEP_SETTLED = 20  # settled candidates kept per alias, the newest: enough to read a story back


class Stage(StrEnum):
    TRAINED = "trained"
    HELD = "held"
    GATING = "gating"
    CANARY = "canary"
    PROMOTED = "promoted"
    REJECTED = "rejected"


MOVES: dict[Stage, frozenset[Stage]] = {
    Stage.TRAINED: frozenset({Stage.HELD, Stage.GATING, Stage.REJECTED}),
    Stage.HELD: frozenset({Stage.GATING, Stage.REJECTED}),
    Stage.GATING: frozenset({Stage.CANARY, Stage.PROMOTED, Stage.REJECTED}),
    Stage.CANARY: frozenset({Stage.PROMOTED, Stage.REJECTED}),
    Stage.PROMOTED: frozenset(),
    Stage.REJECTED: frozenset(),
}

SETTLED = frozenset({Stage.PROMOTED, Stage.REJECTED})


class WrongMove(ValueError):
    """A stage change the lifecycle does not allow (a bug: two writers, or a step skipped)."""


@dataclass(frozen=True)
class Candidate:
    """One candidate version of an alias and where it stands. ``parent`` is the version it would
    replace (the live one, or the canary it trained on from); ``group_ids`` the groups it
    trained on (none for an import); ``stats`` and ``bill`` its round's training stats and cost
    so far (its groups' and its training), kept so a held candidate is settled after a restart."""

    alias: str
    version: int
    parent: int
    stage: Stage = Stage.TRAINED
    origin: str = "round"  # round | import
    group_ids: tuple[str, ...] = ()
    stats: dict[str, Any] | None = None
    bill: dict[str, Any] | None = None
    reason: str = ""  # why it was rejected
    updated_at: float = field(default_factory=time.time)

    @property
    def settled(self) -> bool:
        return self.stage in SETTLED

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "group_ids": list(self.group_ids)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Candidate:
        data = json.loads(text)
        data["stage"] = Stage(data["stage"])
        data["group_ids"] = tuple(data.get("group_ids") or ())
        return cls(**data)


def move(
    candidate: Candidate, stage: Stage, reason: str = "", now: float | None = None
) -> Candidate:
    """The candidate at ``stage``: the one place a stage changes."""
    if stage not in MOVES[candidate.stage]:
        raise WrongMove(
            f"{candidate.alias} v{candidate.version}: {candidate.stage} -> {stage} is not a move "
            f"of the lifecycle (from {candidate.stage}: {sorted(MOVES[candidate.stage]) or 'none'})"
        )
    return replace(
        candidate, stage=stage, reason=reason, updated_at=time.time() if now is None else now
    )


def after_route(candidate: Candidate, route: AliasRoute) -> Candidate | None:
    """Where a candidate in canary stands once the route no longer says it is the canary:
    promoted if it is live, else rejected (rolled back); None while it is still the canary."""
    if candidate.stage != Stage.CANARY or route.canary == candidate.version:
        return None
    if route.active == candidate.version:
        return move(candidate, Stage.PROMOTED)
    return move(candidate, Stage.REJECTED, "its canary was rolled back")


def candidates_key(alias: str) -> str:
    """Hash: version -> the candidate's JSON (learner/candidate.py)."""
    return f"ratchet:learner:{alias}:candidates"


class Candidates:
    """Each alias's candidates as Redis holds them. A write is one HSET (queued on ``pipe`` when
    given: the lifecycle change's transaction), and settled ones beyond the newest
    :data:`KEEP_SETTLED` are pruned when another settles."""

    def __init__(self, client: redis.Redis, record_errors: Counter | None = None) -> None:
        self.client = client
        self.record_errors = record_errors  # by alias: wrong moves :meth:`reached` overwrote

    def get(self, alias: str, version: int) -> Candidate | None:
        raw = self.client.hget(candidates_key(alias), str(version))
        return None if raw is None else Candidate.from_json(raw)

    def all(self, alias: str) -> list[Candidate]:
        raw = self.client.hgetall(candidates_key(alias))
        return sorted((Candidate.from_json(v) for v in raw.values()), key=lambda c: c.version)

    def open(self, alias: str) -> list[Candidate]:
        """The alias's candidates not settled, oldest first."""
        return [c for c in self.all(alias) if not c.settled]

    def put(self, candidate: Candidate, pipe: Any = None) -> Candidate:
        target = self.client if pipe is None else pipe
        target.hset(candidates_key(candidate.alias), str(candidate.version), candidate.to_json())
        return candidate

    def write(self, moved: Candidate, pipe: Any = None) -> Candidate:
        """Store a candidate just moved; one that settled makes room by pruning the oldest."""
        self.put(moved, pipe)
        if moved.settled:
            self.prune(moved.alias)
        return moved

    def add(self, candidate: Candidate, pipe: Any = None) -> None:
        """A new candidate (a round's, written to the store; an import, met at its gate)."""
        self.put(candidate, pipe)

    def move(
        self, alias: str, version: int, stage: Stage, reason: str = "", pipe: Any = None
    ) -> Candidate | None:
        """Move the stored candidate to ``stage`` (:func:`move`); None when none is stored (one
        from before this record existed). Read now, written on ``pipe`` when given."""
        current = self.get(alias, version)
        if current is None:
            return None
        return self.write(move(current, stage, reason), pipe)

    def reached(
        self, alias: str, version: int, stage: Stage, reason: str = "", pipe: Any = None
    ) -> Candidate | None:
        """The lifecycle has moved the candidate to ``stage`` (a promotion, a rejection, a
        canary, written on ``pipe``, its transaction): the record follows and never blocks it.
        A move :func:`move` refuses (the learner's own bookkeeping wrong: a bug) is logged as an
        error, counted, and the record overwritten to ``stage``; None when none is stored."""
        current = self.get(alias, version)
        if current is None:
            return None
        try:
            moved = move(current, stage, reason)
        except WrongMove as exc:
            log.error("candidate record overwritten, the lifecycle went on: %s", exc)
            if self.record_errors is not None:
                self.record_errors.labels(alias).inc()
            moved = replace(current, stage=stage, reason=reason, updated_at=time.time())
        return self.write(moved, pipe)

    def begin_gate(self, alias: str, version: int, live: int) -> Candidate:
        """The candidate's gate begins: moved to ``gating``. One gating already is an import
        gated again after a restart (the queue keeps it until its outcome); one with no record
        (written before this record existed) starts at ``gating``."""
        current = self.get(alias, version)
        if current is None:
            return self.put(Candidate(alias, version, live, Stage.GATING))
        if current.stage == Stage.GATING:
            return current
        return self.put(move(current, Stage.GATING))

    def drop(self, alias: str, version: int, reason: str, pipe: Any = None) -> Candidate | None:
        """Rejected without an outcome of the lifecycle (never served: its groups are trained
        again), unless it is settled already (by another replica, meanwhile)."""
        current = self.get(alias, version)
        if current is None or current.settled:
            return current
        return self.write(move(current, Stage.REJECTED, reason), pipe)

    def drop_orphans(self, alias: str) -> list[Candidate]:
        """Round candidates caught ``trained`` or ``gating`` by a restart or a failed round: no
        outcome was stored and their groups are trained again, so none is ever settled. Called
        under the alias's lease, between rounds, when no candidate of it is being worked on."""
        orphans = [
            c
            for c in self.open(alias)
            if c.origin == "round" and c.stage in (Stage.TRAINED, Stage.GATING)
        ]
        return [
            self.put(move(c, Stage.REJECTED, "no outcome: its round did not finish"))
            for c in orphans
        ]

    def follow_route(self, routes: Iterable[AliasRoute]) -> list[Candidate]:
        """Candidates in canary whose canary has ended (promoted or rolled back, by whoever),
        moved to where they stand now; returns those moved."""
        moved: list[Candidate] = []
        for route in routes:
            ended = [after_route(c, route) for c in self.open(route.alias)]
            settled = [self.put(after) for after in ended if after is not None]
            if settled:
                self.prune(route.alias)
            moved += settled
        return moved

    def prune(self, alias: str) -> None:
        settled = [c for c in self.all(alias) if c.settled]
        old = settled[:-KEEP_SETTLED]
        if old:
            self.client.hdel(candidates_key(alias), *(str(c.version) for c in old))

"""Held candidates: rounds trained on from the alias's canary while it runs.

With ``learner.train_during_canary`` a round may start from the alias's canary (ratchet/carry.py)
instead of waiting for it to end. It stops after training and writing its candidate, which is
*held*: one per alias, its groups read and not committed past, gated once the canary has ended
against the version live then (the canary, promoted), and settled as any round's candidate. If
the canary it trained on from was rolled back (or another version made live), it is rejected
without a gate: it holds what that canary learned.

A held candidate is stored (learner/candidate.py, stage ``held``, with its groups' ids, stats and
bill so far), so a learner restarted while it waits settles it all the same (:meth:`resume`);
the groups it re-reads meanwhile wait as any others, and are dropped as trained once it is
settled. One whose groups another replica trained meanwhile, or whose partition moved to another
replica, is dropped unsettled (never served: its groups are trained again there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from kafka.structs import TopicPartition

from learner.candidate import Candidate, Stage
from learner.gate_verdict import GateResult
from learner.gating import gate_candidate
from learner.heldout import HeldoutPool
from learner.intake import Waiting
from learner.round import Gated, RoundReport, Rounds, mark_trained, trained_key, training_bill
from learner.round_stats import RoundStats
from learner.under_lease import AliasWork
from ratchet.bill import Bill
from ratchet.carry import Start
from ratchet.registry import AliasRoute

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldCandidate:
    """A round trained on from the alias's canary, written to the store, gated once the canary
    ends. ``bill``: its groups' and its training, its gate's to come."""

    version: int
    canary: int  # the canary it trained on from, and its parent
    group_ids: list[str]
    stats: RoundStats
    bill: Bill

    @classmethod
    def of(cls, stored: Candidate) -> HeldCandidate:
        """One stored held (a restart's): its stats and bill as its round wrote them."""
        return cls(
            stored.version,
            stored.parent,
            list(stored.group_ids),
            stats_of(stored.stats or {}),
            Bill.model_validate(stored.bill or {}),
        )


def stats_of(stored: dict[str, object]) -> RoundStats:
    """A round's stats from their JSON (``RoundStats.as_dict``: NaN was written as None)."""
    values = {}
    for f in fields(RoundStats):
        value = stored.get(f.name)
        nullable = "None" in str(f.type)
        values[f.name] = math.nan if value is None and not nullable else value
    return RoundStats(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Held:
    """A held candidate and the groups it spent that were read here: not committed past until it
    is settled (none for one resumed after a restart: its groups are read again as any)."""

    candidate: HeldCandidate
    batch: list[Waiting]


def train_through_canary(
    rounds: Rounds,
    alias: str,
    route: AliasRoute,
    groups: list[Waiting],
    heldout: HeldoutPool,
    waiting: int,
    start: Start,
) -> Held:
    """Steps 1 and 2 of a round that starts from the alias's canary (``start``), which is the
    candidate's parent: the version it would replace once the canary is promoted."""
    assert route.canary is not None and start.version == route.canary
    scored = [w.group for w in groups]
    with rounds.reporting(alias, route, heldout, waiting) as left:
        stats = rounds.train(alias, route.active, start, scored)
        version = rounds.write(alias, route.canary, Start(route.canary), scored, stats, Stage.HELD)
        left.count = max(0, waiting - len(groups))
    log.info("%s: v%d held: gated once canary v%d ends", alias, version, route.canary)
    ids = [g.group_id for g in scored]
    spent = training_bill(scored, stats)
    return Held(HeldCandidate(version, route.canary, ids, stats, spent), groups)


def settle_held(
    rounds: Rounds,
    alias: str,
    route: AliasRoute,
    held: HeldCandidate,
    heldout: HeldoutPool,
    waiting: int,
) -> RoundReport:
    """A held candidate once its canary has ended (``route`` has none): gated against the canary
    it trained on from, which is live now, and settled as any round's candidate; or, when that
    canary was rolled back, rejected without a gate."""
    assert route.canary is None
    config = rounds.settings.aliases[alias]
    with rounds.reporting(alias, route, heldout, waiting):
        if route.active != held.canary:
            return reject_orphan(rounds, alias, route.active, held)
        result = gate_candidate(rounds, alias, config, route, held.version, heldout)
        bill = held.bill + (result.bill or Bill())
        start = Start(route.active)
        gated = Gated(
            alias, held.version, route.active, start, held.group_ids, held.stats.mean_reward,
            result, bill,
        )  # fmt: skip
        return RoundReport(alias, held.version, held.stats, result, rounds.settle(gated))


def reject_orphan(rounds: Rounds, alias: str, live: int, held: HeldCandidate) -> RoundReport:
    """The held candidate rejected, its groups spent: the canary it trained on from is not
    ``live`` (rolled back, as a rule: it holds what the canary learned, which its users did not
    want; or an operator made another version live meanwhile)."""
    # From the history, written with the route: the store's mark comes after it (a race).
    rolled_back = any(
        e.get("kind") == "rollback" and e.get("previous_version") == held.canary
        for e in rounds.lifecycle.writer.history(alias, limit=20)
    )
    fate = "was rolled back" if rolled_back else f"is not live (v{live} is)"
    reason = f"trained on from canary v{held.canary}, which {fate}"
    result = GateResult(
        passed=False, reason=reason, pairs=0, win_rate=None, ci_low=None, ci_high=None,
        threshold=rounds.settings.aliases[alias].gate.threshold, min_pairs=0,
    )  # fmt: skip
    detail = {"reason": reason, "bill": held.bill.as_dict()}

    def spend(pipe: object) -> None:
        mark_trained(pipe, alias, held.group_ids, rounds.settings.learner.trained_groups_max)
        rounds.candidates.reached(alias, held.version, Stage.REJECTED, reason, pipe)

    rounds.lifecycle.reject(alias, held.version, detail, also=spend)
    rounds.metrics.rounds.labels(alias, "rejected").inc()
    log.info("%s: v%d rejected (%s)", alias, held.version, reason)
    return RoundReport(alias, held.version, held.stats, result, "rejected")


class HeldRounds:
    """This replica's held candidates, one per alias, and their settling under the alias's
    lease (learner/under_lease.py)."""

    def __init__(
        self,
        rounds: Rounds,
        work: AliasWork,
        routes: Callable[[], dict[str, AliasRoute]],
        waiting: dict[str, list[Waiting]],
        heldout: dict[str, HeldoutPool],
        fail_round: Callable[[str, Exception], None],
    ) -> None:
        self.rounds = rounds
        self.work = work
        self.routes = routes
        self.waiting = waiting
        self.heldout = heldout
        self.fail_round = fail_round
        self.held: dict[str, Held] = {}

    def __contains__(self, alias: str) -> bool:
        return alias in self.held

    def hold(self, alias: str, held: Held) -> None:
        self.held[alias] = held

    def resume(self, aliases: Iterable[str]) -> None:
        """Take up the held candidates Redis holds (a restart's): settled once their canary
        ends, as if this replica had trained them."""
        for alias in aliases:
            if alias in self.held:
                continue
            for stored in self.rounds.candidates.open(alias):
                if stored.stage == Stage.HELD:
                    log.info("%s: held v%d taken up: gated once canary v%d ends",
                             alias, stored.version, stored.parent)  # fmt: skip
                    self.held[alias] = Held(HeldCandidate.of(stored), [])

    def unsettled(self) -> list[Waiting]:
        """The groups held candidates spent here: not committed past until they are settled."""
        return [w for h in self.held.values() for w in h.batch]

    def drop(self, alias: str, why: str) -> None:
        held = self.held.pop(alias)
        log.warning("%s: held v%d dropped: %s", alias, held.candidate.version, why)
        self.rounds.candidates.drop(alias, held.candidate.version, f"dropped: {why}")

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop those whose groups' partition moved to another learner: it trains them again."""
        for alias, held in list(self.held.items()):
            if any(w.partition in partitions for w in held.batch):
                self.drop(alias, "its groups' partition moved to another learner")

    def settle(self, alias: str) -> list[RoundReport]:
        """The alias's held candidate gated and settled under its lease, once its canary has
        ended and no other runs, while learning is not paused. One whose groups another replica
        trained meanwhile is dropped unsettled (never served); one whose settling fails for any
        reason but an outage pauses the alias with its groups waiting again, uncommitted."""
        held = self.held[alias]
        redis = self.rounds.redis

        def due() -> AliasRoute | None:
            route = self.routes().get(alias)
            if route is None or route.canary is not None or route.paused:
                return None  # its canary (or one started since) still runs, or learning is paused
            ids = held.candidate.group_ids
            if any(score is not None for score in redis.zmscore(trained_key(alias), ids)):
                self.drop(alias, "its groups were trained by another learner")
                return None
            return route

        def work(route: AliasRoute) -> list[RoundReport]:
            waiting = len(self.waiting.get(alias) or ())
            pool = self.heldout[alias]
            report = settle_held(self.rounds, alias, route, held.candidate, pool, waiting)
            del self.held[alias]
            return [report]

        def on_error(exc: Exception) -> None:
            self.drop(alias, f"settling failed: {type(exc).__name__}")
            self.waiting[alias] = held.batch + self.waiting[alias]
            self.fail_round(alias, exc)

        what = f"settling held v{held.candidate.version}"
        return self.work.under_lease(alias, what, due, work, on_error) or []

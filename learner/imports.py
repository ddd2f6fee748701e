"""Imported versions: an adapter trained elsewhere, gated and settled here as a round's candidate.

``ratchet import`` writes the adapter to the store as the alias's next version and queues it in
``ratchet:learner:<alias>:imports`` (ratchet/versions.py), in the transaction of its
``candidate`` event. The learner holding the alias's lease gates the oldest queued version
against the live one once no canary runs and the held-out pool can fill a gate, and settles it
as a round's candidate is (reject, canary or promote), without training. It leaves the queue in
the outcome's transaction, so a learner killed meanwhile gates it again. One already settled, or
gone from the store, leaves the queue unexamined; one whose gate raises is rejected with the
reason (not retried forever).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from learner.candidate import Candidate
from learner.gating import gate_candidate
from learner.heldout import HeldoutPool
from learner.intake import Waiting
from learner.metrics import LearnerMetrics
from learner.round import Rounds
from learner.under_lease import AliasWork
from ratchet.bill import Bill
from ratchet.registry import AliasRoute
from ratchet.versions import imports_key, queued_imports, unqueue_import

log = logging.getLogger(__name__)


def gate_import(
    rounds: Rounds, alias: str, route: AliasRoute, version: int, heldout: HeldoutPool, waiting: int
) -> str:
    """An imported version gated against the live one and settled as a round's candidate is,
    without training; it leaves the import queue in the outcome's transaction."""
    config = rounds.settings.aliases[alias]
    if rounds.candidates.get(alias, version) is None:
        rounds.candidates.add(Candidate(alias, version, route.active, origin="import"))
    with rounds.reporting(alias, route, heldout, waiting):
        result = gate_candidate(rounds, alias, config, route, version, heldout)
        bill = result.bill or Bill()
        rounds.report(alias, "settle", detail=result.reason)
        detail = {"gate": result.as_dict(), "origin": "import", "bill": bill.as_dict()}
        return rounds.decide(
            alias,
            config,
            version,
            result,
            detail,
            lambda pipe: unqueue_import(pipe, alias, version),
        )


class Imports:
    """The import queues of the configured aliases, each gated under the alias's lease."""

    def __init__(
        self,
        rounds: Rounds,
        work: AliasWork,
        metrics: LearnerMetrics,
        routes: Callable[[], dict[str, AliasRoute]],
        waiting: dict[str, list[Waiting]],
        heldout: dict[str, HeldoutPool],
    ) -> None:
        self.rounds = rounds
        self.redis = rounds.redis
        self.store = rounds.store
        self.settings = rounds.settings
        self.work = work
        self.metrics = metrics
        self.routes = routes
        self.waiting = waiting
        self.heldout = heldout

    def waiting_aliases(self) -> list[str]:
        """Aliases with an imported version queued for its gate."""
        aliases = list(self.settings.aliases)
        with self.redis.pipeline(transaction=False) as pipe:
            for alias in aliases:
                pipe.llen(imports_key(alias))
            lengths = pipe.execute()
        return [alias for alias, length in zip(aliases, lengths, strict=True) if length]

    def gate_next(self, alias: str) -> None:
        """The alias's oldest imported version gated and settled under its lease, when due."""
        queued = queued_imports(self.redis, alias)
        if not queued:
            return
        version = queued[0]
        what = f"gate of imported v{version}"
        self.work.under_lease(
            alias, what, lambda: self.due(alias, version), self.gate, self.reject_on(alias, version)
        )

    def due(self, alias: str, version: int) -> tuple[str, AliasRoute, int] | None:
        """What to gate, read again under the lease: None while a canary runs or the held-out
        pool cannot fill a gate (the import waits, queued); an import settled or gone from the
        store leaves the queue."""
        queued = queued_imports(self.redis, alias)
        if not queued or queued[0] != version:
            return None
        if not self.store.exists(alias, version) or self.store.status(alias, version):
            log.warning("%s: imported v%d is not in the store or settled: dropped", alias, version)
            self.redis.lrem(imports_key(alias), 0, str(version))
            return None
        route = self.routes().get(alias)
        if route is None or route.canary is not None:
            return None  # gated once the canary ends, against what is live then
        config = self.settings.aliases[alias]
        pairs = self.heldout[alias].pairs_available(
            config.gate.max_pairs, config.learning.max_key_share
        )
        if pairs < config.gate.min_pairs:
            return None  # the pool fills from ratchet.heldout
        return alias, route, version

    def gate(self, due: tuple[str, AliasRoute, int]) -> None:
        alias, route, version = due
        waiting = len(self.waiting.get(alias) or ())
        gate_import(self.rounds, alias, route, version, self.heldout[alias], waiting)

    def reject_on(self, alias: str, version: int) -> Callable[[Exception], None]:
        """What a gate that raised does: the import rejected with the reason, out of the queue."""

        def reject(exc: Exception) -> None:
            self.metrics.failures.labels(alias, "import").inc()
            reason = f"import_failed: {type(exc).__name__}: {str(exc)[:200]}"

            def settle(pipe: Any) -> None:
                unqueue_import(pipe, alias, version)
                self.rounds.candidates.drop(alias, version, reason, pipe)

            self.rounds.lifecycle.reject(
                alias, version, {"reason": reason, "origin": "import"}, also=settle
            )

        return reject

"""The canary's error test over clients: is the candidate's upstream failure rate worse than the
active version's by more than ``canary.max_error_rate_increase``, as its clients (not their
requests) met it?

Each client served on an arm is one unit: its own share of failed requests there,
``min(failed, served) / served`` in [0, 1], however many requests it sends. A client that sends
five requests and provokes one failure moves its arm by its one unit, as a client with a
thousand requests would: no key vetoes a canary by the requests it makes. Only failures that are
the replica's count (learner/canary_counter.py's ``UPSTREAM_FAILURES``); a whole answer cut at
``proxy.upstream_timeout_s`` does not, since a client provokes one with a large ``max_tokens``.
The anonymous client of a stack without API keys is everyone: each of its requests is a unit.

The test: the fixed looks of learner/canary_looks.py (look ``j`` at ``canary.min_clients * 2^j``
clients served on each arm, level ``alpha / 2^(j+1)``, each made once and recorded as
``error_look:v<version>:<j>`` in the canary's hash; why, there). The arms' mean shares are
compared as the ratings' test compares trimmed means (learner/canary_clients.py's :class:`Look`,
untrimmed here, with the padded error that never reads a zero spread as exact), and a look rolls
back when the one-sided lower bound of ``canary - active`` is above the margin. Over all of a
canary's checks a canary whose failures are within the margin is rolled back by this test with
probability at most ``alpha``, however often the watcher asks.

With fewer clients served than ``min_clients`` on an arm (a one-key app, after its wait) there
is no test to make, and the point estimate decides: the canary is decided on what it has, and
its reason says so (learner/canary.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from learner.canary_clients import Look
from learner.canary_looks import RecordedLook, look_field, record_looks
from learner.canary_looks import due_looks as looks_due
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.settings import CanaryConfig


def error_shares(per_client: dict[str, tuple[int, int]]) -> list[float]:
    """An arm's units: each client's share of failed requests (anonymous: one unit a request)."""
    shares: list[float] = []
    for client, (served, failed) in per_client.items():
        if served <= 0:
            continue
        failed = min(max(failed, 0), served)
        if client == ANONYMOUS_CLIENT:
            shares.extend([1.0] * failed + [0.0] * (served - failed))
        else:
            shares.append(failed / served)
    return shares


@dataclass(frozen=True)
class ErrorEvidence:
    """Both arms' units (:func:`error_shares`)."""

    active: tuple[float, ...]
    canary: tuple[float, ...]

    @classmethod
    def of(
        cls, active: dict[str, tuple[int, int]], canary: dict[str, tuple[int, int]]
    ) -> ErrorEvidence:
        return cls(tuple(error_shares(active)), tuple(error_shares(canary)))

    def rate(self, arm: str) -> float:
        """An arm's mean share over its clients (0.0: none served)."""
        units = self.canary if arm == "canary" else self.active
        return statistics.fmean(units) if units else 0.0

    def excess(self) -> float:
        return self.rate("canary") - self.rate("active")


# The error test's looks (learner/canary_looks.py).
ErrorLook = RecordedLook
ERROR_TEST = "error"


def due_looks(
    evidence: ErrorEvidence, config: CanaryConfig, made: Iterable[int]
) -> list[ErrorLook]:
    """The looks the clients served now call for that are not ``made`` yet, on these counts."""

    def make(index: int, clients: int, alpha: float) -> ErrorLook:
        look = Look.of(list(evidence.active), list(evidence.canary), 0.0, alpha)
        rates = evidence.rate("canary"), evidence.rate("active")
        return ErrorLook(index, clients, *rates, look.lower, alpha)

    served = min(len(evidence.active), len(evidence.canary))
    return looks_due(served, config, made, make)


def error_look_field(version: int, index: int) -> str:
    """The canary hash's field of look ``index`` of the canary of ``version``."""
    return look_field(ERROR_TEST, version, index)


def recorded_looks(
    client: redis.Redis, alias: str, version: int, evidence: ErrorEvidence, config: CanaryConfig
) -> list[ErrorLook]:
    """The canary's error looks: those recorded, and those due now made on ``evidence`` and
    recorded (HSETNX: where another replica recorded one first, its look stands)."""
    return record_looks(
        client, alias, version, ERROR_TEST, config, lambda made: due_looks(evidence, config, made)
    )


def error_rollback(
    evidence: ErrorEvidence,
    config: CanaryConfig,
    few: bool,
    looks: Iterable[ErrorLook] | None = None,
) -> str | None:
    """Why the canary's failures roll it back, or None. ``few``: fewer clients served than
    ``min_clients`` and the wait over, so the point estimate decides. ``looks``: the looks
    made so far (:func:`recorded_looks`); None: every look due made now, on ``evidence`` (a
    caller that asks once)."""
    margin = config.max_error_rate_increase
    if few:
        excess = evidence.excess()
        if not evidence.active or not evidence.canary or excess <= margin:
            return None
        return (
            f"error_rate: canary {evidence.rate('canary'):.3f} vs active "
            f"{evidence.rate('active'):.3f} over {len(evidence.canary)} and "
            f"{len(evidence.active)} clients (+{excess:.3f} > {margin})"
        )
    for look in due_looks(evidence, config, ()) if looks is None else looks:
        if look.lower > margin:
            return (
                f"error_rate: canary {look.canary:.3f} vs active {look.active:.3f} over "
                f"{look.clients} clients an arm (look {look.index + 1}), at least "
                f"+{look.lower:.3f} > {margin} ({1 - look.alpha:.2%})"
            )
    return None

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

The test. The arms' mean shares are compared as the ratings' test compares trimmed means
(learner/canary_clients.py's :class:`Look`, untrimmed here, with the padded error that never
reads a zero spread as exact): roll back when the one-sided lower bound of ``canary - active``
at ``canary.alpha`` is above the margin, and only with ``canary.min_clients`` clients on each
arm, as a ratings veto needs. With fewer clients served (a one-key app, after its wait) there
is no test to make, and the point estimate decides: the canary is decided on what it has, and
its reason says so (learner/canary.py).

The bound is recomputed at every check, so over a canary's checks it is not held to ``alpha``
exactly; it errs toward keeping a canary whose failures are not clearly worse.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from learner.canary_clients import Look
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


def error_rollback(evidence: ErrorEvidence, config: CanaryConfig, few: bool) -> str | None:
    """Why the canary's failures roll it back, or None. ``few``: fewer clients served than
    ``min_clients`` and the wait over, so the point estimate decides."""
    margin = config.max_error_rate_increase
    excess = evidence.excess()
    if not evidence.active or not evidence.canary or excess <= margin:
        return None
    rates = (
        f"error_rate: canary {evidence.rate('canary'):.3f} vs active "
        f"{evidence.rate('active'):.3f} over {len(evidence.canary)} and "
        f"{len(evidence.active)} clients (+{excess:.3f} > {margin})"
    )
    if few:
        return rates
    if min(len(evidence.active), len(evidence.canary)) < max(config.min_clients, 2):
        return None
    look = Look.of(list(evidence.active), list(evidence.canary), 0.0, config.alpha)
    if look.lower <= margin:
        return None
    return f"{rates}, at least +{look.lower:.3f} ({1 - config.alpha:.0%})"

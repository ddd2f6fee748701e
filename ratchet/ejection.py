"""Which vLLM replicas are ejected from the rotation for failing: outlier ejection. Pure.

A replica can fail in ways its health check does not see: an engine that stalls while
``/health`` still answers, a host that drops connections. Service meshes handle this by
*passive* health checking (Envoy's outlier detection is the model here): every request's outcome
is a vote, and a replica with ``consecutive_failures`` failures in a row (a connect failure, a
5xx, an answer that stalled past its first-byte deadline) is ejected, left out of the choice of
replica, for a while. The while grows with each ejection, ``base_s`` times the number of times it
was ejected, capped at ``max_s``, so a replica that keeps failing is tried less and less often;
the multiplier falls by one for each ``max_s`` it then stays in service.

Ejection is bounded: at most ``max_percent`` of the fleet at once (at least one replica, as
Envoy does, and never the last one), so a fault that is not the replicas' (a network blip, a
prompt that fails everywhere) cannot empty the fleet. A replica that comes back is on probation:
its first failure ejects it again, until it answers once.

The clock is passed in (``now``, seconds, monotonic); no I/O, no time of its own.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ratchet.settings.proxy import OutlierEjectionSettings


@dataclass(frozen=True)
class EjectionPolicy:
    """``consecutive_failures`` 0 turns ejection off."""

    consecutive_failures: int = 5
    base_s: float = 30.0
    max_s: float = 300.0
    max_percent: float = 50.0

    @classmethod
    def of(cls, settings: OutlierEjectionSettings) -> EjectionPolicy:
        """The policy of ``proxy.outlier_ejection``: the proxy's, the judge's and the
        learner's alike."""
        return cls(
            settings.consecutive_failures,
            settings.base_ejection_s,
            settings.max_ejection_s,
            settings.max_ejection_percent,
        )

    @property
    def enabled(self) -> bool:
        return self.consecutive_failures > 0

    def allowed(self, fleet_size: int) -> int:
        """How many of a fleet of ``fleet_size`` may be ejected at once: ``max_percent`` of
        it, at least one, never all."""
        share = math.floor(fleet_size * self.max_percent / 100.0)
        return min(max(1, share), fleet_size - 1)


@dataclass
class ReplicaOutcomes:
    """One replica's record: failures in a row, how often and until when it was ejected."""

    consecutive: int = 0
    multiplier: int = 0  # the current ejection's length in base_s; decays while in service
    ejected_until: float = 0.0
    ejections: int = 0  # every ejection ever (a counter, for the metrics)
    probation: bool = False  # back from an ejection and not yet answered once


@dataclass
class Outliers:
    """The fleet's ejections under ``policy``: told each request's outcome per replica."""

    policy: EjectionPolicy = field(default_factory=EjectionPolicy)
    replicas: dict[str, ReplicaOutcomes] = field(default_factory=dict)

    def record(self, url: str) -> ReplicaOutcomes:
        found = self.replicas.get(url)
        if found is None:
            found = self.replicas[url] = ReplicaOutcomes()
        return found

    def is_ejected(self, url: str, now: float) -> bool:
        found = self.replicas.get(url)
        return found is not None and found.ejected_until > now

    def ejected(self, fleet: Collection[str], now: float) -> list[str]:
        """The replicas of ``fleet`` ejected at ``now``."""
        return [url for url in fleet if self.is_ejected(url, now)]

    def succeeded(self, url: str, now: float) -> None:
        """``url`` answered: its run of failures ends, and so does its probation (unless it is
        out: a request sent before its ejection says nothing of it since)."""
        found = self.replicas.get(url)
        if found is not None and found.ejected_until <= now:
            found.consecutive = 0
            found.probation = False

    def failed(self, url: str, fleet: Collection[str], now: float) -> bool:
        """``url`` failed a request; True when this ejects it. ``fleet``: every replica now
        (what the bound on ejections is a share of)."""
        found = self.record(url)
        if found.ejected_until > now:  # already out: requests sent before it was ejected
            return False
        found.consecutive += 1
        threshold = 1 if found.probation else self.policy.consecutive_failures
        if not self.policy.enabled or found.consecutive < threshold:
            return False
        if len(self.ejected(fleet, now)) >= self.policy.allowed(len(fleet)):
            return False  # the bound: this one stays, still counting
        self._eject(found, now)
        return True

    def forget(self, fleet: Collection[str]) -> None:
        """Drop the records of replicas that left the fleet."""
        for url in [u for u in self.replicas if u not in fleet]:
            del self.replicas[url]

    def _eject(self, found: ReplicaOutcomes, now: float) -> None:
        if found.ejected_until:  # one off the multiplier per max_s in service since the last
            in_service = now - found.ejected_until
            found.multiplier = max(0, found.multiplier - math.floor(in_service / self.policy.max_s))
        found.multiplier += 1
        found.ejections += 1
        found.consecutive = 0
        found.probation = True
        found.ejected_until = now + min(self.policy.max_s, self.policy.base_s * found.multiplier)

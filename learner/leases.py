"""Which learner replica works on an alias: the one holding its lease.

Any number of learners may run. Kafka spreads ``ratchet.groups`` (keyed by alias) over them, but
an assignment moves during a rebalance while a round on the old one may still be running, and
every replica watches every canary. So each alias's rounds and canary decisions run only under
its lease, ``ratchet:learner:<alias>:lease`` (ratchet/lease.py): taken when one is due, renewed
while it runs, released after, and every write of its outcome is fenced by it. A replica that
finds the lease taken leaves the alias to its holder this time (counted); one that dies frees it
after ``learner.lease_ttl_s``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator

import redis

from learner.metrics import LearnerMetrics
from ratchet.lease import Lease, LeaseKeeper

log = logging.getLogger(__name__)


def lease_key(alias: str) -> str:
    """String: the token of the learner replica working on the alias now, with a TTL."""
    return f"ratchet:learner:{alias}:lease"


class _Holds:
    """What the holders of one replica share: one Lease per alias, and how many of them hold it
    now (the lease is released when the last one is done)."""

    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}
        self.holders: Counter[str] = Counter()
        self.lock = threading.Lock()


class AliasLeases:
    """One holder's leases (a round loop, a canary watcher): one Lease per alias, kept renewed
    by a shared keeper while held. Holders made with :meth:`sharing` are threads of one replica
    that hold the same leases: while one holds an alias's lease the other may act under it too
    (a round that trains on from a canary must not keep the canary's own decision waiting)."""

    def __init__(
        self,
        client: redis.Redis,
        ttl_s: float,
        keeper: LeaseKeeper,
        metrics: LearnerMetrics,
        what: str,
        holds: _Holds | None = None,
    ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.keeper = keeper
        self.metrics = metrics
        self.what = what  # "round" or "canary", for the metrics' labels
        self._holds = holds or _Holds()

    def sharing(self, what: str) -> AliasLeases:
        """Another holder in this replica, holding the same leases as this one."""
        return AliasLeases(self.client, self.ttl_s, self.keeper, self.metrics, what, self._holds)

    def lease(self, alias: str) -> Lease:
        with self._holds.lock:
            if alias not in self._holds.leases:
                self._holds.leases[alias] = Lease(self.client, lease_key(alias), self.ttl_s)
            return self._holds.leases[alias]

    def _take(self, alias: str) -> Lease | None:
        """The alias's lease, held by one more holder here; None if another replica has it."""
        lease = self.lease(alias)
        with self._holds.lock:
            if not self._holds.holders[alias]:
                if not lease.acquire():
                    return None
                self.keeper.keep(lease)
                self.metrics.lease_held.labels(alias).set(1)
            self._holds.holders[alias] += 1
        return lease

    def _give_back(self, alias: str, lease: Lease) -> None:
        with self._holds.lock:
            self._holds.holders[alias] -= 1
            if self._holds.holders[alias]:
                return  # another holder here still acts under it
            del self._holds.holders[alias]
            self.keeper.drop(lease)
            self.metrics.lease_held.labels(alias).set(0)
            try:
                lease.release()
            except (redis.RedisError, OSError) as exc:
                # It expires by itself: the next holder waits out its TTL at most.
                log.warning("could not release %s (%s)", lease.key, exc)

    @contextlib.contextmanager
    def hold(self, alias: str) -> Iterator[Lease | None]:
        """The alias's lease, held and renewed for the block; None if another replica has it."""
        lease = self._take(alias)
        if lease is None:
            self.metrics.lease_waits.labels(alias, self.what).inc()
            yield None
            return
        try:
            yield lease
        finally:
            self._give_back(alias, lease)

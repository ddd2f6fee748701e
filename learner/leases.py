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
from collections.abc import Iterator

import redis

from learner.metrics import LearnerMetrics
from ratchet.lease import Lease, LeaseKeeper

log = logging.getLogger(__name__)


def lease_key(alias: str) -> str:
    """String: the token of the learner replica working on the alias now, with a TTL."""
    return f"ratchet:learner:{alias}:lease"


class AliasLeases:
    """One holder's leases (a round loop, a canary watcher): one Lease per alias, kept renewed
    by a shared keeper while held."""

    def __init__(
        self,
        client: redis.Redis,
        ttl_s: float,
        keeper: LeaseKeeper,
        metrics: LearnerMetrics,
        what: str,
    ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.keeper = keeper
        self.metrics = metrics
        self.what = what  # "round" or "canary", for the metrics' labels
        self._leases: dict[str, Lease] = {}

    def lease(self, alias: str) -> Lease:
        if alias not in self._leases:
            self._leases[alias] = Lease(self.client, lease_key(alias), self.ttl_s)
        return self._leases[alias]

    @contextlib.contextmanager
    def hold(self, alias: str) -> Iterator[Lease | None]:
        """The alias's lease, held and renewed for the block; None if another holder has it."""
        lease = self.lease(alias)
        if not lease.acquire():
            self.metrics.lease_waits.labels(alias, self.what).inc()
            yield None
            return
        self.keeper.keep(lease)
        self.metrics.lease_held.labels(alias).set(1)
        try:
            yield lease
        finally:
            self.keeper.drop(lease)
            self.metrics.lease_held.labels(alias).set(0)
            try:
                lease.release()
            except (redis.RedisError, OSError) as exc:
                # It expires by itself: the next holder waits out its TTL at most.
                log.warning("could not release %s (%s)", lease.key, exc)

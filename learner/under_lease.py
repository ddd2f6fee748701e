"""Work on an alias under its lease: a round, the settling of a held candidate, an import's gate.

Each runs the same way (:meth:`AliasWork.under_lease`): take the alias's lease (learner/leases.py;
nothing if another replica holds it), read the routes afresh (another replica may have promoted,
paused or trained meanwhile), check the work is still due, then do it with every write fenced by
the lease, and count it as the alias's work (``interval_s`` counts afresh from its end). How it
can end is the same for all three:

- the lease lost (stalled past its TTL): abandoned, counted; what it would have settled stays
  as it was, for whoever holds the lease next;
- an outage (Kafka, Redis, the network): raised, so the loop retries the step once the part is
  back, nothing committed past;
- any other failure (a bug, bad data): logged and handed to the caller's ``on_error`` (which
  pauses the alias or rejects the import), so it cannot fail the same way forever.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis
from kafka.errors import KafkaError

from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from ratchet.lease import LeaseLost
from ratchet.lifecycle import Lifecycle

log = logging.getLogger(__name__)

# An outage: retried once the part is back, never held against the work; a lost lease: abandoned.
NOT_THE_WORKS_FAULT = (KafkaError, redis.RedisError, OSError, LeaseLost)

Due = TypeVar("Due")
Done = TypeVar("Done")


class AliasWork:
    """The alias-level work of one learner replica, each piece under the alias's lease, and when
    each alias's last piece here ended."""

    def __init__(
        self,
        leases: AliasLeases,
        lifecycle: Lifecycle,
        metrics: LearnerMetrics,
        refresh_routes: Callable[[], None],
    ) -> None:
        self.leases = leases
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.refresh_routes = refresh_routes
        # When each alias's last round, held settling or import gate here ended (monotonic).
        self.worked_at: dict[str, float] = {}

    @contextlib.contextmanager
    def working(self, alias: str) -> Iterator[None]:
        """A piece of the alias's work: when it ends, however, ``interval_s`` counts from there."""
        try:
            yield
        finally:
            self.worked_at[alias] = time.monotonic()

    def under_lease(
        self,
        alias: str,
        what: str,
        due: Callable[[], Due | None],
        work: Callable[[Due], Done],
        on_error: Callable[[Exception], None],
    ) -> Done | None:
        """``work`` on what ``due`` returns, under the alias's lease (module docstring); None when
        another replica holds the lease, when ``due`` (run under the lease, after the routes are
        read again, outside the fence) finds nothing to do, or when the work failed or lost the
        lease. ``what`` names the work in the log."""
        with self.leases.hold(alias) as lease:
            if lease is None:
                return None
            self.refresh_routes()
            found = due()
            if found is None:
                return None
            try:
                with self.lifecycle.fenced(lease), self.working(alias):
                    try:
                        return work(found)
                    except NOT_THE_WORKS_FAULT:
                        raise
                    except Exception as exc:
                        log.exception("%s: %s failed", alias, what)
                        on_error(exc)
                        return None
            except LeaseLost as exc:
                # Stalled past the TTL: another learner may be on this alias now.
                log.warning("%s: %s abandoned: %s", alias, what, exc)
                self.metrics.lease_lost.labels(alias, "round").inc()
                return None

"""Whether the judge samples for an alias now: only while the learner needs groups.

The decision is ``ratchet.progress.sampling_decision`` on two things in Redis: the alias's
``LearnerProgress`` and the judges' ``groups_produced`` counter. A decision to sample reads them
at most once per ``CACHE_S`` per alias (a batch asks for every record it samples); a decision not
to sample is always read afresh, so the judge samples the moment the learner catches up. The
groups this judge has cleared to sample but Kafka has not yet acknowledged are added to the
counter, so one batch cannot overshoot the bound by its own size. Without Redis the judge
samples, as before backpressure existed: the groups wait in Kafka, nothing is lost.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import redis
import redis.asyncio as aioredis

from ratchet.progress import (
    LearnerProgress,
    SamplingDecision,
    produced_key,
    progress_key,
    sampling_decision,
)

log = logging.getLogger(__name__)

# How long a read of the learner's progress is believed. The learner moves in seconds (a group
# read, a step trained); re-reading it for every record of a batch would only load Redis.
CACHE_S = 1.0


class Reading(NamedTuple):
    progress: LearnerProgress | None
    produced: int
    at: float


class Backpressure:
    def __init__(
        self,
        client: aioredis.Redis,
        max_pending: int,
        pause_while_training: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.max_pending = max_pending  # judge.max_pending_rounds x learner.batch_groups; 0: none
        self.pause_while_training = pause_while_training
        self.clock = clock
        self.readings: dict[str, Reading] = {}
        self.cleared: Counter[str] = Counter()  # cleared to sample, not yet acknowledged

    async def clear(self, alias: str) -> SamplingDecision:
        """Decide for one group of ``alias``; a group cleared counts as pending at once. A "no"
        is never taken from the cache: the moment the learner catches up (or goes away), the
        next record is sampled. Reading Redis per skipped record costs nothing the judge needs
        (it is idle for that alias then)."""
        cached = self._cached(alias)
        decision = self._decide(alias, cached or await self._read(alias))
        if not decision.sample and cached is not None:
            decision = self._decide(alias, await self._read(alias))
        if decision.sample:
            self.cleared[alias] += 1
        return decision

    def _decide(self, alias: str, reading: Reading) -> SamplingDecision:
        return sampling_decision(
            reading.progress,
            reading.produced + self.cleared[alias],
            self.max_pending,
            self.pause_while_training,
        )

    def release(self, alias: str) -> None:
        """A cleared group that will not be produced (its sampling or scoring failed)."""
        if self.cleared[alias] > 0:
            self.cleared[alias] -= 1

    async def count_produced(self, produced: Counter[str]) -> None:
        """Add groups Kafka acknowledged to each alias's shared counter (INCRBY)."""
        for alias, count in produced.items():
            self.cleared[alias] = max(0, self.cleared[alias] - count)
        if not produced:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for alias, count in produced.items():
                pipe.incrby(produced_key(alias), count)
            totals = await pipe.execute()
        except (redis.RedisError, OSError) as exc:
            # Under-counted groups make the judge sample a little more than the bound, not less.
            log.warning("could not count %d produced groups (%s)", sum(produced.values()), exc)
            return
        for alias, total in zip(produced, totals, strict=True):
            cached = self.readings.get(alias)
            if cached is not None:
                self.readings[alias] = cached._replace(produced=int(total))

    def _cached(self, alias: str) -> Reading | None:
        cached = self.readings.get(alias)
        return cached if cached is not None and self.clock() - cached.at < CACHE_S else None

    async def _read(self, alias: str) -> Reading:
        now = self.clock()
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(progress_key(alias))
            pipe.get(produced_key(alias))
            raw, produced = await pipe.execute()
            reading = Reading(LearnerProgress.from_hash(alias, raw), int(produced or 0), now)
        except (redis.RedisError, OSError, ValueError):
            reading = Reading(None, 0, now)  # Redis away: sample, as without backpressure
        self.readings[alias] = reading
        return reading

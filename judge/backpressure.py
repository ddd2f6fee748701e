"""Whether the judge samples for an alias now: only while the learner needs groups.

The decision is ``ratchet.progress.sampling_decision`` on two things in Redis: the alias's
``LearnerProgress`` and the judges' ``groups_produced`` counter. A decision to sample reads them
at most once per ``CACHE_S`` per alias (a batch asks for every record it samples); a decision not
to sample is always read afresh, so the judge samples the moment the learner catches up. The
groups this judge has cleared to sample but Kafka has not yet acknowledged are added to the
counter, so one batch cannot overshoot the bound by its own size. Without Redis the judge
samples, as before backpressure existed: the groups wait in Kafka, nothing is lost.

Per client: the judge remembers the clients of the last groups it cleared for each alias (a
window as long as the bound). Of the pending groups, those past their client's share
(``learning.max_key_share``, or an even split among fewer clients) do not count against the
bound, since no round could use them; and while the pending groups reach the bound, only a client
under its share is cleared (skip reason ``client_share``). So one flooding client neither fills
the bound nor stops the others' groups from being made.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from itertools import islice
from typing import NamedTuple

import redis
import redis.asyncio as aioredis

from ratchet.progress import (
    LearnerProgress,
    SamplingDecision,
    client_cap,
    pending_groups,
    produced_key,
    progress_key,
    sampling_decision,
    unusable_groups,
)

log = logging.getLogger(__name__)

# How long a read of the learner's progress is believed. The learner moves in seconds (a group
# read, a step trained); re-reading it for every record of a batch would only load Redis.
CACHE_S = 1.0
# The clients of this many groups cleared last are remembered per alias when the bound is lower
# (or off): enough to order a batch by who was served least.
MIN_WINDOW = 256


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
        # Per alias, the clients of the groups cleared last, newest last.
        self.recent: dict[str, deque[str]] = {}
        # One decision at a time, in the order asked (asyncio's lock is first come, first
        # served): the judge asks in its fair order, and a Redis read must not reorder them.
        self._turn = asyncio.Lock()

    async def clear(self, alias: str, client: str, share: float) -> SamplingDecision:
        """Decide for one group of ``alias`` from ``client``, whose share of a round is at most
        ``share`` (``learning.max_key_share``); a group cleared counts as pending at once. A "no"
        is never taken from the cache: the moment the learner catches up (or goes away), the
        next record is sampled. Reading Redis per skipped record costs nothing the judge needs
        (it is idle for that alias then)."""
        async with self._turn:
            cached = self._cached(alias)
            decision = self._decide(alias, client, share, cached or await self._read(alias))
            if not decision.sample and cached is not None:
                decision = self._decide(alias, client, share, await self._read(alias))
            if decision.sample:
                self.cleared[alias] += 1
                self._window(alias).append(client)
            return decision

    def _decide(self, alias: str, client: str, share: float, reading: Reading) -> SamplingDecision:
        produced = reading.produced + self.cleared[alias]
        counts = self.pending_by_client(alias, pending_groups(reading.progress, produced))
        counts[client] += 0  # the asking client shares the rounds too
        size = self.max_pending
        decision = sampling_decision(
            reading.progress,
            produced,
            size,
            self.pause_while_training,
            unusable_groups(counts, size, share) if size else 0,
        )
        # Past the bound only because others' groups are not usable: a client may add only
        # while under its own share.
        over = decision.sample and size and decision.pending >= size
        if over and counts[client] >= client_cap(size, share, len(counts)):
            return SamplingDecision(False, "client_share", decision.pending)
        return decision

    def pending_by_client(self, alias: str, pending: int) -> Counter[str]:
        """The clients of the newest ``pending`` groups this judge cleared for ``alias``: the
        groups still pending, as far as this judge knows (older ones, and other judges', are
        not told apart and count as nobody's)."""
        return Counter(islice(reversed(self._window(alias)), pending))

    def served(self, alias: str) -> Counter[str]:
        """How many of the groups cleared last for ``alias`` went to each client."""
        return Counter(self._window(alias))

    def _window(self, alias: str) -> deque[str]:
        window = self.recent.get(alias)
        if window is None:
            window = self.recent[alias] = deque(maxlen=max(self.max_pending, MIN_WINDOW))
        return window

    def release(self, alias: str, client: str) -> None:
        """A cleared group that will not be produced (its sampling or scoring failed)."""
        if self.cleared[alias] > 0:
            self.cleared[alias] -= 1
        window = self._window(alias)
        for at in range(len(window) - 1, -1, -1):  # its latest clearance
            if window[at] == client:
                del window[at]
                break

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

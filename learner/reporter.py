"""Publishing each alias's :class:`~ratchet.progress.LearnerProgress`, throttled and never fatal.

The service's loop and a round's phases both report through one :class:`ProgressReporter`. A
new phase is written at once (the judge pauses its sampling on ``train``); any other change at
most every ``min_interval_s`` per alias (a round's steps, the waiting count of each poll); an
unchanged hash is rewritten every ``refresh_s`` so its TTL does not lapse under a live learner.
Groups read while a write is held back are added to the ``read`` counter with the next write. A
Redis error is counted and logged, never raised: progress is for people and for the judge's
backpressure, and neither is worth a round or the loop.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import redis

from learner.metrics import LearnerMetrics
from ratchet.progress import PHASES, PROGRESS_TTL_S, LearnerProgress, publish

log = logging.getLogger(__name__)

# Writes of one alias's progress are at least this far apart unless its phase changes: a round's
# steps and the loop's polls come far more often than anyone reads the hash.
MIN_INTERVAL_S = 2.0
# An unchanged hash is rewritten this often, well inside its TTL.
REFRESH_S = PROGRESS_TTL_S / 5


class ProgressReporter:
    def __init__(
        self,
        client: redis.Redis,
        metrics: LearnerMetrics,
        min_interval_s: float = MIN_INTERVAL_S,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.min_interval_s = min_interval_s
        self.refresh_s = refresh_s
        self.clock = clock
        self.written: dict[str, LearnerProgress] = {}  # what Redis holds, as far as we know
        self.written_at: dict[str, float] = {}
        self.unsent_reads: dict[str, int] = defaultdict(int)
        self.latest: dict[str, LearnerProgress] = {}  # the last reported, written or not

    def report(self, progress: LearnerProgress, read_delta: int = 0) -> bool:
        """Note the alias's progress (and groups read since the last call); write it to Redis
        if the throttle allows. True when written."""
        alias = progress.alias
        self.latest[alias] = progress
        self.unsent_reads[alias] += read_delta
        self._metrics(progress)
        last = self.written.get(alias)
        age = self.clock() - self.written_at.get(alias, -float("inf"))
        changed = last is None or _content(last) != _content(progress)
        due = (
            last is None
            or last.phase != progress.phase
            or ((changed or self.unsent_reads[alias] > 0) and age >= self.min_interval_s)
            or age >= self.refresh_s
        )
        return self._write(progress) if due else False

    def _write(self, progress: LearnerProgress) -> bool:
        alias = progress.alias
        try:
            publish(self.client, progress, read_delta=self.unsent_reads[alias])
        except (redis.RedisError, OSError) as exc:
            # The reads stay unsent and go with the next write (a write that failed after Redis
            # applied it counts them twice: the judge then samples a little more, never less).
            self.metrics.progress_errors.labels(alias).inc()
            log.warning("%s: could not publish learner progress: %s", alias, exc)
            return False
        self.unsent_reads[alias] = 0
        self.written[alias] = progress
        self.written_at[alias] = self.clock()
        return True

    def _metrics(self, progress: LearnerProgress) -> None:
        m, alias = self.metrics, progress.alias
        for phase in PHASES:
            m.round_phase.labels(alias, phase).set(1 if phase == progress.phase else 0)
        m.round_step.labels(alias).set(progress.step)
        m.round_steps.labels(alias).set(progress.steps)


def _content(progress: LearnerProgress) -> LearnerProgress:
    return replace(progress, updated_at=0.0, read=0)

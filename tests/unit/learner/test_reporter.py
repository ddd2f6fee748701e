"""The throttle in front of the learner's progress hash (learner/reporter.py), against a real Redis
with a hand-moved clock, and a Redis that is away."""

from __future__ import annotations

from dataclasses import replace

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from embedded.processes import free_port
from learner.metrics import LearnerMetrics
from learner.reporter import ProgressReporter
from ratchet.progress import LearnerProgress, progress_key, read_progress

ALIAS = "support"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reporter(client: redis.Redis, clock: Clock) -> ProgressReporter:
    return ProgressReporter(
        client, LearnerMetrics(), min_interval_s=2.0, refresh_s=60.0, clock=clock
    )


def test_changes_are_written_at_most_every_interval_and_phases_at_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    r = reporter(client, clock)
    idle = LearnerProgress(ALIAS, waiting=1, batch_groups=16)
    assert r.report(idle, read_delta=1)  # the first report is written
    assert not r.report(idle)  # unchanged
    assert not r.report(replace(idle, waiting=2), read_delta=1)  # changed, but too soon
    assert not r.report(replace(idle, waiting=3), read_delta=2)
    held = read_progress(client, ALIAS)
    assert held is not None and (held.waiting, held.read) == (1, 1)
    clock.now += 2.0
    assert r.report(replace(idle, waiting=3))  # the held-back change, reads included
    held = read_progress(client, ALIAS)
    assert held is not None and (held.waiting, held.read) == (3, 4)
    clock.now += 0.1
    assert r.report(replace(idle, phase="train", steps=4))  # a new phase: at once
    clock.now += 0.1
    assert not r.report(replace(idle, phase="train", step=1, steps=4))
    assert not r.report(replace(idle, phase="train", step=1, steps=4))
    clock.now += 59.9
    assert r.report(replace(idle, phase="train", step=1, steps=4))  # throttled, then due
    clock.now += 60.0
    assert r.report(replace(idle, phase="train", step=1, steps=4))  # unchanged: kept alive
    assert 0 < client.ttl(progress_key(ALIAS)) <= 300


def test_reads_alone_are_published_once_the_interval_passes(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    r = reporter(client, clock)
    idle = LearnerProgress(ALIAS)
    r.report(idle, read_delta=3)  # e.g. three groups read and all dropped
    assert not r.report(idle, read_delta=2)
    clock.now += 2.0
    assert r.report(idle)
    held = read_progress(client, ALIAS)
    assert held is not None and held.read == 5


def test_a_redis_error_is_counted_not_raised_and_its_reads_go_with_the_next_write(
    redis_url: str,
) -> None:
    # No retries: redis-py's default backs off for seconds before it gives up on a closed port.
    away = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    clock = Clock()
    r = reporter(away, clock)
    progress = LearnerProgress(ALIAS, waiting=2)
    assert not r.report(progress, read_delta=2)
    assert not r.report(replace(progress, phase="train"), read_delta=1)
    errors = r.metrics.registry.get_sample_value(
        "ratchet_learner_progress_errors_total", {"alias": ALIAS}
    )
    assert errors == 2
    # The phase gauges follow what was reported, whether or not Redis took it.
    phase = r.metrics.registry.get_sample_value(
        "ratchet_learner_round_phase", {"alias": ALIAS, "phase": "train"}
    )
    assert phase == 1
    r.client = redis.Redis.from_url(redis_url)  # Redis is back
    assert r.report(replace(progress, phase="train"))
    held = read_progress(r.client, ALIAS)
    assert held is not None and (held.phase, held.read) == ("train", 3)

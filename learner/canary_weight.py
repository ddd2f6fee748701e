"""How much traffic a new canary gets: enough to reach ``canary.min_requests`` in
``canary.target_duration_s`` at the alias's recent request rate, between ``canary.weight`` and
``canary.max_weight``.

What a canary risks is the requests its candidate answers, and ``min_requests`` fixes how many
it must answer before anything is decided. At a fixed 10% share, a busy alias gets there in
seconds and a quiet one in hours (measured here: 25 minutes on the embedded stack's ~20 answers a
minute), while its users meet the same number of candidate answers either way. So a quiet alias's
canary takes a larger share, never above ``max_weight``, and a busy one keeps ``weight``.

The rate is counted by every learner replica's canary watcher, which reads all of
``ratchet.traffic``, into per-minute Redis counters (``ratchet:learner:<alias>:requests:<minute>``,
by each record's own timestamp), so replicas that split the topic's partitions add up to the
whole alias.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from datetime import datetime
from typing import Any

import redis

from ratchet.settings import CanaryConfig

BUCKET_S = 60
# The rate is the mean over this many minutes (the current one included): long enough to smooth
# bursts, short enough to follow a day's traffic.
WINDOW_BUCKETS = 10


def requests_key(alias: str, minute: int) -> str:
    return f"ratchet:learner:{alias}:requests:{minute}"


def minute_of(ts: str) -> int | None:
    """The unix minute of a record's ISO timestamp (None: unreadable)."""
    try:
        return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()) // BUCKET_S
    except ValueError:
        return None


def count_requests(pipe: Any, counts: Counter[tuple[str, int]]) -> None:
    """Queue the ``(alias, minute)`` request counts on a Redis pipeline; each counter expires
    once it has left the window."""
    for (alias, minute), n in counts.items():
        pipe.incrby(requests_key(alias, minute), n)
        pipe.expire(requests_key(alias, minute), (WINDOW_BUCKETS + 2) * BUCKET_S)


def requests_per_second(client: redis.Redis, alias: str, now: float | None = None) -> float:
    """The alias's mean request rate over the window (0.0: none counted)."""
    now = time.time() if now is None else now
    current = int(now) // BUCKET_S
    minutes = range(current - WINDOW_BUCKETS + 1, current + 1)
    counts: list[Any] = client.mget([requests_key(alias, m) for m in minutes])
    total = sum(int(c) for c in counts if c is not None)
    # The current minute has run only so far: the window is that much shorter.
    span = (WINDOW_BUCKETS - 1) * BUCKET_S + (now - current * BUCKET_S)
    return total / span


def canary_weight(config: CanaryConfig, requests_per_s: float) -> float:
    """The share that brings ``min_requests`` canary answers within ``target_duration_s``, at
    least ``weight`` and at most ``max_weight`` (a ``max_weight`` at or below ``weight`` keeps
    the share fixed). No traffic counted: the most, since a quiet alias is the one that waits."""
    low, high = config.weight, max(config.weight, config.max_weight)
    if requests_per_s <= 0:
        return high
    wanted = config.min_requests / (requests_per_s * config.target_duration_s)
    # Rounded up to a percent: a readable share that still brings min_requests in time.
    return min(high, max(low, math.ceil(wanted * 100) / 100))

"""A new canary's share of traffic (learner/canary_weight.py): the pure sizing, the per-minute
counters in a real Redis, and a round starting its canary at the size they give (the watcher
counting traffic into them is in test_canary.py)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from learner.canary_weight import (
    canary_weight,
    count_requests,
    minute_of,
    requests_key,
    requests_per_second,
)
from ratchet.settings import CanaryConfig
from tests.unit.learner.test_canary import ALIAS
from tests.unit.learner.test_round import make_rounds, run, script_gate, verdict

CONFIG = CanaryConfig(weight=0.1, max_weight=0.5, min_requests=50, target_duration_s=300)


def test_a_busy_alias_keeps_its_weight_and_a_quiet_one_gets_up_to_max_weight() -> None:
    # 50 canary requests in 300 s: at 10 requests/s 0.1 is plenty (0.017 would do).
    assert canary_weight(CONFIG, 10.0) == 0.1
    # At 1 request/s 0.17 of the traffic brings 51 canary answers in 300 s.
    assert canary_weight(CONFIG, 1.0) == 0.17
    # The embedded stack's ~20 answers a minute would need all of it: the cap.
    assert canary_weight(CONFIG, 20 / 60) == 0.5
    assert canary_weight(CONFIG, 0.0) == 0.5  # nothing counted: a quiet alias


def test_a_max_weight_at_or_below_weight_keeps_the_share_fixed() -> None:
    fixed = CONFIG.model_copy(update={"max_weight": 0.1})
    assert canary_weight(fixed, 0.01) == 0.1
    below = CONFIG.model_copy(update={"weight": 0.3, "max_weight": 0.2})
    assert canary_weight(below, 0.0) == 0.3 and canary_weight(below, 100.0) == 0.3


def test_the_rate_is_the_mean_over_the_window_by_the_records_minutes(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    now = 1_000_000 * 60 + 30.0  # 30 s into a minute
    minute = int(now) // 60
    pipe = client.pipeline()
    # 300 requests a minute over the nine whole minutes before, and 150 in this half minute.
    count_requests(pipe, Counter({(ALIAS, minute - k): 300 for k in range(1, 10)}))
    count_requests(pipe, Counter({(ALIAS, minute): 150, ("other", minute): 10_000}))
    count_requests(pipe, Counter({(ALIAS, minute - 10): 99_999}))  # outside the window
    pipe.execute()
    assert requests_per_second(client, ALIAS, now) == pytest.approx(5.0)
    assert requests_per_second(client, "quiet", now) == 0.0
    assert 0 < client.ttl(requests_key(ALIAS, minute)) <= 12 * 60  # gone once out of the window
    assert minute_of("1970-01-01T00:02:59.999Z") == 2 and minute_of("not a time") is None


def test_a_round_sizes_its_canary_by_the_aliases_recent_traffic(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)  # min_requests 50, 300 s
    script_gate(rounds, monkeypatch, verdict(passed=True))
    minute = int(time.time()) // 60
    pipe = rounds.redis.pipeline()
    count_requests(pipe, Counter({(ALIAS, minute - k): 60 for k in range(10)}))  # ~1 a second
    pipe.execute()
    assert run(rounds).outcome == "canary"
    route = rounds.lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary == 1
    assert 0.1 < route.canary_weight < 0.5  # 0.1 would take about 500 s at this rate
    [event] = [e for e in rounds.lifecycle.writer.history(ALIAS) if e["kind"] == "canary"]
    assert event["detail"]["weight"] == route.canary_weight
    assert event["detail"]["requests_per_minute"] > 55

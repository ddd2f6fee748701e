"""bench/canary_time.py plays a canary in time with the learner's own verdict: where no user
rates, the wait decides it; where many do, the sequential test does, in the right direction."""

from __future__ import annotations

import random

import pytest

from bench.canary_time import Traffic, parse_set, play, summarise
from ratchet.settings import CanaryConfig


def test_a_canary_nobody_rates_is_decided_when_the_wait_runs_out() -> None:
    config = CanaryConfig()  # 50 canary requests, 300 s wait; at 20 a minute the share is 0.5
    traffic = Traffic(rate_per_min=20, rated=0.0, lag_s=30, noise=0.0, tick_s=10)
    outcome = play(random.Random(0), config, traffic, 0.6, 0.6)
    assert outcome.verdict == "promote" and not outcome.by_test
    # min_requests at ~10 a minute: about five minutes, the wait's 300 s within it.
    assert 4.0 <= outcome.minutes <= 8.0, outcome


@pytest.mark.parametrize(("p_canary", "verdict"), [(0.95, "promote"), (0.2, "rollback")])
def test_on_a_busy_alias_whose_users_rate_the_test_decides(p_canary: float, verdict: str) -> None:
    traffic = Traffic(rate_per_min=600, rated=1.0, lag_s=5, noise=0.0, tick_s=10)
    config = CanaryConfig(feedback_wait_s=3600)
    outcomes = [play(random.Random(i), config, traffic, 0.5, p_canary) for i in range(5)]
    assert all(o.verdict == verdict and o.by_test for o in outcomes), outcomes
    assert summarise(outcomes)["promoted"] == (1.0 if verdict == "promote" else 0.0)


def test_set_reads_canary_fields_and_refuses_others() -> None:
    assert parse_set(["canary.feedback_wait_s=900", "canary.alpha=0.1"]) == {
        "feedback_wait_s": 900,
        "alpha": 0.1,
    }
    with pytest.raises(SystemExit, match="canary"):
        parse_set(["gate.alpha=0.1"])

"""bench/canary_time.py plays a canary in time with the learner's own verdict (imported through
bench/canary_attack.py's Code): where no user rates, the wait decides it; where many do, the
test over clients does, in the right direction."""

from __future__ import annotations

import random

import pytest

from bench.canary_attack import Code
from bench.canary_time import Traffic, parse_set, play, rating, summarise
from ratchet.settings import CanaryConfig

CODE = Code(None)  # this checkout's verdict


def test_a_canary_nobody_rates_is_decided_when_the_wait_runs_out() -> None:
    config = CanaryConfig()  # 50 canary requests, 600 s wait; at 20 a minute the share is 0.5
    traffic = Traffic(rate_per_min=20, rated=0.0, lag_s=30, noise=0.0, tick_s=10)
    outcome = play(random.Random(0), CODE, config, traffic, 0.6, 0.6)
    assert outcome.verdict == "promote" and not outcome.by_test
    # An alias that learns from ratings is not decided unrated before its wait.
    assert outcome.minutes == config.feedback_wait_s / 60, outcome


@pytest.mark.parametrize(("p_canary", "verdict"), [(0.95, "promote"), (0.2, "rollback")])
def test_on_a_busy_alias_whose_users_rate_the_test_decides(p_canary: float, verdict: str) -> None:
    traffic = Traffic(rate_per_min=600, rated=1.0, lag_s=5, noise=0.0, tick_s=10)
    config = CanaryConfig(feedback_wait_s=3600)
    outcomes = [play(random.Random(i), CODE, config, traffic, 0.5, p_canary) for i in range(5)]
    assert all(o.verdict == verdict and o.by_test for o in outcomes), outcomes
    assert summarise(outcomes)["promoted"] == (1.0 if verdict == "promote" else 0.0)


def test_set_reads_canary_fields_and_refuses_others() -> None:
    assert parse_set(["canary.feedback_wait_s=900", "canary.alpha=0.1"], CODE) == {
        "feedback_wait_s": 900,
        "alpha": 0.1,
    }
    with pytest.raises(SystemExit, match="canary"):
        parse_set(["gate.alpha=0.1"], CODE)


def test_when_the_wait_runs_out_the_ratings_look_and_decide_both_ways() -> None:
    """At 20 answers a minute on a rating scale the test alone rarely decides in ten minutes;
    its one look at the wait's end promotes a clearly better canary and rolls back an equal
    one it cannot show within the margin less often than the point estimate did (never)."""
    traffic = Traffic(rate_per_min=20, rated=0.8, lag_s=30, noise=0.25, tick_s=10, scale=True)
    config = CanaryConfig()
    better = [play(random.Random(i), CODE, config, traffic, 0.5, 0.7) for i in range(20)]
    assert all(o.verdict == "promote" and (o.by_test or o.by_look) for o in better), better
    worse = [play(random.Random(i), CODE, config, traffic, 0.5, 0.35) for i in range(20)]
    assert all(o.verdict == "rollback" and (o.by_test or o.by_look) for o in worse), worse
    looked = [o for o in better + worse if o.by_look]
    assert looked and all(o.minutes == config.feedback_wait_s / 60 for o in looked)


def test_a_scale_rating_is_the_arms_mean_with_a_spread_clipped_to_the_unit_interval() -> None:
    rng = random.Random(0)
    scores = [rating(rng, 0.9, 0.25, scale=True) for _ in range(2000)]
    assert all(0.0 <= x <= 1.0 for x in scores) and 1.0 in scores
    assert 0.80 < sum(scores) / len(scores) < 0.9  # pulled below 0.9 by the clip at 1
    assert {rating(rng, 0.5, 0.1) for _ in range(50)} == {0.0, 1.0}  # thumbs

"""The canary's sequential test on ratings, on simulated rating streams (no Redis, no network)."""

from __future__ import annotations

import random

from learner.canary_ratings import (
    Rating,
    capped,
    mean_drop,
    paired_outcomes,
    per_key_cap,
    rating_test,
)
from ratchet.sequential import SequentialTest
from ratchet.settings import CanaryConfig

CONFIG = CanaryConfig(max_feedback_drop=0.1, min_feedback=10, alpha=0.05, max_rating_pairs=256)
RUNS = 1000


def stream(rng: random.Random, mean: float, n: int, prefix: str) -> list[Rating]:
    """Thumbs up/down ratings (1.0 or 0.0) with this mean, each from its own user."""
    return [Rating(f"{prefix}{i}", float(rng.random() < mean)) for i in range(n)]


def run(
    rng: random.Random, active: float, canary: float, config: CanaryConfig = CONFIG
) -> SequentialTest:
    n = config.max_rating_pairs
    return rating_test(stream(rng, active, n, "a"), stream(rng, canary, n, "c"), config, 0.2)


def test_a_pair_is_one_bounded_outcome_whose_mean_is_half_plus_half_the_difference() -> None:
    assert paired_outcomes([1.0, 0.0, 0.5], [0.0, 1.0, 0.5, 1.0]) == [0.0, 1.0, 0.5]
    test = rating_test([Rating("a", 0.8)] * 4, [Rating("c", 0.6)] * 4, CONFIG, 1.0)
    drop = mean_drop(test)
    assert test.n == 4 and drop is not None and abs(drop - 0.2) < 1e-12


def test_each_key_counts_its_first_ratings_only() -> None:
    assert per_key_cap(0.2, 256) == 52 and per_key_cap(0.001, 10) == 1
    ratings = [Rating("m", 1.0), Rating("u", 0.0), Rating("m", 0.5), Rating("m", 0.25)]
    assert capped(ratings, 2) == [1.0, 0.0, 0.5]
    assert Rating.decode(Rating("a\tb", 0.25).encode()) == Rating("a\tb", 0.25)


def test_a_clear_difference_is_decided_early_both_ways() -> None:
    rng = random.Random(1)
    better = [run(rng, 0.5, 0.8) for _ in range(200)]
    worse = [run(rng, 0.8, 0.4) for _ in range(200)]
    assert sum(t.decision == "pass" for t in better) >= 190
    assert sum(t.decision == "fail" for t in worse) >= 190
    # Early: far fewer pairs than the fixed maximum.
    assert sorted(t.n for t in better)[100] <= 64
    assert sorted(t.n for t in worse)[100] <= 64


def test_a_tie_keeps_going_when_no_margin_is_allowed() -> None:
    strict = CONFIG.model_copy(update={"max_feedback_drop": 0.0})
    rng = random.Random(2)
    tests = [run(rng, 0.6, 0.6, strict) for _ in range(200)]
    # Neither better nor worse: the test does not promote (it may give up near the end).
    assert sum(t.decision == "pass" for t in tests) <= 200 * strict.alpha
    assert sorted(t.n for t in tests)[20] >= 128
    # Within the margin, a tie is "not worse" and is promoted, given the pairs: thumbs ratings
    # of two equal arms need about 500 pairs to show a mean no more than 0.1 lower.
    patient = CONFIG.model_copy(update={"max_rating_pairs": 1024})
    tests = [run(rng, 0.6, 0.6, patient) for _ in range(100)]
    assert sum(t.decision == "pass" for t in tests) >= 80


def test_a_worse_candidate_is_promoted_at_most_alpha_of_the_time() -> None:
    """At the boundary (exactly max_feedback_drop worse) the false-promotion rate is highest;
    over 1,000 simulated canaries it stays within alpha (plus 3 binomial standard errors)."""
    rng = random.Random(3)
    for active, canary in ((0.6, 0.5), (0.7, 0.5)):
        promoted = sum(run(rng, active, canary).decision == "pass" for _ in range(RUNS))
        bound = CONFIG.alpha + 3 * (CONFIG.alpha * (1 - CONFIG.alpha) / RUNS) ** 0.5
        assert promoted / RUNS <= bound, (active, canary, promoted)

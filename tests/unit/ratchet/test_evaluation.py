"""The offline evaluation helpers: a paired lift and its bootstrap interval."""

from __future__ import annotations

import pytest

from ratchet.evaluation import bootstrap_interval, paired_lift


def test_a_constant_lift_has_no_spread() -> None:
    assert paired_lift([0.7] * 20, [0.5] * 20, samples=200) == pytest.approx((0.2, 0.2, 0.2))


def test_the_interval_brackets_the_mean_and_narrows_with_more_prompts() -> None:
    few = [1.0, 0.0] * 10
    many = few * 20
    low_few, high_few = bootstrap_interval(few, samples=2000, seed=1)
    low_many, high_many = bootstrap_interval(many, samples=2000, seed=1)
    assert low_few < low_many < 0.5 < high_many < high_few
    assert high_many - low_many < (high_few - low_few) / 3  # ~sqrt(20) narrower


def test_the_same_seed_gives_the_same_interval_and_pairs_must_match() -> None:
    outcomes = [0.0, 0.5, 1.0, 1.0, 0.5]
    assert bootstrap_interval(outcomes, 500, seed=3) == bootstrap_interval(outcomes, 500, seed=3)
    with pytest.raises(ValueError):
        paired_lift([1.0], [0.0, 1.0], samples=10)
    with pytest.raises(ValueError):
        bootstrap_interval([], samples=10, seed=0)

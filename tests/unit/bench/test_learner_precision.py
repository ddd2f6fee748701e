"""bench/learner_precision.py compares each learner's update with the reference's and runs the
learners' rounds in turns."""

from __future__ import annotations

import math

import torch

from bench.learner_precision import agreement, turns


def test_the_same_update_agrees_fully_and_a_longer_one_only_in_direction() -> None:
    update = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 1e-3
    cosine, rel = agreement(update, update)
    assert cosine > 1 - 1e-12 and rel == 0.0
    cosine, rel = agreement(2 * update, update)
    assert cosine > 1 - 1e-12 and math.isclose(rel, 1.0, rel_tol=1e-9)
    cosine, rel = agreement(-update, update)
    assert cosine < -1 + 1e-12 and math.isclose(rel, 2.0, rel_tol=1e-9)


def test_a_noisy_update_shows_its_noise_in_both_figures() -> None:
    gen = torch.Generator().manual_seed(1)
    update = torch.randn(100_000, generator=gen)
    noisy = update + 0.5 * torch.randn(100_000, generator=gen)
    cosine, rel = agreement(noisy, update)
    assert 0.85 < cosine < 0.92  # 1 / sqrt(1 + 0.25) = 0.894
    assert 0.45 < rel < 0.55


def test_no_update_has_no_direction() -> None:
    zero = torch.zeros(10)
    assert all(math.isnan(v) for v in agreement(zero, torch.ones(10)))
    assert all(math.isnan(v) for v in agreement(torch.ones(10), zero))


def test_rounds_run_forwards_then_back_so_drift_lands_on_all() -> None:
    assert turns(3, 3) == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert turns(2, 1) == [0, 1]

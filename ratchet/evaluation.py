"""Offline evaluation of a fixed-size comparison: the mean outcome's bootstrap interval.

For the benches and the outcome checks that compare two versions on a fixed set of prompts
(bench/, tests/), and for the effect size the gate reports beside its verdict. The gate decides
sequentially (ratchet/sequential.py), never on these intervals: they hold for a fixed sample,
and the gate's stops where its test decides.
"""

from __future__ import annotations

import numpy as np


def bootstrap_interval(
    outcomes: list[float], samples: int, seed: int, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean outcome (resampling prompts with replacement).
    For evaluations of a fixed size (the benches); the gate itself decides sequentially."""
    if not outcomes:
        raise ValueError("no outcomes to bootstrap")
    values = np.asarray(outcomes, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def paired_lift(
    candidate: list[float], base: list[float], samples: int, seed: int = 0
) -> tuple[float, float, float]:
    """The mean paired difference ``candidate - base`` over prompts and its 95% percentile
    bootstrap interval: ``(mean, low, high)``."""
    diffs = [c - b for c, b in zip(candidate, base, strict=True)]
    low, high = bootstrap_interval(diffs, samples=samples, seed=seed)
    return float(np.mean(diffs)), low, high

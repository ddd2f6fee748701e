"""The canary's sequential test on live ratings: is the candidate not worse than the active version?

Users rate answers of both arms (``POST /v1/feedback``); each arm's ratings arrive in order. The
i-th canary rating is paired with the i-th active rating, and the pair becomes one outcome in
[0, 1]::

    x_i = (1 + canary_i - active_i) / 2        E[x] = 1/2 + (mean_canary - mean_active) / 2

so "the canary's mean rating is at most ``delta`` below the active one's" (``delta`` =
``canary.max_feedback_drop``) is ``E[x] >= theta`` with ``theta = 1/2 - delta/2``. The pairs feed
:class:`ratchet.sequential.SequentialTest` at that ``theta``: it passes (promote: significantly
not worse than ``delta``) or fails (roll back: significantly worse) as soon as the evidence
allows, may be looked at after every pair, and promotes a candidate worse than ``delta`` with
probability at most ``canary.alpha``. It also fails when ``canary.max_rating_pairs`` could not
show the candidate not worse. The two arms' raters differ, so a pair is not a matched comparison;
it only makes the difference of two means one bounded stream, which is what the test needs.

One client cannot steer the canary: each API key (its hash) counts for at most
``ceil(max_share * max_rating_pairs)`` ratings per arm, the first ones it gave. The cap is fixed,
not a share of what has arrived, so the stream only ever grows at its end and the test's guarantee
holds however often it is evaluated.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ratchet.sequential import SequentialTest
from ratchet.settings import CanaryConfig


@dataclass(frozen=True)
class Rating:
    """One counted rating of a canary-time answer: who gave it (API key hash) and its score."""

    key: str
    score: float

    def encode(self) -> str:
        return f"{self.key}\t{self.score!r}"

    @classmethod
    def decode(cls, raw: str | bytes) -> Rating:
        text = raw.decode() if isinstance(raw, bytes) else raw
        key, _, score = text.rpartition("\t")
        return cls(key, float(score))


def per_key_cap(max_share: float, max_pairs: int) -> int:
    """The most ratings one API key contributes to an arm."""
    return max(1, math.ceil(max_share * max_pairs))


def capped(ratings: Iterable[Rating], cap: int) -> list[float]:
    """The scores in arrival order, each key's beyond its first ``cap`` left out."""
    seen: Counter[str] = Counter()
    kept = []
    for rating in ratings:
        seen[rating.key] += 1
        if seen[rating.key] <= cap:
            kept.append(rating.score)
    return kept


def paired_outcomes(active: list[float], canary: list[float]) -> list[float]:
    """``(1 + canary_i - active_i) / 2`` for each pair both arms have."""
    return [(1.0 + c - a) / 2.0 for a, c in zip(active, canary, strict=False)]


def new_test(config: CanaryConfig) -> SequentialTest:
    return SequentialTest(
        theta=0.5 - config.max_feedback_drop / 2.0,
        alpha=config.alpha,
        max_n=config.max_rating_pairs,
        min_n=config.min_feedback,
    )


def rating_test(
    active: Iterable[Rating], canary: Iterable[Rating], config: CanaryConfig, max_share: float
) -> SequentialTest:
    """The test after every pair the two arms' ratings make so far (stopped at its decision)."""
    cap = per_key_cap(max_share, config.max_rating_pairs)
    test = new_test(config)
    for x in paired_outcomes(capped(active, cap), capped(canary, cap)):
        if test.update(x) != "continue":
            break
    return test


def mean_drop(test: SequentialTest) -> float | None:
    """The canary's mean rating below the active one's, as the pairs so far estimate it."""
    return None if test.mean is None else 1.0 - 2.0 * test.mean

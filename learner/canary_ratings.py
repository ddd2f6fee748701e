"""A counted rating of a canary-time answer, and the per-client share a rating set allows.

The canary's test over clients (learner/canary_clients.py) reads an arm's ratings as
:class:`Rating` (who gave it, the client of the rated answer, and its score), stored in Redis in
arrival order (learner/canary_counter.py). The reward-hacking guard (learner/canary.py
``fair_share``) still bounds one client's share of the rated answers it compares:
:func:`client_cap` and :func:`rater_share`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rating:
    """One counted rating of a canary-time answer: who gave it (its client), its score, and its
    place in the order the canary's ratings were stored, both arms together (``seq``: None for
    ratings stored before it was kept; learner/canary_pairs.py reads a client's first ratings
    across the arms by it)."""

    client: str
    score: float
    seq: int | None = None

    def encode(self) -> str:
        text = f"{self.client}\t{self.score!r}"
        return text if self.seq is None else f"{text}\t{self.seq}"

    @classmethod
    def decode(cls, raw: str | bytes) -> Rating:
        text = raw.decode() if isinstance(raw, bytes) else raw
        head, _, last = text.rpartition("\t")
        # A score is written as a float (a "." or an "e" in it): a last field of digits only is
        # the storing order, appended by the counter.
        if last.isdigit() and "\t" in head:
            client, _, score = head.rpartition("\t")
            return cls(client, float(score), int(last))
        return cls(head, float(last))


_EPSILON = 1e-9  # 0.2 * 5 may come out a hair under 1.0


def client_cap(share: float, length: int) -> int:
    """The most of an arm's first ``length`` taken ratings one client may hold."""
    return max(1, math.floor(share * length + _EPSILON))


def rater_share(max_share: float, margin: float) -> float:
    """The share of a test's ratings one client may hold: ``feedback.max_share``, and at most
    half the margin the ratings are judged against, since one client moves the estimate by up to
    twice its share: alone it cannot carry an even canary past the margin."""
    return min(max_share, margin / 2.0)

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

No client decides the canary. A client is an API key, or a vouching key's user
(``Rating.client``, ratchet.records.client_of). Its share ``s`` of the test's ratings is
``feedback.max_share``, and at most half ``max_feedback_drop`` (:func:`rater_share`: 0.05 by
default). Each arm's ratings are taken into the test's stream in arrival order, except that a
client's rating waits while taking it would give that client more than ``cap(m) = max(1,
floor(s * m))`` of the first ``m`` ratings of the arm; a waiting rating is taken as soon as the
others' ratings make room, the client with the fewest taken first (:func:`fair_stream`). So:

* at every length ``n`` of the stream, one client holds at most ``cap(n)`` of each arm's ratings,
  ``s`` of them once ``n >= 1 / s``. Each of its ratings moves one outcome by at most 1/2, so it
  moves the pairs' mean by at most ``cap(n) / n`` and the estimated drop by at most
  ``2 cap(n) / n = 2 s <= max_feedback_drop``: rating the canary 0 and the active arm 1, it
  cannot carry a canary as good as the active version past the margin, and rating the reverse
  it can pass one at most ``2 s`` worse than the margin allows. It cannot decide alone either:
  the test needs ``min_feedback`` pairs to pass and about 15 pairs of all-zero outcomes to fail
  (its bets start at 0 and add at most ``BET_CAP * theta`` evidence a pair), of which one client
  holds one. And it has to tell the arms apart, which the proxy hides (``proxy.expose_arm``):
  rating both arms alike moves nothing.
* An early flood has no first-come advantage: it waits for the others' ratings, and is taken at
  ``s`` of their pace. Each client also stores at most ``cap(max_rating_pairs)`` ratings
  per arm (the most the stream can take from it), so a flood cannot fill the arm's list and
  crowd out later raters (learner/canary.py).
* The stream only grows at its end (a rating is never taken back, and the stored lists only
  grow), so the test's guarantee holds however often it is replayed.
* With fewer than ``1 / s`` clients rating, the stream stops at one rating per client and the
  test does not decide: the canary is decided by its error rate once ``feedback_wait_s`` has
  passed, the ratings' point estimate only counting from ``2 / max_feedback_drop`` pairs, where
  no client holds more than half the margin (learner/canary.py ``estimate_pairs``).
* The anonymous client of a stack without API keys (the dev stack: the proxy counts every
  request there as this one client, whatever bearer token it sends) is not capped: there is
  nobody to protect from it, and a cap would only stop the test. Its ratings decide as they
  arrive.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from ratchet.records import ANONYMOUS_CLIENT
from ratchet.sequential import SequentialTest
from ratchet.settings import CanaryConfig


@dataclass(frozen=True)
class Rating:
    """One counted rating of a canary-time answer: who gave it (its client) and its score."""

    client: str
    score: float

    def encode(self) -> str:
        return f"{self.client}\t{self.score!r}"

    @classmethod
    def decode(cls, raw: str | bytes) -> Rating:
        text = raw.decode() if isinstance(raw, bytes) else raw
        client, _, score = text.rpartition("\t")
        return cls(client, float(score))


_EPSILON = 1e-9  # 0.2 * 5 may come out a hair under 1.0


def client_cap(share: float, length: int) -> int:
    """The most of an arm's first ``length`` taken ratings one client may hold."""
    return max(1, math.floor(share * length + _EPSILON))


def rater_share(max_share: float, margin: float) -> float:
    """The share of a test's ratings one client may hold: ``feedback.max_share``, and at most
    half the margin the ratings are judged against, since one client moves the estimate by up to
    twice its share: alone it cannot carry an even canary past the margin."""
    return min(max_share, margin / 2.0)


def stored_cap(share: float, max_pairs: int) -> int:
    """The most ratings of one client an arm stores: what a full stream could take from it."""
    return client_cap(share, max_pairs)


def fair_stream(ratings: Iterable[Rating], share: float) -> list[float]:
    """The scores in the order the test takes them (the module docstring): in arrival order,
    a client's rating waiting while it would hold more than :func:`client_cap` of the stream,
    and taken, fewest-taken client first, as soon as others' ratings make room. The anonymous
    client (no API keys) is not capped."""
    taken: Counter[str] = Counter()
    waiting: dict[str, deque[tuple[int, float]]] = {}  # client -> (arrival, score), oldest first
    stream: list[float] = []

    def room(client: str) -> bool:
        return client == ANONYMOUS_CLIENT or taken[client] < client_cap(share, len(stream) + 1)

    for arrival, rating in enumerate(ratings):
        waiting.setdefault(rating.client, deque()).append((arrival, rating.score))
        while True:
            ready = [c for c in waiting if room(c)]
            if not ready:
                break
            client = min(ready, key=lambda c: (taken[c], waiting[c][0][0]))
            _, score = waiting[client].popleft()
            if not waiting[client]:
                del waiting[client]
            taken[client] += 1
            stream.append(score)
    return stream


def paired_outcomes(active: list[float], canary: list[float]) -> list[float]:
    """``(1 + canary_i - active_i) / 2`` for each pair both arms have."""
    return [(1.0 + c - a) / 2.0 for a, c in zip(active, canary, strict=False)]


def new_test(config: CanaryConfig) -> SequentialTest:
    """The canary's test over rating pairs. Its stream ends when ``feedback_wait_s`` runs out,
    and there it looks once (``final_look``, ratchet/sequential.py): the betting test runs at
    ``alpha / 2`` and the look at the other half, so ratings still promote a canary worse than
    ``max_feedback_drop`` at most ``alpha`` of the time, where a point estimate at the wait's end
    promoted one at the margin 60% of the time (bench/canary_time.py)."""
    return SequentialTest(
        theta=0.5 - config.max_feedback_drop / 2.0,
        alpha=config.alpha,
        max_n=config.max_rating_pairs,
        min_n=config.min_feedback,
        final_look=True,
    )


def rating_test(
    active: Iterable[Rating], canary: Iterable[Rating], config: CanaryConfig, max_share: float
) -> SequentialTest:
    """The test after every pair the two arms' ratings make so far (stopped at its decision),
    each client at most :func:`rater_share` of them."""
    share = rater_share(max_share, config.max_feedback_drop)
    test = new_test(config)
    for x in paired_outcomes(fair_stream(active, share), fair_stream(canary, share)):
        if test.update(x) != "continue":
            break
    return test


def mean_drop(test: SequentialTest) -> float | None:
    """The canary's mean rating below the active one's, as the pairs so far estimate it."""
    return None if test.mean is None else 1.0 - 2.0 * test.mean

"""The canary's test over clients: is the candidate not worse than the active version, as its
users (not their ratings, not their requests) say?

Why clients. A client is an API key, or one ``user`` of a key the operator trusts to vouch for
its users (``Rating.client``: the client of the *rated completion*, never of the rating). A client
can send as many requests and ratings as it likes, so a test over ratings, however capped per
client, lets one client move it by its cap: the capped rating test let one key rating 15 answers
per arm cut an even canary's promotion from 78% to 15% among 60 honest raters (security audit
N-1). Here a client is one unit of evidence, whatever it sends.

The units (learner/canary_pairs.py). A client's unit is made of its first ``k =
canary.client_ratings`` ratings, whichever arms they fell on (their order across the arms is the
counter's storing order), and counts at its k-th; later ratings change nothing, and each arm
stores at most k ratings of a client (learner/canary_counter.py). A client rated on both arms (the
sticky key is the client's to choose, and random routing sends most clients to both) is ONE
paired unit, its difference ``d = canary mean - active mean``; a client rated on one arm is an
unpaired unit of that arm. The drop is estimated from the paired units (a fenced mean of ``d``)
and the unpaired ones (the trimmed test below), combined by inverse variance; the maths, the
choice of the fenced mean and the bound on what one client moves are in canary_pairs.py.

The unpaired part: Yuen's two-sample trimmed-mean test; the looks: a group-sequential plan.

* Statistic. With ``g = floor(gamma n)`` units trimmed from each end of an arm's ``n``
  (``gamma`` = ``canary.client_trim``), ``h = n - 2g`` kept, the trimmed mean ``T`` and
  Yuen's squared standard error ``d = (n - 1) s_w^2 / (h (h - 1))`` (``s_w^2`` the winsorized
  variance). The drop estimate is ``D = T_canary - T_active`` with ``se = sqrt(d_a + d_c)`` and
  Welch-Satterthwaite degrees of freedom ``nu = (d_a + d_c)^2 / (d_a^2/(h_a-1) + d_c^2/(h_c-1))``.
  At level ``a`` the bounds are ``D -/+ t_{1-a, nu} se``: promote (pass) when the lower bound is
  above ``-delta`` (``delta`` = ``canary.max_feedback_drop``: the canary is no more than delta
  worse), roll back (fail) when the upper bound is below it (significantly worse than delta).
  For arms that differ by a shift (the canary's clients rate as the active's, moved by Delta) the
  trimmed means differ by Delta too, so delta means what it meant for mean ratings.
  ``t`` is Student's quantile, exact at any (fractional) ``nu``: the tail by the incomplete
  beta function, inverted by bisection.
* Never exact. An arm's squared error is never below that of its untrimmed mean with one 0 and
  one 1 added (Agresti and Caffo's adjustment, :func:`padded`), so an arm whose units are all
  alike (40 thumbs up of 40) is not taken for certain: with a zero spread read as exact, a
  canary at 0.80 against 0.95 was promoted 17-21% of runs at alpha 5%.
* Not trimmed: units that can only be 0 or 1 (``client_ratings`` 1, the anonymous client's
  ratings), and arms whose trim would keep only ties (a high approval rate). A trim there drops
  one value's units and keeps the other's, so it removes no outlier and biases the mean toward
  the commoner value; such units are tested on their padded untrimmed means.
* Why trimmed. Every unit is bounded, so one client moves a plain mean by up to ``1/n`` of the
  range, and a plain mean of 60 clients' thumbs has a standard error of about 0.02: one key that
  knows the arms (canary 0, active 1) costs an even canary a fifth of its power, five keys all of
  it (bench/canary_attack.py). Trimming ``gamma`` of each end drops up to ``gamma n`` such keys
  outright, their values being the most extreme, and bounds what any one unit moves the trimmed
  mean by ``(max - min of the kept) / h`` at most; it costs a few percent of efficiency on
  honest thumbs.
* Why fixed looks, and why it stays valid though means change as clients rate on. The looks are
  at ``n_j = min_clients * 2^j`` clients on *each* arm (j = 0, 1, ...; a paired unit is on
  both), each on the shortest run of units, in the order they count, that has them,
  at ``alpha * INTERIM_ALPHA / 2^(j+1)``, and only if those units are at least
  ``LOOK_COVERAGE`` of the clients who had rated when the last of them counted (units count at a
  client's k-th rating, so the first to count are the clients who rate most: keys that rate three
  times as much as anyone made a quarter of the first look's units, and five of them pushed a
  canary worse by the margin through 14% of runs; a look over a majority of the raters, 2.5%);
  the final look, when the canary's
  wait runs out, is on every client that rated (those with fewer than k ratings too, with the
  mean of what they gave), at the rest of ``alpha``; if it cannot show the canary within the
  margin, the canary is rolled back (the candidate carries the burden of proof). So a rollback is
  held to ``alpha`` at the interim looks only: at the last look an equal canary the ratings
  cannot place is rolled back too, at any number of raters (the last look needs no
  ``min_clients``: one rater more or fewer changes no rule; leaving an inconclusive look to the
  error rate promoted canaries worse by the margin in 93-100% of runs). A unit never
  changes once it counts and the arms' lists only grow, so look j sees the same data however
  often the watcher asks: it is one test, made once. The looks' levels add up to at most
  ``alpha`` (Bonferroni), so a canary worse than delta is promoted with probability at most
  ``alpha`` whatever the number of checks; a significant rollback is held to the same levels
  and the same minimum of clients on each side (``canary.min_clients``).
* Chosen over a betting martingale (ratchet/sequential.py, which this test used on rating pairs)
  because a martingale's running sum weighs every unit fully: robustness to a few clients that
  know the arms needs an order statistic, and an order statistic of units that are each fixed
  is tested exactly by a few pre-set looks.

The anonymous client of a stack without API keys (the proxy counts every request there as one
client, ``ANONYMOUS_CLIENT``) is everyone, and there is nobody to protect from it: each of its
ratings is a unit of its own, as the ratings were before.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from learner.canary_pairs import (
    ClientUnit,
    Location,
    combined,
    counted_and_partial,
    fenced_mean,
    on_arms,
    variance,
)
from learner.canary_ratings import Rating
from learner.canary_student_t import t_quantile
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.settings import CanaryConfig

Decision = Literal["pass", "fail", "continue"]
# The share of alpha the interim looks spend between them (look j: INTERIM_ALPHA / 2^(j+1) of
# it); the final look, on every client that rated, gets the rest. Most canaries of a quiet alias
# are decided at that look (bench/canary_time.py), so it gets the most.
INTERIM_ALPHA = 0.25
# An interim look is made only if its units are at least this share of the clients who had rated
# when its last unit counted: units count at a client's client_ratings-th rating, so the first to
# count are the clients who rate most, and keys that rate three times as much as anyone made a
# quarter of the first look's units (bench/canary_attack.py). Whether a look is made is fixed by
# the storing order, never by its outcome, and a look not made spends none of alpha.
LOOK_COVERAGE = 0.5


def client_units(ratings: Iterable[Rating], per_client: int, ended: bool = False) -> list[float]:
    """One arm's units (the module docstring): each client's mean of its first ``per_client``
    ratings, in the order clients reach that many; with ``ended``, then the clients with fewer,
    in the order of their first rating. Each anonymous rating is a unit of its own."""
    given: dict[str, list[float]] = {}  # insertion order: the order of first ratings
    units: list[float] = []
    for rating in ratings:
        if rating.client == ANONYMOUS_CLIENT:
            units.append(rating.score)
            continue
        scores = given.setdefault(rating.client, [])
        if len(scores) < per_client:
            scores.append(rating.score)
            if len(scores) == per_client:
                units.append(statistics.fmean(scores))
    if ended:
        units.extend(statistics.fmean(s) for s in given.values() if len(s) < per_client)
    return units


def raters(ratings: Iterable[Rating]) -> int:
    """Distinct clients among an arm's ratings (each anonymous rating one)."""
    clients: set[str] = set()
    anonymous = 0
    for rating in ratings:
        if rating.client == ANONYMOUS_CLIENT:
            anonymous += 1
        else:
            clients.add(rating.client)
    return len(clients) + anonymous


@dataclass(frozen=True)
class Trimmed:
    """An arm's trimmed mean, Yuen's squared standard error of it, and the units kept."""

    mean: float
    error2: float
    kept: int


def binary(units: list[float]) -> bool:
    """Units that can only be 0 or 1 (one thumb each: client_ratings 1, or the anonymous
    client's ratings): trimming them drops whole values, never outliers."""
    return all(u in (0.0, 1.0) for u in units)


def padded(units: list[float]) -> Trimmed:
    """The untrimmed mean and its squared standard error with one 0 and one 1 added to the arm
    (Agresti and Caffo's adjustment, for any units in [0, 1]): the spread is never zero, so an
    arm whose every unit is alike is not taken for an exact one (95% of 40 thumbs up is not
    0.95 for certain)."""
    every = [*units, 0.0, 1.0]
    n = len(every)
    return Trimmed(statistics.fmean(every), variance(every) / n, n)


def trimmed(units: list[float], gamma: float) -> Trimmed:
    """The ``gamma``-trimmed mean of ``units`` (at least two) and Yuen's squared standard
    error ``(n - 1) s_w^2 / (h (h - 1))``, ``s_w^2`` the winsorized sample variance, never below
    the untrimmed mean's (:func:`padded`). Units that can only be 0 or 1, and units whose kept
    middle is all alike (ties at the ends: a high approval rate), are not trimmed: there the trim
    would drop one value's units and leave the other's, not outliers."""
    n = len(units)
    plain = padded(units)
    g = min(math.floor(gamma * n + 1e-9), (n - 2) // 2)
    ordered = sorted(units)
    middle = ordered[g : n - g]
    if g == 0 or binary(units) or middle[0] == middle[-1]:
        return plain
    winsorized = [middle[0]] * g + middle + [middle[-1]] * g
    h = len(middle)
    error2 = (n - 1) * variance(winsorized) / (h * (h - 1))
    return Trimmed(statistics.fmean(middle), max(error2, plain.error2), h)


@dataclass(frozen=True)
class Look:
    """One look of the test: the trimmed drop ``canary - active`` and its bounds at ``alpha``."""

    n: int  # units on each arm (the fewer, at the final look)
    drop: float  # D = T_canary - T_active (negative: the canary is rated lower)
    lower: float
    upper: float
    alpha: float

    @classmethod
    def of(cls, active: list[float], canary: list[float], gamma: float, alpha: float) -> Look:
        a, c = trimmed(active, gamma), trimmed(canary, gamma)
        drop, error2 = c.mean - a.mean, a.error2 + c.error2
        # Never zero (:func:`padded`): no arm's mean is taken for exact.
        df = error2**2 / (a.error2**2 / (a.kept - 1) + c.error2**2 / (c.kept - 1) or 1e-12)
        half = t_quantile(1.0 - alpha, max(df, 1.0)) * math.sqrt(error2)
        return cls(min(len(active), len(canary)), drop, drop - half, drop + half, alpha)

    def decision(self, margin: float) -> Decision:
        if self.lower > -margin:
            return "pass"
        if self.upper < -margin:
            return "fail"
        return "continue"


@dataclass(frozen=True)
class ClientTest:
    """The test's state after the looks so far (the module docstring)."""

    margin: float
    min_clients: int
    units: tuple[int, int]  # units counted so far (active, canary)
    looks: tuple[Look, ...] = ()
    decision: Decision = "continue"
    reason: str = ""

    @property
    def n(self) -> int:
        """Client pairs of the last look (0: none yet)."""
        return self.looks[-1].n if self.looks else 0

    @property
    def last(self) -> Look | None:
        return self.looks[-1] if self.looks else None

    def summary(self) -> dict[str, Any]:
        """What a log line, the event and the console show (the keys ratchet.sequential's
        summary has, where they mean the same)."""
        last = self.last
        return {
            "n": self.n,
            "units": {"active": self.units[0], "canary": self.units[1]},
            "looks": len(self.looks),
            "drop": None if last is None else last.drop,
            "lower": None if last is None else last.lower,
            "upper": None if last is None else last.upper,
            "theta": -self.margin,
            "decision": self.decision,
            "reason": self.reason,
        }


def look_sizes(config: CanaryConfig) -> list[int]:
    """The units per arm of the interim looks: min_clients, doubling, up to max_rating_pairs."""
    sizes, n = [], max(config.min_clients, 2)
    while n <= config.max_rating_pairs:
        sizes.append(n)
        n *= 2
    return sizes


def first_clients(units: list[ClientUnit], size: int) -> list[ClientUnit] | None:
    """The shortest prefix of ``units`` (in the order they count) with ``size`` clients on each
    arm (a paired unit on both); None: not there yet."""
    active = canary = 0
    for i, unit in enumerate(units, 1):
        active += unit.active is not None
        canary += unit.canary is not None
        if min(active, canary) >= size:
            return units[:i]
    return None


def paired_look(units: list[ClientUnit], gamma: float, alpha: float) -> Look | None:
    """The look over ``units`` (learner/canary_pairs.py): the paired units' fenced mean and the
    unpaired units' trimmed difference, combined by inverse variance; None where neither part
    has two units (on each arm, for the unpaired part)."""
    paired = [unit for unit in units if unit.paired]
    alone = [
        [u.active for u in units if u.active is not None and u.canary is None],
        [u.canary for u in units if u.canary is not None and u.active is None],
    ]
    parts: list[Location] = []
    if len(paired) >= 2:
        parts.append(fenced_mean(paired))
    if min(len(alone[0]), len(alone[1])) >= 2:
        a, c = trimmed(alone[0], gamma), trimmed(alone[1], gamma)
        error2 = a.error2 + c.error2
        df = error2**2 / (a.error2**2 / (a.kept - 1) + c.error2**2 / (c.kept - 1) or 1e-12)
        parts.append(Location(c.mean - a.mean, error2, df))
    if not parts:
        return None
    estimate = combined(parts)
    half = t_quantile(1.0 - alpha, max(estimate.df, 1.0)) * math.sqrt(estimate.error2)
    drop = estimate.estimate
    return Look(min(on_arms(units)), drop, drop - half, drop + half, alpha)


def client_test(
    active: Iterable[Rating], canary: Iterable[Rating], config: CanaryConfig, ended: bool = False
) -> ClientTest:
    """The test after every look the units so far allow, stopped at its decision; with
    ``ended`` (the canary's wait ran out), then the final look over every client that rated,
    whatever their number (no look: fewer than two units to compare)."""
    units, fewer = counted_and_partial(active, canary, config.client_ratings)
    test = interim_test(units, config)
    return final_test(test, [*units, *fewer], config) if ended else test


def interim_test(units: list[ClientUnit], config: CanaryConfig) -> ClientTest:
    """The interim looks ``units`` (in the order they count) allow, stopped at a decision."""
    gamma, margin = config.client_trim, config.max_feedback_drop
    state = ClientTest(margin, config.min_clients, on_arms(units))
    looks: list[Look] = []
    for j, size in enumerate(look_sizes(config)):
        first = first_clients(units, size)
        if first is None:
            break
        if len(first) < LOOK_COVERAGE * first[-1].seen:
            continue  # the clients who rate most, not a sample of the clients: no look
        look = paired_look(first, gamma, config.alpha * INTERIM_ALPHA / 2 ** (j + 1))
        if look is None:
            continue  # a look not made spends none of alpha
        looks.append(look)
        decided = look.decision(margin)
        if decided != "continue":
            reason = f"look {j + 1} at {size} clients an arm: {_bounds(look, margin)}"
            return _with(state, looks, decided, reason)
    return _with(state, looks, "continue", "")


def final_test(test: ClientTest, every: list[ClientUnit], config: CanaryConfig) -> ClientTest:
    """``test`` once the wait ran out: if its interim looks left it open, the last look, over
    ``every`` client that rated (those with fewer than client_ratings ratings too)."""
    if test.decision != "continue":
        return test
    margin = config.max_feedback_drop
    look = paired_look(every, config.client_trim, config.alpha * (1 - INTERIM_ALPHA))
    if look is None:
        return test
    decided = look.decision(margin)
    reason = f"the last look, at {look.n} clients: {_bounds(look, margin)}"
    if decided == "continue":
        # Not shown within the margin: the burden is the candidate's (a non-inferiority test),
        # so it is rolled back, at any number of clients: the rule has no step at
        # canary.min_clients. Leaving it to the error rate was measured: a canary worse by the
        # margin promoted 93-100% of runs, a clearly worse one 62-75%
        # (docs/results/canary-clients.md).
        decided, reason = "fail", f"inconclusive at {look.n} clients: {_bounds(look, margin)}"
    return _with(test, [*test.looks, look], decided, reason)


def _with(state: ClientTest, looks: list[Look], decision: Decision, reason: str) -> ClientTest:
    return ClientTest(state.margin, state.min_clients, state.units, tuple(looks), decision, reason)


def _bounds(look: Look, margin: float) -> str:
    return (
        f"drop {look.drop:+.3f} in [{look.lower:+.3f}, {look.upper:+.3f}] "
        f"({1 - look.alpha:.2%}) vs -{margin}"
    )


@dataclass(frozen=True)
class ClientEvidence:
    """What the arms' ratings say, for the verdict (learner/canary.py). What only the wait's end
    reads (the last look, the plain difference) is computed when it is first read."""

    test: ClientTest  # the interim looks so far: may decide at any check
    raters: tuple[int, int]  # distinct clients that rated (active, canary)
    every: tuple[ClientUnit, ...]  # every client's unit, those with fewer ratings too
    ratings: tuple[tuple[Rating, ...], tuple[Rating, ...]]  # (active, canary)
    config: CanaryConfig

    @functools.cached_property
    def ended(self) -> ClientTest:
        """The test were the wait to run out now: the last look too."""
        return final_test(self.test, list(self.every), self.config)

    @functools.cached_property
    def difference(self) -> float | None:
        """The canary's plain mean over every client minus the active's (None: an arm unrated)."""
        k = self.config.client_ratings
        every = [client_units(arm, k, ended=True) for arm in self.ratings]
        return statistics.fmean(every[1]) - statistics.fmean(every[0]) if all(every) else None

    @property
    def unrated(self) -> bool:
        return self.raters == (0, 0)


def client_evidence(
    active: list[Rating], canary: list[Rating], config: CanaryConfig
) -> ClientEvidence:
    units, fewer = counted_and_partial(active, canary, config.client_ratings)
    return ClientEvidence(
        test=interim_test(units, config),
        raters=(raters(active), raters(canary)),
        every=(*units, *fewer),
        ratings=(tuple(active), tuple(canary)),
        config=config,
    )

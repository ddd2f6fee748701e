"""The canary's units of evidence when a client reaches both arms: one paired unit, not two.

Why. With random routing (no sticky key) most clients are served by both arms, and so is a key
that tells the arms apart. Counted as a full unit on each arm, such a client moves the difference
of the arms twice, and trimming each arm cannot find it: a veto key's active-arm value 1 is
common among honest clients (a mean of five thumbs at 0.7 is 1 for 17% of them). Its *paired*
difference is not: ``d = (its mean on the canary) - (its mean on the active arm) = -1`` lies
beyond every honest client's, whose ``d`` spreads about the true drop with a standard deviation
near 0.3 (five thumbs an arm at 0.7).

The units. A client's unit is made of its first ``k = canary.client_ratings`` ratings, on
whichever arms they fell, and counts at its k-th (fixed from then on: later ratings change
nothing; a client with fewer counts when the wait runs out, with what it gave). Rated on both
arms: one paired unit ``d``. On one arm only: an unpaired unit of that arm, its mean. Each
anonymous rating (the stack without keys: everyone is one client) is an unpaired unit. The
ratings' order across the arms is their storing order (``Rating.seq``), so the units, and the
order in which they count, are the same at every check.

The estimate. ``D_p``, a robust location of the paired ``d`` (below), with squared error ``v_p``;
``D_u``, Yuen's trimmed difference of the unpaired units' arms (learner/canary_clients.py's
:func:`trimmed`), ``v_u``; combined by inverse variance, ``D = (D_p/v_p + D_u/v_u) / (1/v_p +
1/v_u)``, ``v = 1 / (1/v_p + 1/v_u)``, with Satterthwaite's degrees of freedom
``nu = v^2 / ((v/v_p)^4 v_p^2 / nu_p + (v/v_u)^4 v_u^2 / nu_u)`` (each part's share of ``v``
is ``(v/v_p)^2 v_p``). A part with fewer than two units
(on each arm, for the unpaired part) is left out. The test and its looks are the client test's.

The paired location: a fenced mean (a "skipped mean", Hampel's rejection rule), the fence in
each unit's own noise. With the median ``m`` of the ``d`` and each arm's rate ``p`` over the paired
units' ratings (one 0 and one 1 added), an honest client with ``k_a`` ratings on the active arm
and ``k_c`` on the canary has a ``d`` that varies by ``sigma = sqrt(p_a (1 - p_a) / k_a +
p_c (1 - p_c) / k_c)`` at most (a rating in [0, 1] with mean ``p`` varies by at most ``p (1 -
p)``). A unit farther than ``FENCE sigma`` from ``m`` is set aside, and a side is fenced only
while what lies past the fence there is at most ``FENCE_ROOM`` of the units (more is the
population's, clients who really prefer one arm, not a few keys). ``D_p`` is the mean of the
``h`` kept, with ``v_p = max(s_kept^2 / h, the same with one -1 and one +1 added)`` (never a zero
spread read as exact, as :func:`learner.canary_clients.padded` for an arm) and ``nu_p = h - 1``.
Chosen over:

* a fence in scales of the ``d``'s own spread (MAD): the honest ``d`` of a skewed pair of arms
  (0.95 and 0.85) has a long tail on the worse arm's side, which is evidence, not keys; fencing
  it biased the estimate up by a third of its error and promoted canaries worse by the margin in
  8% of runs at alpha 5% (this session's review). In each unit's noise the honest tail past the
  fence is about 1% of units, the bias under a fifth of the error (tests: test_canary_pairs);
* the symmetric trimmed mean of ``d``: with ``k`` veto keys among ``n`` clients it sets aside
  the keys *and* the ``k`` highest honest units on the other side, keeping ``k`` more low honest
  ones: a bias of about ``k x`` (an honest tail value, -0.5) ``/ h``, which for five keys among
  65 clients is 0.04, a standard error at this much evidence;
* a Huber M-estimate: monotone, so every key still pulls by ``c s / (n E psi')``, about 0.008
  each, the same standard error for five.
``FENCE`` 3: at 3.5 keys rating five answers an arm at 0 and 1 (``d`` -1, ``sigma`` 0.29 at
0.7) lie inside the fence and an even canary with five of them was promoted 6% of runs, not 59%.

What one client moves, by construction. A unit past the fence adds no value, only its rank to
``m``. A kept unit ``x`` moves the mean of the ``h`` kept by ``(x - D_p) / h``, and
``|x - D_p| <= FENCE sigma_x + |m - D_p|`` (and at most 2, the range of ``d``): its value moves
``D_p`` by at most ``B = min(FENCE sigma_max + |m - D_p|, 2) / h`` (:func:`fence_bound`; about
1/60 for 60 clients with five ratings an arm). Its rank moves ``m`` by one order statistic,
which can carry a unit at the fence across it, another ``B``. So one client moves ``D_p`` by
about ``2B`` at most (tests/unit/learner's test_canary_pairs), against ``2 / n`` for a plain mean
of its unit counted on both arms; in the combined ``D`` its weight is the paired part's share, at
most 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from learner.canary_ratings import Rating
from ratchet.records import ANONYMOUS_CLIENT

# The fence, in an honest client's standard deviations of d from the median (its own, from its
# numbers of ratings): an honest unit lies past it about 0.3% of the time under a normal
# approximation, so fencing takes next to nothing of the honest tails, skewed or not.
FENCE = 3.0
# A side is fenced only while at most this share of the units lie past it: more than that is the
# population (clients who really prefer one arm), not a few keys.
FENCE_ROOM = 0.25


@dataclass(frozen=True)
class ClientUnit:
    """One client's unit: its mean rating on each arm it was rated on among its first ratings."""

    client: str
    active: float | None
    canary: float | None
    n_active: int = 1  # the ratings each mean is of
    n_canary: int = 1
    seen: int = 0  # clients that had rated when this unit counted (it among them)

    @property
    def paired(self) -> bool:
        return self.active is not None and self.canary is not None

    @property
    def difference(self) -> float:
        assert self.active is not None and self.canary is not None
        return self.canary - self.active


def in_order(active: Iterable[Rating], canary: Iterable[Rating]) -> list[tuple[str, Rating]]:
    """Both arms' ratings in their storing order (``seq``); ratings stored without it (older
    ones, tests) by their place in their arm, active first at a tie."""
    tagged = [
        ((rating.seq if rating.seq is not None else i), j, i, arm, rating)
        for j, (arm, ratings) in enumerate((("active", active), ("canary", canary)))
        for i, rating in enumerate(ratings)
    ]
    tagged.sort(key=lambda t: (t[0], t[1], t[2]))
    return [(arm, rating) for *_, arm, rating in tagged]


def _unit(client: str, given: list[tuple[str, float]]) -> ClientUnit:
    active = [score for arm, score in given if arm == "active"]
    canary = [score for arm, score in given if arm == "canary"]
    return ClientUnit(
        client,
        statistics.fmean(active) if active else None,
        statistics.fmean(canary) if canary else None,
        len(active),
        len(canary),
    )


def client_pairs(
    active: Iterable[Rating], canary: Iterable[Rating], per_client: int, ended: bool = False
) -> list[ClientUnit]:
    """The units (the module docstring) in the order they count: each client at its
    ``per_client``-th rating; with ``ended``, then the clients with fewer, in the order of their
    first rating. Each anonymous rating is an unpaired unit at once."""
    units, fewer = counted_and_partial(active, canary, per_client)
    return [*units, *fewer] if ended else units


def counted_and_partial(
    active: Iterable[Rating], canary: Iterable[Rating], per_client: int
) -> tuple[list[ClientUnit], list[ClientUnit]]:
    """In one pass: the units that count (:func:`client_pairs`) and, after them, the clients
    with fewer than ``per_client`` ratings, in the order of their first rating."""
    given: dict[str, list[tuple[str, float]]] = {}  # insertion order: first ratings
    units: list[ClientUnit] = []
    anonymous = 0
    for arm, rating in in_order(active, canary):
        if rating.client == ANONYMOUS_CLIENT:
            score = rating.score
            anonymous += 1
            on_active = arm == "active"
            units.append(
                ClientUnit(
                    ANONYMOUS_CLIENT,
                    score if on_active else None,
                    None if on_active else score,
                    seen=len(given) + anonymous,
                )
            )
            continue
        taken = given.setdefault(rating.client, [])
        if len(taken) < per_client:
            taken.append((arm, rating.score))
            if len(taken) == per_client:
                unit = _unit(rating.client, taken)
                units.append(replace(unit, seen=len(given) + anonymous))
    return units, [_unit(c, t) for c, t in given.items() if len(t) < per_client]


def on_arms(units: Iterable[ClientUnit]) -> tuple[int, int]:
    """Clients on each arm (active, canary): a paired unit is on both."""
    active = canary = 0
    for unit in units:
        active += unit.active is not None
        canary += unit.canary is not None
    return active, canary


def variance(values: list[float]) -> float:
    """The sample variance (at least two values), in floats by two passes: the standard
    library's is exact, through fractions, and was a fifth of a verdict's time; the two differ
    in the last bits."""
    mean = math.fsum(values) / len(values)
    return math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)


@dataclass(frozen=True)
class Location:
    """An estimate, its squared standard error and its degrees of freedom."""

    estimate: float
    error2: float
    df: float


def pooled_rates(units: list[ClientUnit]) -> tuple[float, float]:
    """Each arm's rate over the paired units' ratings (active, canary), with one 0 and one 1
    added (Agresti and Caffo: never 0 or 1, so no unit's noise is read as nil)."""
    totals = [[1.0, 2.0], [1.0, 2.0]]  # [sum, count] per arm, the added 0 and 1 included
    for unit in units:
        assert unit.active is not None and unit.canary is not None
        totals[0][0] += unit.active * unit.n_active
        totals[0][1] += unit.n_active
        totals[1][0] += unit.canary * unit.n_canary
        totals[1][1] += unit.n_canary
    return totals[0][0] / totals[0][1], totals[1][0] / totals[1][1]


def noise(unit: ClientUnit, rates: tuple[float, float]) -> float:
    """The standard deviation of an honest client's ``d`` with this unit's numbers of ratings:
    a rating in [0, 1] with mean ``p`` varies by at most ``p (1 - p)``."""
    active, canary = rates
    return math.sqrt(
        active * (1 - active) / max(unit.n_active, 1)
        + canary * (1 - canary) / max(unit.n_canary, 1)
    )


def fenced(units: list[ClientUnit]) -> tuple[list[float], float, float]:
    """The paired ``d`` kept inside the fence (the module docstring), the median and the widest
    fence half-width a kept unit had."""
    rates = pooled_rates(units)
    values = [unit.difference for unit in units]
    median = statistics.median(values)
    room = max(math.floor(FENCE_ROOM * len(units) + 1e-9), 1)
    scored = [(unit.difference, FENCE * noise(unit, rates)) for unit in units]
    low = sum(1 for d, width in scored if d < median - width)
    high = sum(1 for d, width in scored if d > median + width)
    kept = [
        d
        for d, width in scored
        if not (d < median - width and low <= room) and not (d > median + width and high <= room)
    ]
    widest = max(width for _, width in scored)
    return kept, median, widest


def fenced_mean(units: list[ClientUnit]) -> Location:
    """The paired units' location (at least two): the mean of those inside the fence."""
    kept, _, _ = fenced(units)
    h = len(kept)
    if h < 2:  # a fence that keeps fewer than two keeps nothing: the plain mean
        kept, h = [unit.difference for unit in units], len(units)
    mean = statistics.fmean(kept)
    padded = [*kept, -1.0, 1.0]
    error2 = max(variance(kept) / h, variance(padded) / len(padded))
    return Location(mean, error2, h - 1.0)


def fence_bound(units: list[ClientUnit]) -> float:
    """``B``: the most one more kept unit moves :func:`fenced_mean` (the module docstring)."""
    kept, median, widest = fenced(units)
    mean = statistics.fmean(kept)
    return min(widest + abs(median - mean), 2.0) / len(kept)


def combined(parts: list[Location]) -> Location:
    """The parts' inverse-variance mean, with Satterthwaite's degrees of freedom."""
    weight = sum(1.0 / p.error2 for p in parts)
    error2 = 1.0 / weight
    estimate = sum(p.estimate / p.error2 for p in parts) * error2
    spread = sum((error2 / p.error2) ** 4 * p.error2**2 / p.df for p in parts)
    return Location(estimate, error2, error2**2 / spread if spread > 0 else 1.0)

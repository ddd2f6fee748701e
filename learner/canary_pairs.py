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

The paired location: a fenced mean (a "skipped mean", Hampel's rejection rule). With the median
``m`` of the ``d`` and the scale ``s = max(1.4826 MAD, the gamma-winsorized standard
deviation)``, the units farther than ``FENCE s`` from ``m`` are set aside, at most
``floor(gamma n)`` on each side (the farthest), and ``D_p`` is the mean of the ``h`` kept, with
``v_p = max(s_kept^2 / h, the same with one -1 and one +1 added)`` (never a zero spread read as
exact, as :func:`learner.canary_clients.padded` for an arm) and ``nu_p = h - 1``. Chosen over:

* the symmetric trimmed mean of ``d``: with ``k`` veto keys among ``n`` clients it sets aside
  the keys *and* the ``k`` highest honest units on the other side, keeping ``k`` more low honest
  ones: a bias of about ``k x`` (an honest tail value, -0.5) ``/ h``, which for five keys among
  65 clients is 0.04, a standard error at this much evidence;
* a Huber M-estimate (MAD scale): monotone, so every key still pulls by ``c s / (n E psi')``,
  about 0.008 each, the same standard error for five.
The fence drops the keys' units outright and nothing of the honest side (the honest ``d`` past
``FENCE s`` are few and on both sides). ``s`` is floored by the winsorized deviation so that
coarse units (a mean of one or two thumbs: ``d`` in {-1, 0, 1}, the MAD 0) are not fenced at
the median; and a side is fenced only while what lies past the fence is at most ``gamma n``
units: a value that common is the population's, not a few keys'.

What one client moves, by construction. A unit past the fence adds no value, only its rank to
``m`` and ``s``. A kept unit ``x`` moves the mean of the ``h`` kept by ``(x - D_p) / h``, and
``|x - D_p| <= FENCE s + |m - D_p|``: its value moves ``D_p`` by at most
``B = (FENCE s + |m - D_p|) / h`` (:func:`fence_bound`; about 1/60 for 60 clients at ``s``
0.3). Its rank moves ``m`` and ``s`` by one order statistic, which can carry a unit at the fence
across it, another ``B`` (ties at the fence cross together: the bound is per unit that
crosses). So one client moves ``D_p`` by about ``2B`` at most (tests/unit/learner's
test_canary_pairs), against ``2 / n`` for a plain mean of its unit counted on both arms; in the
combined ``D`` its weight is the paired part's share, at most 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from learner.canary_ratings import Rating
from ratchet.records import ANONYMOUS_CLIENT

# The fence, in scales from the median. 2.5: an honest d (spread about 0.3) past it is rare on
# either side, and a key's d of -1 against an even canary lies past it.
FENCE = 2.5
MAD_NORMAL = 1.4826  # the MAD of a normal sample is 0.6745 of its standard deviation


@dataclass(frozen=True)
class ClientUnit:
    """One client's unit: its mean rating on each arm it was rated on among its first ratings."""

    client: str
    active: float | None
    canary: float | None

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
    for arm, rating in in_order(active, canary):
        if rating.client == ANONYMOUS_CLIENT:
            score = rating.score
            units.append(
                ClientUnit(ANONYMOUS_CLIENT, *((score, None) if arm == "active" else (None, score)))
            )
            continue
        taken = given.setdefault(rating.client, [])
        if len(taken) < per_client:
            taken.append((arm, rating.score))
            if len(taken) == per_client:
                units.append(_unit(rating.client, taken))
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


def scale(values: list[float], gamma: float) -> float:
    """``max(1.4826 MAD, the gamma-winsorized standard deviation)`` of ``values``."""
    n = len(values)
    median = statistics.median(values)
    mad = MAD_NORMAL * statistics.median(abs(v - median) for v in values)
    ordered = sorted(values)
    g = min(math.floor(gamma * n + 1e-9), (n - 2) // 2)
    winsorized = [ordered[g]] * g + ordered[g : n - g] + [ordered[n - g - 1]] * g
    return max(mad, math.sqrt(variance(winsorized)))


def fenced(values: list[float], gamma: float) -> tuple[list[float], float, float]:
    """The units kept inside the fence (the module docstring), the median and the scale."""
    n = len(values)
    median, spread = statistics.median(values), scale(values, gamma)
    room = math.floor(gamma * n + 1e-9)
    low = [v for v in values if v < median - FENCE * spread]
    high = [v for v in values if v > median + FENCE * spread]
    drop_low = len(low) if 0 < len(low) <= room else 0
    drop_high = len(high) if 0 < len(high) <= room else 0
    ordered = sorted(values)
    return ordered[drop_low : n - drop_high], median, spread


def fenced_mean(values: list[float], gamma: float) -> Location:
    """The paired units' location (at least two): the mean of those inside the fence."""
    kept, _, _ = fenced(values, gamma)
    h = len(kept)
    if h < 2:  # cannot happen with two or more units, whose median lies between them
        kept, h = values, len(values)
    mean = statistics.fmean(kept)
    padded = [*kept, -1.0, 1.0]
    error2 = max(variance(kept) / h, variance(padded) / len(padded))
    return Location(mean, error2, h - 1.0)


def fence_bound(values: list[float], gamma: float) -> float:
    """``B``: the most one more kept unit moves :func:`fenced_mean` (the module docstring)."""
    kept, median, spread = fenced(values, gamma)
    mean = statistics.fmean(kept)
    return (FENCE * spread + abs(median - mean)) / len(kept)


def combined(parts: list[Location]) -> Location:
    """The parts' inverse-variance mean, with Satterthwaite's degrees of freedom."""
    weight = sum(1.0 / p.error2 for p in parts)
    error2 = 1.0 / weight
    estimate = sum(p.estimate / p.error2 for p in parts) * error2
    spread = sum((error2 / p.error2) ** 4 * p.error2**2 / p.df for p in parts)
    return Location(estimate, error2, error2**2 / spread if spread > 0 else 1.0)

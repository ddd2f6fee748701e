"""Student's t distribution for the canary's tests (learner/canary_clients.py,
learner/canary_errors.py): its upper tail and its quantile at any, fractional, degrees of
freedom (Welch's and Satterthwaite's are), which the standard library does not have.

The tail is the regularized incomplete beta, ``P(T > t) = I_{nu/(nu+t^2)}(nu/2, 1/2) / 2``,
evaluated by its continued fraction (Lentz's method); the quantile inverts it by bisection.
"""

from __future__ import annotations

import functools
import math


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (Lentz's method)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return result


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_tail(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom, t >= 0."""
    return 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for p >= 1/2, exact to 1e-9 at any ``df`` (fractional too, as
    Welch's are): the tail inverted by bisection. The standard library has no t
    distribution, and the Cornish-Fisher expansion it replaces was too narrow below 10
    degrees of freedom (at 1, 0.99: 13.6 for 31.8). Cached: a look's level and degrees of
    freedom are the same at every check that makes it again (its units are fixed), and the
    bisection's hundred incomplete betas were most of a verdict's time."""
    tail = 1.0 - p
    low, high = 0.0, 1.0
    while t_tail(high, df) > tail:
        high *= 2.0
    for _ in range(100):
        middle = (low + high) / 2.0
        if t_tail(middle, df) > tail:
            low = middle
        else:
            high = middle
        if high - low < 1e-10:
            break
    return (low + high) / 2.0

"""An always-valid sequential test for the mean of outcomes in [0, 1] against a threshold.

Used by the learner's gate (is the candidate's win rate above ``theta``?) and meant for the
canary. Observations ``x_1, x_2, ...`` in [0, 1] arrive one at a time; after each one the test
says ``pass``, ``fail`` or ``continue``, and may be looked at after every observation without
inflating its error rate.

The maths (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting",
JRSS-B 2023, Theorem 2, "predictable plug-in empirical Bernstein"). For a predictable bet
``l_i`` in [0, 1) (chosen from ``x_1..x_{i-1}`` only) and any ``m`` in [0, 1]::

    log M_t(m) = sum_i l_i (x_i - m) - sum_i v_i psi(l_i)
    v_i = 4 (x_i - mu_{i-1})^2,   psi(l) = (-log(1 - l) - l) / 4

is a nonnegative supermartingale when the mean is at most ``m`` (``mu_{i-1}`` is the running
mean). Ville's inequality gives P(sup_t M_t(theta) >= 1/alpha) <= alpha under H0: mean <= theta,
however long one watches. So:

* ``pass`` when the evidence ``log M_t(theta)`` has reached ``log(1/alpha)`` (and at least
  ``min_n`` observations were seen): the false-pass rate is at most ``alpha``.
* ``fail`` when the mirror process (bets on ``m - x``, its own predictable ``l'_i``) reaches
  ``log(1/alpha)``: the mean is below ``theta``, with the same error rate the other way.
* ``fail`` (futility) when even ``x = 1`` on every remaining observation up to ``max_n`` could
  not reach ``log(1/alpha)``: each step adds at most ``l (1 - theta) <= c (1 - theta)``, so
  this bound never fails a run that could still pass; it only saves the pairs.
* ``fail`` at ``max_n`` without a decision (inconclusive).

The bets aim at the test, not at the interval: ``l_i = clip((mu_{i-1} - theta) / s2_{i-1}, 0,
c)``, the growth-optimal bet ``(mean - theta) / variance`` of the linearised log-capital, with a
regularised running mean and variance (a pseudo-observation at ``theta`` and variance 1/4), so
noise early on buys little. ``c = 1/2`` keeps ``psi`` small.

Because ``log M_t(m)`` is linear in ``m``, the set ``{m : M_t(m) < 1/alpha}`` is a half-line
computed in closed form; its running intersection is a time-uniform confidence sequence: the
lower bound from the pass process, the upper bound from the mirror one, each valid at
``1 - alpha`` (``1 - 2 alpha`` together). ``lower > theta`` exactly when the test passes, so
the reported interval and the decision always agree. The state is a dozen floats; ``update``
is O(1).

With ``final_look`` (the gate, whose pairs end at ``max_n``), the test also looks once at the end.
Being valid at every ``n`` costs power where ``max_n`` is known and small: measured by
bench/gate_power.py, at 32 to 128 pairs and alpha 0.05 the betting test alone passes a candidate
that wins 0.6 of its pairs 41% of the time, one look at 128 pairs 85%. So alpha is split in
half (Bonferroni: the false-pass rate stays at most ``alpha``):

* the betting test above runs at ``alpha / 2`` (both sides), for early passes and fails (at
  all of ``alpha`` when ``max_n`` is below :data:`FINAL_LOOK_MIN_N`: no look will come);
* at ``n = max_n`` (or when the stream ends, :meth:`SequentialTest.close`), with at least
  :data:`FINAL_LOOK_MIN_N` outcomes, a one-sided z-test at ``alpha / 2``: pass when
  ``mean - z * s / sqrt(n) > theta``, ``s`` the sample standard deviation (the normal
  approximation, which is why it waits for ``FINAL_LOOK_MIN_N``). Its bounds join the running
  interval, so ``lower > theta`` still says exactly when the test passed;
* futility also asks the final look: the test stops early only when neither the betting
  evidence nor the final look could pass, even if every outcome left were 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import Any, Literal

Decision = Literal["pass", "fail", "continue"]

# The largest bet. Waudby-Smith & Ramdas suggest 1/2 or 3/4; 1/2 keeps psi(l) close to l^2/8,
# so one unlucky early outcome costs little evidence.
BET_CAP = 0.5
# The regularisation of the running mean and variance: one pseudo-observation at theta with
# variance 1/4 (the largest an outcome in [0, 1] can have), so the first bet is zero.
PRIOR_VARIANCE = 0.25
# The fewest outcomes the final look's normal approximation is trusted with.
FINAL_LOOK_MIN_N = 30


def _psi(bet: float) -> float:
    return (-math.log1p(-bet) - bet) / 4.0


@dataclass
class _Side:
    """One betting process: sums that make ``log M_t(m)`` linear in ``m``."""

    bets: float = 0.0  # sum of l_i
    weighted: float = 0.0  # sum of l_i x_i
    penalty: float = 0.0  # sum of v_i psi(l_i)


@dataclass
class SequentialTest:
    """Is the mean of outcomes in [0, 1] above ``theta``? ``update`` one outcome at a time."""

    theta: float
    alpha: float = 0.05
    max_n: int = 128
    min_n: int = 1
    final_look: bool = False  # also one look at max_n (the module docstring)
    n: int = 0
    total: float = 0.0  # sum of outcomes
    total_squares: float = 0.0  # sum of outcomes squared, for the final look's spread
    squares: float = 0.0  # sum of (x_i - mu_{i-1})^2, for the variance estimate
    above: _Side = field(default_factory=_Side)  # evidence for mean > theta
    below: _Side = field(default_factory=_Side)  # evidence for mean < theta
    best_lower: float = 0.0  # running intersection of the confidence sequence
    best_upper: float = 1.0
    decision: Decision = "continue"
    reason: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must lie in [0, 1], not {self.theta}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1), not {self.alpha}")
        if self.min_n < 1 or self.max_n < self.min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, not {self.min_n}, {self.max_n}")

    # --- the running estimates the bets are made from ----------------------------------------

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def _prior_mean(self) -> float:
        return (self.theta + self.total) / (self.n + 1)

    def _prior_variance(self) -> float:
        return (PRIOR_VARIANCE + self.squares) / (self.n + 1)

    def _bets(self) -> tuple[float, float]:
        """The predictable bets (above, below) for the next outcome."""
        edge = (self._prior_mean() - self.theta) / self._prior_variance()
        return min(max(edge, 0.0), BET_CAP), min(max(-edge, 0.0), BET_CAP)

    # --- evidence and the confidence sequence ------------------------------------------------

    @property
    def betting_alpha(self) -> float:
        """The error rate the betting test runs at: half of alpha where a final look will
        come (``max_n`` of at least :data:`FINAL_LOOK_MIN_N`), else all of it."""
        return self.alpha / 2 if self._can_look(self.max_n) else self.alpha

    @property
    def level(self) -> str:
        """The betting test's confidence level, as reasons say it."""
        return (
            f"{1 - self.betting_alpha:.1%}"
            if self._can_look(self.max_n)
            else f"{1 - self.alpha:.0%}"
        )

    @property
    def threshold(self) -> float:
        """The log-evidence a decision needs: log(1/alpha) (of the betting share of alpha)."""
        return math.log(1.0 / self.betting_alpha)

    @property
    def evidence(self) -> float:
        """log M_t(theta): the log-capital of betting that the mean is above theta."""
        a = self.above
        return a.weighted - self.theta * a.bets - a.penalty

    @property
    def evidence_below(self) -> float:
        """The mirror: the log-capital of betting that the mean is below theta."""
        b = self.below
        return self.theta * b.bets - b.weighted - b.penalty

    def _lower_now(self) -> float:
        a = self.above
        if a.bets <= 0.0:
            return 0.0
        return (a.weighted - a.penalty - self.threshold) / a.bets

    def _upper_now(self) -> float:
        b = self.below
        if b.bets <= 0.0:
            return 1.0
        return (b.weighted + b.penalty + self.threshold) / b.bets

    @property
    def lower(self) -> float:
        """Time-uniform lower confidence bound for the mean (level 1 - alpha)."""
        return min(max(self.best_lower, 0.0), 1.0)

    @property
    def upper(self) -> float:
        """Time-uniform upper confidence bound for the mean (level 1 - alpha)."""
        return min(max(self.best_upper, 0.0), 1.0)

    # --- the test ----------------------------------------------------------------------------

    def update(self, x: float) -> Decision:
        """Feed one outcome in [0, 1]; returns the decision (final once not ``continue``)."""
        if self.decision != "continue":
            return self.decision
        if not 0.0 <= x <= 1.0 or math.isnan(x):
            raise ValueError(f"an outcome must lie in [0, 1], not {x}")
        bet_above, bet_below = self._bets()
        v = 4.0 * (x - self._prior_mean()) ** 2
        self.squares += v / 4.0
        for side, bet in ((self.above, bet_above), (self.below, bet_below)):
            side.bets += bet
            side.weighted += bet * x
            side.penalty += v * _psi(bet)
        self.n += 1
        self.total += x
        self.total_squares += x * x
        self.best_lower = max(self.best_lower, self._lower_now())
        self.best_upper = min(self.best_upper, self._upper_now())
        self.decision, self.reason = self._decide()
        return self.decision

    def close(self) -> Decision:
        """The stream ended before ``max_n`` (pairs lost on the way): the final look, now, if
        the test has one and enough outcomes; else the decision stays as it was."""
        if self.decision == "continue" and self._can_look(self.n):
            self.decision, self.reason = self._look()
        return self.decision

    def ended(self) -> SequentialTest:
        """The test as it would stand were the stream to end now, this one left as it is: a
        closed copy (the final look's decision) where it has a final look, enough outcomes and
        no decision yet; else this test. For a caller whose stream ends on a clock (the
        canary's wait)."""
        if self.decision != "continue" or not self._can_look(self.n):
            return self
        ended = replace(self)  # the look changes only scalar fields: a shallow copy will do
        ended.close()
        return ended

    def looked(self) -> tuple[Decision, str]:
        """The decision and its reason were the stream to end now (:meth:`ended`): the
        decision already made, else the final look's, else ``continue``."""
        ended = self.ended()
        return ended.decision, ended.reason

    def _can_look(self, n: int) -> bool:
        return self.final_look and n >= max(self.min_n, FINAL_LOOK_MIN_N)

    def _look(self) -> tuple[Decision, str]:
        """The final look: a one-sided z-test on the outcomes so far, at alpha / 2 each way."""
        lower, upper = one_look_bounds(self.total, self.total_squares, self.n, self.betting_alpha)
        self.best_lower = max(self.best_lower, lower)
        self.best_upper = min(self.best_upper, upper)
        level = self.level
        if self.best_lower > self.theta:
            return "pass", f"{level} lower bound {self.lower:.3f} > {self.theta} at the last look"
        if self.best_upper < self.theta:
            return "fail", f"{level} upper bound {self.upper:.3f} < {self.theta} at the last look"
        return "fail", f"inconclusive after {self.n} (max {self.max_n})"

    def _look_could_pass(self) -> bool:
        """Whether the final look could still pass if every outcome left were 1."""
        if not self._can_look(self.max_n):
            return False
        left = self.max_n - self.n
        lower, _ = one_look_bounds(
            self.total + left, self.total_squares + left, self.max_n, self.betting_alpha
        )
        return lower > self.theta

    def _decide(self) -> tuple[Decision, str]:
        level = self.level
        # The boundaries are exact: outcomes in [0, 1] with mean <= 0 are all 0, so one outcome
        # above 0 refutes it for certain (and one below 1 refutes mean >= 1).
        if self.theta == 0.0 and self.total > 0.0 and self.n >= self.min_n:
            return "pass", "an outcome above 0 refutes a mean of 0"
        if self.theta == 1.0 and self.total < self.n:
            return "fail", "an outcome below 1 refutes a mean of 1"
        if self.best_lower > self.theta and self.n >= self.min_n:
            return "pass", f"{level} lower bound {self.lower:.3f} > {self.theta}"
        if self.best_upper < self.theta:
            return "fail", f"{level} upper bound {self.upper:.3f} < {self.theta}"
        # Futility: the most evidence the remaining outcomes could add, even all ones.
        remaining = self.max_n - self.n
        reachable = self.evidence + remaining * BET_CAP * (1.0 - self.theta)
        if self.theta == 0.0 and remaining > 0:
            reachable = math.inf
        if self.n >= self.max_n and self._can_look(self.n):
            return self._look()
        if self.best_lower <= self.theta and reachable < self.threshold:
            if self.n >= self.max_n:
                return "fail", f"inconclusive after {self.n} (max {self.max_n})"
            if not self._look_could_pass():
                return "fail", f"futile: {remaining} more could not reach the evidence"
        if self.n >= self.max_n:
            return "fail", f"inconclusive after {self.n} (max {self.max_n})"
        return "continue", ""

    # --- state, for Redis ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequentialTest:
        values = dict(data)
        above, below = _Side(**values.pop("above")), _Side(**values.pop("below"))
        return cls(**values, above=above, below=below)

    def summary(self) -> dict[str, Any]:
        """What a log line or the console shows."""
        return {
            "n": self.n,
            "mean": self.mean,
            "lower": self.lower,
            "upper": self.upper,
            "evidence": self.evidence,
            "evidence_below": self.evidence_below,
            "evidence_needed": self.threshold,
            "decision": self.decision,
            "reason": self.reason,
        }


def one_look_bounds(
    total: float, total_squares: float, n: int, alpha: float
) -> tuple[float, float]:
    """One-sided normal bounds ``mean -/+ z_(1 - alpha) * s / sqrt(n)`` of ``n`` outcomes from
    their sum and sum of squares (``s``: the sample standard deviation, 0 for ``n`` < 2)."""
    mean = total / n
    variance = max(total_squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    margin = NormalDist().inv_cdf(1.0 - alpha) * math.sqrt(variance / n)
    return mean - margin, mean + margin

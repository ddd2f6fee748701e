"""The gate's verdict: a sequential test of the win rate over the pairs' outcomes, the checks
around it (enough pairs drawn, not too many lost, a big enough lift), and the effect size it
reports. Pure: tested on fixed outcomes, without a model (learner/gate.py answers and scores the
pairs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ratchet.bill import Bill
from ratchet.evaluation import paired_lift
from ratchet.gate_pairs import GatePair
from ratchet.sequential import SequentialTest
from ratchet.settings import GateConfig


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reason: str
    pairs: int
    win_rate: float | None
    ci_low: float | None
    ci_high: float | None
    threshold: float
    min_pairs: int
    candidate_score: float | None = None  # mean verifier score on the held-out prompts
    incumbent_score: float | None = None
    failed_pairs: int = 0  # prompts one of the versions could not answer, or not judged
    # The sequential test: log-capital of the bet that the candidate is better (a pass needs
    # log(1/alpha)); ci_low/ci_high above are its time-uniform bounds, each at 1 - alpha.
    evidence: float | None = None
    alpha: float | None = None
    drawn: int = 0  # held-out pairs drawn for this gate
    stopped_early: bool = False  # decided before every drawn pair was scored
    # The effect size beside the win rate: the mean per-prompt score lift over the live version
    # and its 95% bootstrap interval (ratchet/evaluation.py), where pairs have scores (a
    # verifier, or a reward model); None for a judge that only ranks.
    lift: float | None = None
    lift_low: float | None = None
    lift_high: float | None = None
    # The reward model that scored every pair (a feedback alias's, ``<alias>.reward@v<N>``),
    # read once at the gate's start; None where a verifier or a judge scored.
    reward_model: str | None = None
    # The first pairs scored, for the console's side-by-side view (ratchet/gate_pairs.py); not
    # part of the gate event.
    sample: tuple[GatePair, ...] = ()
    # What the gate cost (its seconds, and the judge calls of a RULER-judged alias), for the
    # round's bill; not part of the gate event either.
    bill: Bill | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("sample", "bill")}


def sequential_test(gate: GateConfig, drawn: int) -> SequentialTest:
    """The test a gate of ``drawn`` pairs runs; its futility bound counts on at most those. The
    pairs end at ``drawn``, so it also looks once there (``final_look``, ratchet/sequential.py)."""
    return SequentialTest(
        theta=gate.threshold,
        alpha=gate.alpha,
        max_n=max(drawn, gate.min_pairs, 1),
        min_n=gate.min_pairs,
        final_look=True,
    )


def conclude(
    test: SequentialTest,
    gate: GateConfig,
    drawn: int,
    candidate_score: float | None = None,
    incumbent_score: float | None = None,
    failed_pairs: int = 0,
    lift: tuple[float, float, float] | None = None,
) -> GateResult:
    """The gate's verdict once the test decided or the drawn pairs ran out; ``lift`` is
    :func:`score_lift` of the pairs scored."""
    test.close()  # pairs lost to failures end the stream before max_n: its last look is now
    pairs = test.n
    common: dict[str, Any] = {
        "pairs": pairs,
        "threshold": gate.threshold,
        "min_pairs": gate.min_pairs,
        "candidate_score": candidate_score,
        "incumbent_score": incumbent_score,
        "failed_pairs": failed_pairs,
        "alpha": gate.alpha,
        "drawn": drawn,
        **dict(zip(("lift", "lift_low", "lift_high"), lift or (None, None, None), strict=True)),
    }
    if not pairs:
        unmeasured: dict[str, Any] = {"win_rate": None, "ci_low": None, "ci_high": None}
        return GateResult(False, "no held-out pairs", **unmeasured, **common)
    win_rate = test.total / pairs
    measured: dict[str, Any] = {
        "win_rate": win_rate,
        "ci_low": test.lower,
        "ci_high": test.upper,
        "evidence": test.evidence,
        "stopped_early": test.decision != "continue" and pairs + failed_pairs < drawn,
    }
    head = f"win rate {win_rate:.3f} on {pairs} pairs"
    if drawn < gate.min_pairs:  # no pass was possible: say why, not that it was futile
        return GateResult(
            False,
            f"{drawn} held-out pairs drawn, fewer than {gate.min_pairs}",
            **measured,
            **common,
        )
    attempted = pairs + failed_pairs
    if test.decision == "pass" and failed_pairs > gate.max_failed_share * attempted:
        return GateResult(
            False,
            f"{head}, but {failed_pairs} of {attempted} pairs failed (more than "
            f"gate.max_failed_share, {gate.max_failed_share}): the pairs judged may not speak "
            "for the prompts",
            **measured,
            **common,
        )
    if test.decision == "pass" and gate.min_lift is not None:
        too_small = lift is None or lift[0] < gate.min_lift
        if too_small:
            size = "no score lift measured" if lift is None else f"score lift {lift[0]:+.3f}"
            return GateResult(
                False,
                f"{head}, but {size} (gate.min_lift {gate.min_lift}): better, not by enough",
                **measured,
                **common,
            )
    if test.decision == "pass":
        return GateResult(True, f"{head}: {test.reason}", **measured, **common)
    if test.decision == "fail":
        return GateResult(False, f"{head}: {test.reason}", **measured, **common)
    if pairs < gate.min_pairs:
        reason = f"{pairs} held-out pairs, fewer than {gate.min_pairs}"
    else:
        reason = f"{head}: undecided, {drawn} drawn ({test.lower:.3f} <= {gate.threshold})"
    return GateResult(False, reason, **measured, **common)


def decide(
    outcomes: list[float],
    gate: GateConfig,
    drawn: int | None = None,
    candidate_score: float | None = None,
    incumbent_score: float | None = None,
    failed_pairs: int = 0,
    lift: tuple[float, float, float] | None = None,
) -> GateResult:
    """Feed ``outcomes`` in order to the sequential test until it decides; ``drawn`` (default:
    the outcomes and failed pairs) bounds how many the gate could have seen."""
    drawn = len(outcomes) + failed_pairs if drawn is None else drawn
    test = sequential_test(gate, drawn)
    for outcome in outcomes:
        if test.update(outcome) != "continue":
            break
    return conclude(test, gate, drawn, candidate_score, incumbent_score, failed_pairs, lift)


LIFT_BOOTSTRAP_SAMPLES = 2000


def score_lift(candidate: list[float], incumbent: list[float]) -> tuple[float, float, float] | None:
    """(mean lift, 95% low, high) of the candidate's scores over the live version's on the same
    prompts; None under 2 scored pairs. Seeded: the same pairs give the same interval."""
    if len(candidate) < 2:
        return None
    return paired_lift(candidate, incumbent, samples=LIFT_BOOTSTRAP_SAMPLES, seed=0)


def mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None

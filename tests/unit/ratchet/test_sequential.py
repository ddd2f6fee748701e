"""The sequential test on simulated outcome streams (seeded numpy, no network)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from ratchet.sequential import SequentialTest

TIES = 1 / 3  # the demo's gate sees about a third ties


def stream(rng: np.random.Generator, win_rate: float, n: int, ties: float = TIES) -> list[float]:
    """Outcomes in {1, 0.5, 0} with the given mean and share of ties."""
    wins = win_rate - ties / 2
    return [float(x) for x in rng.choice([1.0, 0.5, 0.0], size=n, p=[wins, ties, 1 - ties - wins])]


def run(outcomes: list[float], **kwargs: float) -> SequentialTest:
    test = SequentialTest(theta=0.5, **kwargs)  # type: ignore[arg-type]
    for x in outcomes:
        if test.update(x) != "continue":
            break
    return test


def test_false_pass_rate_at_the_threshold_is_at_most_alpha() -> None:
    rng = np.random.default_rng(12)
    alpha, runs = 0.1, 1000  # a large alpha, so a broken test would show within 1,000 runs
    passes = sum(
        run(stream(rng, 0.5, 128), alpha=alpha, max_n=128).decision == "pass" for _ in range(runs)
    )
    assert passes / runs <= alpha, passes


def test_a_worse_candidate_passes_even_less_often() -> None:
    rng = np.random.default_rng(13)
    passes = sum(run(stream(rng, 0.45, 128), max_n=128).decision == "pass" for _ in range(1000))
    assert passes <= 5, passes


def test_a_clear_difference_stops_early() -> None:
    rng = np.random.default_rng(14)
    runs = [run(stream(rng, 0.85, 128, ties=0.2), max_n=128) for _ in range(200)]
    assert all(r.decision == "pass" for r in runs)
    assert float(np.median([r.n for r in runs])) <= 32
    passed = runs[0]
    assert passed.lower > 0.5 and passed.evidence >= passed.threshold
    assert passed.lower <= passed.mean <= passed.upper  # type: ignore[operator]


def test_a_moderate_gain_passes_most_of_the_time_within_128() -> None:
    rng = np.random.default_rng(15)
    runs = [run(stream(rng, 0.7, 128), max_n=128, min_n=32) for _ in range(200)]
    assert sum(r.decision == "pass" for r in runs) >= 180
    assert min(r.n for r in runs if r.decision == "pass") >= 32  # the floor before a pass


def test_a_tie_keeps_going_and_never_passes() -> None:
    test = SequentialTest(theta=0.5, max_n=256)
    for _ in range(200):
        assert test.update(0.5) == "continue"
    assert test.evidence == 0.0 and test.lower < 0.5 < test.upper
    # Noisy ties (wins and losses in equal measure) do not pass either, and the test runs long.
    rng = np.random.default_rng(16)
    runs = [run(stream(rng, 0.5, 256), max_n=256) for _ in range(100)]
    assert not any(r.decision == "pass" for r in runs)
    assert float(np.median([r.n for r in runs])) > 128


def test_futility_stops_a_clearly_worse_candidate_early() -> None:
    rng = np.random.default_rng(17)
    runs = [run(stream(rng, 0.3, 256), max_n=256) for _ in range(100)]
    assert all(r.decision == "fail" for r in runs)
    assert float(np.median([r.n for r in runs])) < 64
    assert runs[0].upper < 0.5


def test_futility_fails_only_when_a_pass_is_out_of_reach() -> None:
    """Curtailment: when it says futile, all ones on the remaining outcomes cannot pass."""
    test = SequentialTest(theta=0.5, max_n=40)
    while test.update(0.5) == "continue":
        pass
    assert test.decision == "fail" and "futile" in test.reason
    for x in [1.0] * (test.max_n - test.n):
        test.decision = "continue"  # keep feeding past the verdict to check it
        test.update(x)
    assert test.evidence < test.threshold


def test_max_n_ends_inconclusive() -> None:
    test = run([1.0, 0.0] * 10, max_n=20)
    assert test.decision == "fail" and test.n <= 20


def test_min_n_holds_a_pass_back_until_the_floor() -> None:
    early = run([1.0] * 64, max_n=64)
    assert early.decision == "pass" and early.n < 30
    floored = run([1.0] * 64, max_n=64, min_n=30)
    assert floored.decision == "pass" and floored.n == 30


def test_state_round_trips_mid_stream() -> None:
    rng = np.random.default_rng(18)
    outcomes = stream(rng, 0.63, 200)
    whole = SequentialTest(theta=0.5, max_n=200, min_n=16)
    for x in outcomes[:25]:
        whole.update(x)
    state = json.loads(json.dumps(whole.to_dict()))  # as it would sit in Redis
    resumed = SequentialTest.from_dict(state)
    assert resumed == whole
    for x in outcomes[25:]:
        assert resumed.update(x) == whole.update(x)
    assert resumed.to_dict() == whole.to_dict()
    assert len(json.dumps(state)) < 600  # a small dict


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        SequentialTest(theta=0.5).update(1.5)
    with pytest.raises(ValueError):
        SequentialTest(theta=0.5).update(float("nan"))
    with pytest.raises(ValueError):
        SequentialTest(theta=1.5)
    with pytest.raises(ValueError):
        SequentialTest(theta=0.5, min_n=10, max_n=5)


def test_the_boundaries_are_exact() -> None:
    """A threshold of 0 passes anything not worse on every pair (once min_n are seen); a
    threshold of 1 can never pass."""
    zero = SequentialTest(theta=0.0, max_n=8, min_n=2)
    assert zero.update(0.5) == "continue"  # below the floor
    assert zero.update(0.0) == "pass"
    losing = SequentialTest(theta=0.0, max_n=3)
    assert [losing.update(0.0) for _ in range(3)] == ["continue", "continue", "fail"]
    one = SequentialTest(theta=1.0, max_n=8)
    assert one.update(1.0) == "fail"  # nothing can be above 1: futile at once


# --- the final look (the gate's pairs end at max_n) -------------------------------------------


def test_with_a_final_look_the_false_pass_rate_stays_within_alpha() -> None:
    rng = np.random.default_rng(21)
    alpha, runs = 0.1, 2000
    passes = sum(
        run(stream(rng, 0.5, 96), alpha=alpha, max_n=96, min_n=32, final_look=True).decision
        == "pass"
        for _ in range(runs)
    )
    assert passes / runs <= alpha, passes


def test_a_final_look_passes_a_moderate_gain_the_betting_test_alone_misses() -> None:
    """At 96 pairs a 0.6 win rate is a gain the any-time test mostly cannot show (bench/
    gate_power.py); one look at the end usually can, at the same alpha."""
    rng = np.random.default_rng(22)
    streams = [stream(rng, 0.6, 96, ties=0.25) for _ in range(400)]
    alone = sum(run(s, max_n=96, min_n=32).decision == "pass" for s in streams)
    looked = sum(run(s, max_n=96, min_n=32, final_look=True).decision == "pass" for s in streams)
    assert looked >= 1.5 * alone and looked / len(streams) >= 0.6, (alone, looked)


def test_the_final_look_agrees_with_its_interval_and_says_so() -> None:
    outcomes = [1.0, 0.5, 1.0, 0.0, 0.5] * 20  # mean 0.6 on 100: only the look at 100 decides
    test = run(outcomes, max_n=100, min_n=32, final_look=True)
    assert test.n == 100 and test.decision == "pass", test.reason
    assert "at the last look" in test.reason and test.lower > 0.5
    assert run(outcomes, max_n=100, min_n=32).decision == "fail"  # the betting test alone


def test_futility_waits_while_the_final_look_could_still_pass() -> None:
    # 23 wins in 35 of 40: betting at alpha 0.1 (what the final-look test bets at, with alpha
    # 0.2) cannot reach its evidence in 5 more, but 5 more wins carry the final look.
    outcomes = [1.0] * 23 + [0.0] * 12
    random.Random(3523).shuffle(outcomes)
    alone = run(outcomes, max_n=40, min_n=32, alpha=0.1)
    assert alone.decision == "fail" and "futile" in alone.reason, alone.reason
    looked = run(outcomes, max_n=40, min_n=32, alpha=0.2, final_look=True)
    assert looked.decision == "continue", looked.reason
    finished = run(outcomes + [1.0] * 5, max_n=40, min_n=32, alpha=0.2, final_look=True)
    assert finished.decision == "pass" and "at the last look" in finished.reason


def test_close_looks_once_at_a_stream_that_ended_early() -> None:
    outcomes = [1.0, 1.0, 0.0] * 12  # 36 of 96 drawn pairs answered, mean 0.667
    test = run(outcomes, max_n=96, min_n=32, final_look=True, alpha=0.2)
    assert test.decision == "continue"
    assert test.close() == "pass" and "at the last look" in test.reason
    short = run(outcomes[:24], max_n=96, min_n=8, final_look=True, alpha=0.2)
    assert short.close() == "continue"  # 24 outcomes: too few for the normal approximation
    plain = run(outcomes, max_n=96, min_n=32, alpha=0.2)
    assert plain.close() == "continue"  # no final look: nothing changes


def test_a_horizon_too_short_for_a_final_look_keeps_all_of_alpha_for_betting() -> None:
    short = SequentialTest(theta=0.5, alpha=0.3, max_n=24, min_n=16, final_look=True)
    plain = SequentialTest(theta=0.5, alpha=0.3, max_n=24, min_n=16)
    assert short.threshold == plain.threshold
    long = SequentialTest(theta=0.5, alpha=0.3, max_n=96, min_n=16, final_look=True)
    assert long.threshold > plain.threshold


def test_looking_before_the_end_decides_as_the_final_look_would_and_changes_nothing() -> None:
    outcomes = [1.0, 0.0, 1.0, 1.0] * 10  # mean 0.75 over 40: the look passes it above 0.5
    test = run(outcomes, max_n=1024, min_n=8, final_look=True)
    assert test.decision == "continue"
    before = test.to_dict()
    decision, reason = test.looked()
    assert decision == "pass" and "at the last look" in reason
    assert test.to_dict() == before
    closed = run(outcomes, max_n=1024, min_n=8, final_look=True)
    assert closed.close() == decision and closed.reason == reason
    # Too few outcomes for the look, or no look at all: nothing is decided yet.
    assert run(outcomes[:20], max_n=1024, min_n=8, final_look=True).looked()[0] == "continue"
    assert run(outcomes, max_n=1024, min_n=8).looked()[0] == "continue"

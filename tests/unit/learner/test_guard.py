"""The reward-hacking guard's pure checks: reward up while the gate says no, collapse to one
answer, runaway answer length, and reading round outcomes back from an alias's history."""

from __future__ import annotations

import random
from typing import Any

from learner.guard import (
    RoundOutcome,
    collapse,
    is_collapsed,
    mean_length,
    reward_model_gap,
    reward_up_gate_down,
    rounds_from_history,
    runaway_length,
)
from ratchet.records import Sample, ScoredGroup


def group(texts: list[str], lengths: list[int] | None = None) -> ScoredGroup:
    lengths = lengths or [3] * len(texts)
    samples = [
        Sample(
            message={"role": "assistant", "content": t},
            text=t,
            token_ids=list(range(n)),
            logprobs=[-0.1] * n,
        )
        for t, n in zip(texts, lengths, strict=True)
    ]
    return ScoredGroup(
        group_id="g",
        alias="support",
        version=0,
        response_model="m",
        prompt_messages=[{"role": "user", "content": "hi"}],
        prompt_token_ids=[1, 2],
        samples=samples,
        rewards=[float(i) for i in range(len(texts))],
        traffic_request_id="r",
    )


def rounds(rewards: list[float], passed: list[bool]) -> list[RoundOutcome]:
    return [
        RoundOutcome(version=i + 1, train_reward=r, passed=p)
        for i, (r, p) in enumerate(zip(rewards, passed, strict=True))
    ]


# --- reward up, gate down -----------------------------------------------------------------------


def test_rising_reward_with_every_gate_rejected_is_reward_hacking() -> None:
    reason = reward_up_gate_down(rounds([0.2, 0.4, 0.6], [False] * 3), window=3)
    assert reason is not None and reason.startswith("reward_hacking:")
    assert "0.200, 0.400, 0.600" in reason


def test_fewer_rounds_than_the_window_say_nothing() -> None:
    assert reward_up_gate_down(rounds([0.2, 0.4], [False] * 2), window=3) is None


def test_one_passed_gate_in_the_window_clears_it() -> None:
    assert reward_up_gate_down(rounds([0.2, 0.4, 0.6], [False, True, False]), window=3) is None


def test_a_reward_that_did_not_rise_every_round_clears_it() -> None:
    assert reward_up_gate_down(rounds([0.2, 0.4, 0.4], [False] * 3), window=3) is None
    assert reward_up_gate_down(rounds([0.2, 0.5, 0.4], [False] * 3), window=3) is None


def test_only_the_last_window_counts() -> None:
    # An early passed gate and an early dip are outside the window of the last three.
    history = rounds([0.9, 0.1, 0.2, 0.3], [True, False, False, False])
    assert reward_up_gate_down(history, window=3) is not None
    assert reward_up_gate_down(history, window=4) is None


# --- collapse and length ----------------------------------------------------------------------


def test_a_group_of_one_answer_repeated_is_collapsed() -> None:
    assert is_collapsed(group(["Yes.", " yes. ", "YES."]))
    assert not is_collapsed(group(["Yes.", "No."]))
    assert not is_collapsed(group(["Yes."]))  # one sample is not a repetition


def calls(*arguments: str) -> ScoredGroup:
    """A group of tool-call answers with empty text, as vLLM returns a forced call."""
    answers = group([""] * len(arguments))
    for sample, args in zip(answers.samples, arguments, strict=True):
        call = {"type": "function", "function": {"name": "set_timer", "arguments": args}}
        sample.message = {"role": "assistant", "content": "", "tool_calls": [call]}
    return answers


def test_tool_calls_with_empty_text_are_compared_by_their_calls() -> None:
    assert not is_collapsed(calls('{"minutes": 5}', '{"minutes": 8}', '{"minutes": 5}'))
    assert is_collapsed(calls('{"minutes": 5}', '{"minutes": 5}'))


def test_collapse_needs_the_share_of_recent_groups() -> None:
    reason = collapse(identical=8, total=10, share=0.8)
    assert reason is not None and reason.startswith("collapse:") and "8 of 10" in reason
    assert collapse(identical=7, total=10, share=0.8) is None
    assert collapse(identical=0, total=0, share=0.8) is None


def test_mean_length_is_over_every_sample_of_every_group() -> None:
    assert mean_length([group(["a", "b"], [2, 4]), group(["c"], [9])]) == 5.0
    assert mean_length([]) == 0.0


def test_runaway_length_is_growth_over_the_first_rounds_baseline() -> None:
    reason = runaway_length(current=310.0, baseline=100.0, growth=3.0)
    assert reason is not None and reason.startswith("runaway_length:") and "3.1x" in reason
    assert runaway_length(current=300.0, baseline=100.0, growth=3.0) is None
    assert runaway_length(current=900.0, baseline=None, growth=3.0) is None  # the first round
    assert runaway_length(current=900.0, baseline=0.0, growth=3.0) is None


# --- rounds from an alias's history -----------------------------------------------------------


def event(kind: str, version: int | None = None, **detail: Any) -> dict[str, Any]:
    return {"kind": kind, "version": version, "detail": detail}


def test_rounds_from_history_joins_candidates_with_their_gates_oldest_first() -> None:
    history = [  # newest first, as Redis keeps it
        event("candidate", 4, mean_reward=0.9),  # no gate yet: not a round outcome
        event("reject", 3),
        event("gate", 3, passed=False),
        event("candidate", 3, mean_reward=0.7),
        event("promote", 2),
        event("gate", 2, passed=True),
        event("candidate", 2, mean_reward=0.5),
        event("gate", 1, passed=False),
        event("candidate", 1),  # a round without a reward (no steps) is left out
    ]
    assert rounds_from_history(history) == [
        RoundOutcome(version=2, train_reward=0.5, passed=True),
        RoundOutcome(version=3, train_reward=0.7, passed=False),
    ]


def test_a_pause_or_resume_starts_the_window_afresh() -> None:
    older = [
        event("gate", 2, passed=False),
        event("candidate", 2, mean_reward=0.5),
        event("gate", 1, passed=False),
        event("candidate", 1, mean_reward=0.3),
    ]
    newer = [event("gate", 5, passed=False), event("candidate", 5, mean_reward=0.8)]
    for cut in ("pause", "resume"):
        assert rounds_from_history([*newer, event(cut), *older]) == [
            RoundOutcome(version=5, train_reward=0.8, passed=False)
        ]
    assert len(rounds_from_history([*newer, *older])) == 3


def test_reward_model_gap_compares_the_arms_overrating() -> None:
    fair = [(0.6, 0.5)] * 10  # the model overrates the active version's answers by 0.1
    assert reward_model_gap([(0.7, 0.6)] * 10, fair, max_gap=0.15, min_pairs=5) is None
    reason = reward_model_gap([(0.9, 0.4)] * 10, fair, max_gap=0.15, min_pairs=5)
    assert reason is not None and reason.startswith("reward_hacking:")
    assert "+0.500" in reason and "+0.100" in reason
    # Too few rated answers on an arm: no verdict yet.
    assert reward_model_gap([(0.9, 0.4)] * 4, fair, max_gap=0.15, min_pairs=5) is None
    # Underrating the canary is no sign of hacking.
    assert reward_model_gap([(0.1, 0.9)] * 10, fair, max_gap=0.15, min_pairs=5) is None


def test_reward_model_gap_needs_confidence_not_a_noisy_point_estimate() -> None:
    """Users rate graded answers: the same true excess (0.25 over max_gap 0.15) is noise on 12
    answers and evidence on 300."""
    rng = random.Random(0)

    def arm(n: int, overrating: float) -> list[tuple[float, float]]:
        pairs = []
        for _ in range(n):
            rated = rng.random()
            pairs.append((min(1.0, max(0.0, rated + overrating + rng.gauss(0, 0.3))), rated))
        return pairs

    active = arm(300, 0.0)
    assert reward_model_gap(arm(12, 0.25), active, max_gap=0.15, min_pairs=8) is None
    reason = reward_model_gap(arm(300, 0.25), active, max_gap=0.15, min_pairs=8)
    assert reason is not None and "at 95% confidence" in reason


def test_rewards_of_rounds_scored_by_different_reward_models_are_not_compared() -> None:
    """A feedback alias's reward model is retrained between rounds: its rewards move by
    themselves, so rising rewards across versions of it are no sign of hacking."""
    rounds = [
        RoundOutcome(1, 0.15, False, ("a.reward@v2",)),
        RoundOutcome(2, 0.21, False, ("a.reward@v3",)),
        RoundOutcome(3, 0.25, False, ("a.reward@v4",)),
    ]
    assert reward_up_gate_down(rounds, window=3) is None
    same = [RoundOutcome(v, r, False, ("a.reward@v4",)) for v, r in ((1, 0.1), (2, 0.2), (3, 0.3))]
    assert reward_up_gate_down(same, window=3) is not None


def test_the_judges_of_a_round_are_read_back_from_its_candidate_event() -> None:
    history = [
        {"kind": "gate", "version": 1, "detail": {"passed": False}},
        {
            "kind": "candidate",
            "version": 1,
            "detail": {"mean_reward": 0.2, "judged_by": ["a.reward@v3"]},
        },
    ]
    [round_] = rounds_from_history(history)
    assert round_.judged_by == ("a.reward@v3",)

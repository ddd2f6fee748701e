"""The learner's published progress and the judge's backpressure decision (pure)."""

from __future__ import annotations

from ratchet.progress import LearnerProgress, sampling_decision


def progress(**fields: object) -> LearnerProgress:
    return LearnerProgress("a", **fields)  # type: ignore[arg-type]


def test_progress_survives_its_redis_hash() -> None:
    sent = progress(phase="gate", waiting=3, batch_groups=32, version=4, step=7, steps=64)
    raw = {k.encode(): v.encode() for k, v in {**sent.to_hash(), "read": "12"}.items()}
    got = LearnerProgress.from_hash("a", raw)
    assert got is not None and got.read == 12 and got.phase == "gate" and got.step == 7
    assert LearnerProgress.from_hash("a", {}) is None
    assert LearnerProgress.from_hash("a", {b"phase": b"dancing"}) is None
    assert LearnerProgress.from_hash("a", {b"waiting": b"many"}) is None


def test_without_a_learner_the_judge_samples() -> None:
    assert sampling_decision(None, 1000, 64, True).sample


def test_pending_groups_are_unread_plus_waiting_and_bound_sampling() -> None:
    learner = progress(waiting=10, read=40, batch_groups=32)
    decision = sampling_decision(learner, 93, 64, False)  # 53 unread + 10 waiting
    assert decision.sample and decision.pending == 63
    decision = sampling_decision(learner, 94, 64, False)
    assert not decision.sample and decision.reason == "backpressure"
    assert sampling_decision(learner, 10_000, 0, False).sample  # 0: no bound


def test_a_training_round_pauses_sampling_only_where_asked() -> None:
    training = progress(phase="train", batch_groups=32)
    assert sampling_decision(training, 0, 64, True).reason == "learner_training"
    assert sampling_decision(training, 0, 64, False).sample


def test_a_paused_judge_waits_through_the_gate_and_samples_once_the_round_settles() -> None:
    for phase, pauses in (("write", True), ("gate", True), ("settle", False), ("idle", False)):
        decision = sampling_decision(progress(phase=phase, batch_groups=32), 0, 64, True)
        assert decision.sample is not pauses, phase


def test_a_round_waiting_only_for_heldout_prompts_needs_no_more_groups() -> None:
    starved = progress(phase="waiting_heldout", waiting=32, read=32, batch_groups=32)
    decision = sampling_decision(starved, 32, 64, False)
    assert not decision.sample and decision.reason == "backpressure"
    short = progress(phase="waiting_heldout", waiting=20, read=20, batch_groups=32)
    assert sampling_decision(short, 20, 64, False).sample  # still short of a round's groups

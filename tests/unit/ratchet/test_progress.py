"""The learner's published progress and the judge's backpressure decision (pure)."""

from __future__ import annotations

from ratchet.progress import LearnerProgress, client_cap, sampling_decision, unusable_groups


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


def test_a_clients_groups_past_its_share_are_unusable() -> None:
    # Share 0.25 of 64 is 16 per client, or an even split among fewer than 4 clients.
    assert client_cap(64, 0.25, 1) == 64 and client_cap(64, 0.25, 2) == 32
    assert client_cap(64, 0.25, 8) == 16
    assert unusable_groups({"flood": 64}, 64, 0.25) == 0  # alone, it may fill every round
    assert unusable_groups({"flood": 64, "new": 0}, 64, 0.25) == 32  # not once another asks
    assert unusable_groups({"flood": 62, "a": 2}, 64, 0.25) == 30
    assert unusable_groups({"flood": 60, "a": 1, "b": 1, "c": 1, "d": 1}, 64, 0.25) == 44
    assert unusable_groups({}, 64, 0.25) == 0


def test_unusable_groups_do_not_count_against_the_bound() -> None:
    """One flooding client's groups filled the bound and stopped sampling for everyone."""
    learner = progress(waiting=64, read=0, batch_groups=32)
    assert not sampling_decision(learner, 0, 64, False).sample
    decision = sampling_decision(learner, 0, 64, False, unusable=30)
    assert decision.sample and decision.pending == 64
    starved = progress(phase="waiting_heldout", waiting=32, read=32, batch_groups=32)
    assert sampling_decision(starved, 32, 64, False, unusable=10).sample

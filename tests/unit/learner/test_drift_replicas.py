"""The served drift per replica (learner/drift.py): each group names the replica that sampled it,
and a replica whose logged logprobs are off is the one past the tolerance, named in the reason
and in the metric's ``replica`` label, while the others (and groups from before the field) are
within it."""

from __future__ import annotations

import pytest

from learner.drift import Measures, drift_block, drift_record, pick_groups, round_drifts
from learner.metrics import LearnerMetrics
from learner.trainer import LoraGRPOLearner
from ratchet.records import UNKNOWN_REPLICA, ScoredGroup
from ratchet.settings import LearnerSettings, RatchetSettings, ServedCheckSettings
from tests.unit.learner.test_fingerprint import served_group, tiny_learner  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD, OFF = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
# The tiny groups here measure a few tokens a replica: block on any (the default minimum is
# tested below).
SETTINGS = RatchetSettings(
    learner=LearnerSettings(
        served_check=ServedCheckSettings(served_precision="float32", drift_min_tokens=1)
    )
)


def on(
    learner: LoraGRPOLearner, replica: str | None, n: int, version: int = 3, shift: float = 0.0
) -> ScoredGroup:
    """A group of ``version`` sampled on ``replica`` (None: a record from before the field)."""
    group = served_group(learner, version, shift)
    return group.model_copy(update={"replica": replica, "group_id": f"{replica}-{n}"})


def test_one_replicas_perturbed_logprobs_put_only_it_past_the_tolerance(
    tiny_learner: LoraGRPOLearner,  # noqa: F811
) -> None:
    groups = [
        on(tiny_learner, GOOD, 0),
        on(tiny_learner, OFF, 0, shift=0.3),
        on(tiny_learner, None, 0),  # logged before groups named their replica
        on(tiny_learner, GOOD, 1),
        on(tiny_learner, OFF, 1, shift=0.3),
    ]
    drifts = round_drifts(tiny_learner, groups, 3, 8, "group")
    assert drifts is not None
    assert set(drifts.replicas) == {GOOD, OFF, UNKNOWN_REPLICA}
    assert drifts.replicas[GOOD].mean_abs < 1e-5 and drifts.replicas[GOOD].tokens == 10
    assert drifts.replicas[UNKNOWN_REPLICA].mean_abs < 1e-5
    assert drifts.replicas[OFF].mean_abs == pytest.approx(0.3, abs=1e-4)
    assert drifts.worst()[0] == OFF
    # Over the whole fleet the off replica is diluted: 10 of 25 tokens.
    assert drifts.overall.mean_abs == pytest.approx(0.3 * 10 / 25, abs=1e-4)

    limit = SETTINGS.learner.served_check.tolerance("float32")
    assert drifts.replicas[GOOD].within(limit) and not drifts.replicas[OFF].within(limit)
    record = drift_record(3, drifts.overall, "float32", drifts.replicas)
    reason = drift_block(record, SETTINGS)
    assert reason is not None and f"replica {OFF}" in reason and "v3" in reason, reason
    assert GOOD not in reason and "other replica" not in reason, reason
    # Within the tolerance on every replica: nothing blocks.
    fine = round_drifts(tiny_learner, [g for g in groups if g.replica != OFF], 3, 8, "group")
    assert fine is not None
    assert drift_block(drift_record(3, fine.overall, "float32", fine.replicas), SETTINGS) is None


def test_an_old_drift_record_without_replicas_is_one_unknown_replica() -> None:
    old = {"version": 2, "precision": "float32", "mean_abs": 0.5, "max_abs": 0.9, "tokens": 40}
    reason = drift_block(old, SETTINGS)
    assert reason is not None and f"replica {UNKNOWN_REPLICA}" in reason and "v2" in reason
    assert drift_block({**old, "mean_abs": 0.0}, SETTINGS) is None
    assert drift_block({**old, "tokens": 0}, SETTINGS) is None  # nothing measured
    # A stored mean that is not a number (non-finite, or written by hand) is past any tolerance.
    assert drift_block({**old, "mean_abs": None}, SETTINGS) is not None


def test_an_old_group_record_loads_and_reads_as_the_unknown_replica() -> None:
    old = (
        b'{"schema": "scored_group/1", "group_id": "g", "alias": "a", "version": 1, '
        b'"gen_ai.response.model": "a@v1", "prompt_messages": [], "prompt_token_ids": [1], '
        b'"samples": [], "rewards": [], "traffic_request_id": "r"}'
    )
    group = ScoredGroup.model_validate_json(old)
    assert group.replica is None and group.served_by == UNKNOWN_REPLICA
    again = ScoredGroup.model_validate_json(group.model_copy(update={"replica": GOOD}).to_json())
    assert again.served_by == GOOD


def test_the_groups_compared_are_taken_in_turn_from_each_replica(
    tiny_learner: LoraGRPOLearner,  # noqa: F811
) -> None:
    groups = [on(tiny_learner, GOOD, n) for n in range(4)] + [on(tiny_learner, OFF, 0)]
    picked = pick_groups(groups, 3, 2)
    assert [g.replica for g in picked] == [GOOD, OFF]
    assert pick_groups(groups, 4, 8) == [] and pick_groups(groups, 3, 0) == []


def test_the_metric_has_a_series_per_replica_and_drops_a_replica_not_measured_again(
    tiny_learner: LoraGRPOLearner,  # noqa: F811
) -> None:
    metrics = LearnerMetrics()
    measures = Measures(SETTINGS, metrics)
    value = metrics.registry.get_sample_value
    first = [on(tiny_learner, GOOD, 0, 4), on(tiny_learner, OFF, 0, 4, shift=0.2)]
    measures.before_training(tiny_learner, "support", 4, first)
    off = value("ratchet_learner_served_drift", {"alias": "support", "replica": OFF})
    assert off == pytest.approx(0.2, abs=1e-3)
    good = value("ratchet_learner_served_drift", {"alias": "support", "replica": GOOD})
    assert good is not None and good < 1e-5
    assert measures.drift["support"]["replicas"][OFF]["tokens"] == 5

    measures.before_training(tiny_learner, "support", 5, [on(tiny_learner, GOOD, 1, 5)])
    assert value("ratchet_learner_served_drift", {"alias": "support", "replica": OFF}) is None
    assert value("ratchet_learner_served_drift_version", {"alias": "support"}) == 5


def test_a_replica_drift_on_too_few_tokens_is_reported_but_does_not_block() -> None:
    """With drift_groups spread over many replicas one replica's figure may rest on a group: it
    blocks only from ``drift_min_tokens`` sampled tokens on."""
    settings = RatchetSettings(
        learner=LearnerSettings(served_check=ServedCheckSettings(served_precision="float32"))
    )
    least = settings.learner.served_check.drift_min_tokens
    noisy = {"mean_abs": 0.5, "max_abs": 0.9, "tokens": least - 1}
    fine = {"mean_abs": 0.001, "max_abs": 0.01, "tokens": 4 * least}
    record = {"version": 3, "precision": "float32", "replicas": {OFF: noisy, GOOD: fine}}
    assert drift_block(record, settings) is None
    enough = {**record, "replicas": {OFF: {**noisy, "tokens": least}, GOOD: fine}}
    blocked = drift_block(enough, settings)
    assert blocked is not None and OFF in blocked and GOOD not in blocked

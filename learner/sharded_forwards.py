"""Served equals trained under ``learner.sharding: fsdp``: the drift and the fingerprint
(learner/drift.py) measured on every rank.

No rank of a sharded learner holds the whole model, but none needs to: its forward gathers each
decoder layer's weights from every rank as it reaches it (learner/parallel.py), so a forward
pass runs when every rank runs it, and each rank then holds the whole result. Rank 0 computes
the round's drift before its first step and the candidate's fingerprint after its last, as one
rank would (learner/round.py, ``Measures``); it sends each follower, with the round, the same
forwards to run at the same points (:class:`ShardedForwards`, the follower's part of
learner/parallel.py's ``follow``). The followers' results are dropped: rank 0 keeps its own.

A forward that fails inside a gather cannot be made even (learner/rank_failure.py): it ends the
process group as a failed sharded training step does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from learner.drift import Measures, candidate_fingerprint, round_drifts
from learner.trainer import LoraGRPOLearner
from ratchet.records import ScoredGroup
from ratchet.settings import ScaleRewards


@dataclass(frozen=True)
class ShardedForwards:
    """The forward passes a follower runs with rank 0 besides training: the drift of the groups
    sampled from ``drift_version`` (None: not measured), at most ``drift_groups`` of them, before
    the first step; the fingerprint of ``probe`` (None: not taken) after the last."""

    drift_version: int | None
    drift_groups: int
    scale_rewards: ScaleRewards
    probe: tuple[tuple[int, ...], ...] | None

    def before(self, trainer: Any, groups: list[ScoredGroup]) -> None:
        if self.drift_version is not None:
            round_drifts(trainer, groups, self.drift_version, self.drift_groups, self.scale_rewards)

    def after(self, trainer: Any) -> None:
        if self.probe is not None:
            candidate_fingerprint(trainer, self.probe)


def sharded_forwards(
    measures: Measures, trainer: LoraGRPOLearner, version: int
) -> ShardedForwards | None:
    """What rank 0's ``measures`` will run in a round that starts from ``version``, for the
    followers to run alongside; None when the trainer is not sharded (rank 0 measures alone)."""
    if not trainer.sharded or not measures.on:
        return None
    knobs = measures.settings.learner.served_check
    return ShardedForwards(
        drift_version=version if knobs.drift_groups else None,
        drift_groups=knobs.drift_groups,
        scale_rewards=measures.settings.learner.loss.scale_rewards,
        probe=measures.probe(trainer),
    )

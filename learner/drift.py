"""What a round measures of served equals trained, kept with its candidate in ``ratchet.json``
and held to the tolerance when the candidate is gated (learner/gating.py):

- the **fingerprint** of the candidate (learner/fingerprint.py): the learner's logprobs of the
  fixed probe under the weights it writes, which every replica must reproduce before the gate
  (learner/served_check.py);
- the **drift** of the round's groups: the logprobs vLLM logged when it sampled them against the
  learner's under the same weights, recomputed before the round's first step (one forward pass of
  up to ``learner.served_check.drift_groups`` groups, no gradient), over the groups sampled from
  the version the round starts from. Past the tolerance the serving fleet is not running what
  the learner trained, and the round's candidate is not gated. The groups say which version
  sampled them, not which replica, so the drift is per version.

A sharded learner (FSDP) measures neither: no rank holds the whole model for a forward pass of
its own; its candidates are still asked of every replica, without a probe to compare.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from learner.batch import pack_groups, token_logprobs
from learner.fingerprint import (
    Distance,
    Fingerprint,
    Precision,
    fingerprint,
    precision_of,
    probe_token_ids,
    token_distance,
)
from learner.metrics import LearnerMetrics
from learner.trainer import LoraGRPOLearner
from ratchet.records import ScoredGroup
from ratchet.settings import RatchetSettings, ScaleRewards

log = logging.getLogger(__name__)

DRIFT_KEY = "served_drift"  # in the candidate's ratchet.json
FINGERPRINT_KEY = "fingerprint"


def learner_precision(trainer: LoraGRPOLearner) -> Precision:
    """What the learner's logprobs are computed in: its autocast dtype, else its weights'."""
    return precision_of(trainer.autocast_dtype or trainer.dtype)


def candidate_fingerprint(
    trainer: LoraGRPOLearner, token_ids: tuple[tuple[int, ...], ...]
) -> Fingerprint | None:
    """The trainer's current weights' fingerprint on the probe; None when sharded."""
    if trainer.sharded:
        return None
    return fingerprint(
        trainer.model,
        token_ids,
        trainer.device,
        learner_precision(trainer),
        trainer.autocast_dtype,
    )


def round_drift(
    trainer: LoraGRPOLearner,
    groups: list[ScoredGroup],
    version: int,
    limit: int,
    scale: ScaleRewards,
) -> Distance | None:
    """The drift of up to ``limit`` of the groups sampled from ``version`` (the weights the
    trainer holds now); None when there are none, or the trainer is sharded."""
    picked = [g for g in groups if g.version == version and g.samples][:limit]
    if not picked or limit <= 0 or trainer.sharded:
        return None
    batch = pack_groups(picked, scale).to(trainer.device)
    model = trainer.model
    was_training = model.training
    model.eval()  # no LoRA dropout: the weights as vLLM serves them
    autocast = (
        torch.autocast(trainer.device.type, dtype=trainer.autocast_dtype)
        if trainer.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    try:
        with torch.no_grad(), autocast:
            logprobs = token_logprobs(model, batch)
    finally:
        model.train(was_training)
    return token_distance(logprobs, batch.behaviour_logprobs, batch.completion_mask)


def drift_record(version: int, drift: Distance, precision: Precision) -> dict[str, Any]:
    """The drift as the candidate's ``ratchet.json`` keeps it."""
    return {
        "version": version,
        "precision": precision,
        "mean_abs": drift.mean_abs if drift.tokens else None,
        "max_abs": drift.max_abs if drift.tokens else None,
        "tokens": drift.tokens,
    }


def drift_block(record: Any, settings: RatchetSettings) -> str | None:
    """Why the candidate must not be gated, from its stored drift: None when within the
    tolerance (or not measured)."""
    if not isinstance(record, dict) or not record.get("tokens"):
        return None
    precision: Precision = "bfloat16" if record.get("precision") == "bfloat16" else "float32"
    limit = settings.learner.served_check.tolerance(precision)
    mean = record.get("mean_abs")
    gap = float("inf") if mean is None else float(mean)
    if gap <= limit:
        return None
    return (
        f"served drift: the groups v{record.get('version')} sampled have vLLM logprobs "
        f"{gap:.4f} per token (mean |Δ|, {record['tokens']} tokens) from the learner's under "
        f"the same weights, past {limit:g} (per version: the groups do not name the replica)"
    )


class Measures:
    """What a round measures for its candidate, from its training to its write (see the module
    docstring); the probe's tokens read from the base model's tokenizer once."""

    def __init__(self, settings: RatchetSettings, metrics: LearnerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.drift: dict[str, dict[str, Any]] = {}  # per alias, its round's, until written
        self._probe: tuple[tuple[int, ...], ...] | None = None

    @property
    def on(self) -> bool:
        return self.settings.learner.served_check.enabled

    def before_training(
        self, trainer: LoraGRPOLearner, alias: str, version: int, groups: list[ScoredGroup]
    ) -> None:
        """The drift of the groups sampled from ``version``, the weights ``trainer`` holds."""
        self.drift.pop(alias, None)
        knobs = self.settings.learner.served_check
        if not self.on or not knobs.drift_groups:
            return
        scale = self.settings.learner.loss.scale_rewards
        drift = round_drift(trainer, groups, version, knobs.drift_groups, scale)
        if drift is None:
            return
        precision = learner_precision(trainer)
        self.drift[alias] = drift_record(version, drift, precision)
        limit = knobs.tolerance(precision)
        self.metrics.served_drift.labels(alias).set(drift.mean_abs)
        self.metrics.served_drift_version.labels(alias).set(version)
        self.metrics.served_drift_limit.labels(alias).set(limit)
        log.info("%s: served drift of v%d: %s (tolerance %g)",
                 alias, version, drift.describe(), limit)  # fmt: skip

    def for_candidate(self, trainer: LoraGRPOLearner, alias: str) -> dict[str, Any]:
        """The candidate's fingerprint and its round's drift, for its ``ratchet.json``."""
        drift = self.drift.pop(alias, None)
        if not self.on:
            return {}
        meta: dict[str, Any] = {} if drift is None else {DRIFT_KEY: drift}
        taken = candidate_fingerprint(trainer, self.probe(trainer))
        if taken is not None:
            meta[FINGERPRINT_KEY] = taken.as_dict()
        return meta

    def probe(self, trainer: LoraGRPOLearner) -> tuple[tuple[int, ...], ...]:
        if self._probe is None:
            from transformers import AutoTokenizer

            self._probe = probe_token_ids(AutoTokenizer.from_pretrained(trainer.base_model_path))
        return self._probe

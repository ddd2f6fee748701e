"""What a round measures of served equals trained, kept with its candidate in ``ratchet.json``
and held to the tolerance when the candidate is gated (learner/gating.py):

- the **fingerprint** of the candidate (learner/fingerprint.py): the learner's logprobs of the
  fixed probe under the weights it writes, which every replica must reproduce before the gate
  (learner/served_check.py);
- the **drift** of the round's groups: the logprobs vLLM logged when it sampled them against the
  learner's under the same weights, recomputed before the round's first step (one forward pass of
  up to ``learner.served_check.drift_groups`` groups, no gradient), over the groups sampled from
  the version the round starts from. Past the tolerance the serving fleet is not running what
  the learner trained, and the round's candidate is not gated. Each group names the replica
  that sampled it (``ScoredGroup.replica``; ``unknown`` in groups from before the field), so
  the drift is measured per (version, replica), the groups picked in turn from each replica,
  and the reason that blocks the candidate names the replica past the tolerance: one replica
  that serves other weights is found even when the rest of the fleet dilutes its mean.

A sharded learner (FSDP) measures both: its forward gathers each layer's weights from every
rank, so every rank runs the same forwards at the same points of the round and rank 0 keeps the
result (learner/sharded_forwards.py); the fingerprint is then taken right after the round's
last step (:meth:`Measures.after_training`), not when the candidate is written.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
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
from ratchet.records import UNKNOWN_REPLICA, ScoredGroup
from ratchet.settings import RatchetSettings, ScaleRewards

log = logging.getLogger(__name__)

DRIFT_KEY = "served_drift"  # in the candidate's ratchet.json
FINGERPRINT_KEY = "fingerprint"


def learner_precision(trainer: LoraGRPOLearner) -> Precision:
    """What the learner's logprobs are computed in: its autocast dtype, else its weights'."""
    return precision_of(trainer.autocast_dtype or trainer.dtype)


def candidate_fingerprint(
    trainer: LoraGRPOLearner, token_ids: tuple[tuple[int, ...], ...]
) -> Fingerprint:
    """The trainer's current weights' fingerprint on the probe. Sharded, a collective: every
    rank takes it (learner/sharded_forwards.py)."""
    return fingerprint(
        trainer.model,
        token_ids,
        trainer.device,
        learner_precision(trainer),
        trainer.autocast_dtype,
    )


@dataclass(frozen=True)
class RoundDrift:
    """A round's drift: over all the groups compared, and per replica that sampled them."""

    overall: Distance
    replicas: dict[str, Distance]

    def worst(self) -> tuple[str, Distance]:
        """The replica furthest from the learner, and its distance."""
        return max(self.replicas.items(), key=lambda item: _gap(item[1].mean_abs))


def pick_groups(groups: list[ScoredGroup], version: int, limit: int) -> list[ScoredGroup]:
    """Up to ``limit`` of the groups sampled from ``version``, taken in turn from each replica
    that sampled some (in order of arrival within a replica), so every replica is measured."""
    by_replica: dict[str, list[ScoredGroup]] = {}
    for group in groups:
        if group.version == version and group.samples:
            by_replica.setdefault(group.served_by, []).append(group)
    turns = itertools.chain.from_iterable(itertools.zip_longest(*by_replica.values()))
    return [g for g in turns if g is not None][: max(0, limit)]


def round_drifts(
    trainer: LoraGRPOLearner,
    groups: list[ScoredGroup],
    version: int,
    limit: int,
    scale: ScaleRewards,
) -> RoundDrift | None:
    """The drift of up to ``limit`` of the groups sampled from ``version`` (the weights the
    trainer holds now), overall and per replica; None when there are none. One forward pass
    for all of them; sharded, a collective every rank runs (learner/sharded_forwards.py)."""
    picked = pick_groups(groups, version, limit)
    if not picked:
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
    served, mask = batch.behaviour_logprobs, batch.completion_mask
    names = [g.served_by for g in picked]  # one row per group
    replicas = {}
    for name in dict.fromkeys(names):
        rows = torch.tensor([n == name for n in names], device=mask.device)
        replicas[name] = token_distance(logprobs, served, mask & rows[:, None])
    return RoundDrift(token_distance(logprobs, served, mask), replicas)


def round_drift(
    trainer: LoraGRPOLearner,
    groups: list[ScoredGroup],
    version: int,
    limit: int,
    scale: ScaleRewards,
) -> Distance | None:
    """:func:`round_drifts` over all the replicas."""
    drifts = round_drifts(trainer, groups, version, limit, scale)
    return None if drifts is None else drifts.overall


def _distance_record(drift: Distance) -> dict[str, Any]:
    return {
        "mean_abs": drift.mean_abs if drift.tokens else None,
        "max_abs": drift.max_abs if drift.tokens else None,
        "tokens": drift.tokens,
    }


def drift_record(
    version: int,
    drift: Distance,
    precision: Precision,
    replicas: Mapping[str, Distance] | None = None,
) -> dict[str, Any]:
    """The drift as the candidate's ``ratchet.json`` keeps it: overall, and under
    ``replicas`` each replica's."""
    record: dict[str, Any] = {"version": version, "precision": precision}
    record.update(_distance_record(drift))
    if replicas:
        record["replicas"] = {name: _distance_record(d) for name, d in replicas.items()}
    return record


def _gap(value: Any) -> float:
    """A stored mean |Δ| as a number to compare; missing or not finite is the furthest."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return float("inf")
    return float(value)


def replica_gaps(record: Mapping[str, Any]) -> dict[str, tuple[float, int]]:
    """Each replica's (mean |Δ|, tokens) in a stored drift that measured some tokens; a record
    from before the drift per replica is one replica, ``unknown``."""
    entries = record.get("replicas")
    if not isinstance(entries, dict) or not entries:
        entries = {UNKNOWN_REPLICA: record}
    gaps: dict[str, tuple[float, int]] = {}
    for name, entry in entries.items():
        tokens = entry.get("tokens") if isinstance(entry, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            gaps[str(name)] = (_gap(entry.get("mean_abs")), tokens)
    return gaps


def drift_block(record: Any, settings: RatchetSettings) -> str | None:
    """Why the candidate must not be gated, from its stored drift: None when every replica is
    within the tolerance, or rests on fewer than ``learner.served_check.drift_min_tokens``
    sampled tokens (or none was measured); else the reason names the furthest replica past it
    on enough tokens, and how many others are."""
    if not isinstance(record, dict):
        return None
    knobs = settings.learner.served_check
    precision: Precision = "bfloat16" if record.get("precision") == "bfloat16" else "float32"
    limit = knobs.tolerance(precision)
    gaps = replica_gaps(record)
    past = sorted(
        (
            (gap, tokens, name)
            for name, (gap, tokens) in gaps.items()
            if gap > limit and tokens >= knobs.drift_min_tokens
        ),
        reverse=True,
    )
    few = sorted(
        n for n, (gap, tokens) in gaps.items() if gap > limit and tokens < knobs.drift_min_tokens
    )
    if few:
        # Too few tokens to block on: a group or two is a noisy sample.
        log.info(
            "served drift of v%s past %g on %s, below %d tokens each: not blocking",
            record.get("version"),
            limit,
            ", ".join(few),
            knobs.drift_min_tokens,
        )
    if not past:
        return None
    gap, tokens, name = past[0]
    others = f"; {len(past) - 1} other replica(s) past it too" if len(past) > 1 else ""
    return (
        f"served drift: replica {name}: the groups of v{record.get('version')} it sampled have "
        f"vLLM logprobs {gap:.4f} per token (mean |Δ|, {tokens} tokens) from the learner's "
        f"under the same weights, past {limit:g}{others}"
    )


class Measures:
    """What a round measures for its candidate, from its training to its write (see the module
    docstring); the probe's tokens read from the base model's tokenizer once."""

    def __init__(self, settings: RatchetSettings, metrics: LearnerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.drift: dict[str, dict[str, Any]] = {}  # per alias, its round's, until written
        self._exported: dict[str, set[str]] = {}  # per alias, the replicas of its drift series
        self._probe: tuple[tuple[int, ...], ...] | None = None
        self._fingerprints: dict[str, Fingerprint] = {}  # sharded: per alias, until written

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
        drifts = round_drifts(trainer, groups, version, knobs.drift_groups, scale)
        if drifts is None:
            return
        precision = learner_precision(trainer)
        self.drift[alias] = drift_record(version, drifts.overall, precision, drifts.replicas)
        limit = knobs.tolerance(precision)
        self.export(alias, drifts.replicas)
        self.metrics.served_drift_version.labels(alias).set(version)
        self.metrics.served_drift_limit.labels(alias).set(limit)
        for name, drift in drifts.replicas.items():
            log.info("%s: served drift of v%d on %s: %s (tolerance %g)",
                     alias, version, name, drift.describe(), limit)  # fmt: skip

    def export(self, alias: str, replicas: Mapping[str, Distance]) -> None:
        """The alias's drift per replica; the series of a replica this round did not measure
        go (a replica that left, or sampled none of the version's groups, keeps no stale
        value to alert on)."""
        gauge = self.metrics.served_drift
        for gone in self._exported.get(alias, set()) - set(replicas):
            with contextlib.suppress(KeyError):
                gauge.remove(alias, gone)
        for name, drift in replicas.items():
            gauge.labels(alias, name).set(drift.mean_abs)
        self._exported[alias] = set(replicas)

    def for_candidate(self, trainer: LoraGRPOLearner, alias: str) -> dict[str, Any]:
        """The candidate's fingerprint and its round's drift, for its ``ratchet.json``."""
        drift = self.drift.pop(alias, None)
        if not self.on:
            return {}
        meta: dict[str, Any] = {} if drift is None else {DRIFT_KEY: drift}
        if trainer.sharded:  # taken after training, with every rank (:meth:`after_training`)
            taken = self._fingerprints.pop(alias, None)
        else:
            taken = candidate_fingerprint(trainer, self.probe(trainer))
        if taken is not None:
            meta[FINGERPRINT_KEY] = taken.as_dict()
        return meta

    def after_training(self, trainer: LoraGRPOLearner, alias: str) -> None:
        """Sharded, the candidate's fingerprint, taken right after the round's last step, where
        the followers take it too (learner/sharded_forwards.py): a forward the candidate's write
        (Redis, the store) could not be trusted to reach on rank 0 alone. One rank: nothing
        (:meth:`for_candidate` takes it)."""
        self._fingerprints.pop(alias, None)
        if self.on and trainer.sharded:
            self._fingerprints[alias] = candidate_fingerprint(trainer, self.probe(trainer))

    def probe(self, trainer: LoraGRPOLearner) -> tuple[tuple[int, ...], ...]:
        if self._probe is None:
            from transformers import AutoTokenizer

            self._probe = probe_token_ids(AutoTokenizer.from_pretrained(trainer.base_model_path))
        return self._probe

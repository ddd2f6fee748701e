"""Packing judged groups into training rows, and scoring those rows under a model.

:func:`pack_groups` turns ScoredGroups into one right-padded batch (prompt + completion) with the
behaviour logprobs vLLM logged and one group-relative advantage per sample; a token whose logged
logprob is not finite stays as context but is not trained on. :func:`token_logprobs` gives the
current policy's logprobs of exactly those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from learner.loss import ScaleRewards, group_advantages
from ratchet.records import ScoredGroup


@dataclass
class Batch:
    """Samples packed as rows; every (B, T) tensor is aligned with ``input_ids`` positions."""

    input_ids: Tensor  # (B, T) long: prompt + completion, right-padded
    attention_mask: Tensor  # (B, T) long: 1 on real tokens
    completion_mask: Tensor  # (B, T) bool: True only on sampled (completion) tokens
    behaviour_logprobs: Tensor  # (B, T) float32: vLLM's logprob of input_ids[i, t]; 0 elsewhere
    advantages: Tensor  # (B,) float32
    rewards: Tensor  # (B,) float32
    group_index: Tensor  # (B,) long: position of the sample's group in the packed list
    lengths: Tensor  # (B,) long: prompt + completion tokens

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: v.to(device) for k, v in self.__dict__.items()})

    def select(self, rows: Tensor, width: int | None = None) -> Batch:
        """The given rows, trimmed to ``width`` columns (default: the longest of those rows)."""
        rows = rows.to(self.input_ids.device)
        if width is None:
            width = int(self.lengths[rows].max()) if rows.numel() else 0
        return Batch(
            **{k: v[rows, :width] if v.dim() == 2 else v[rows] for k, v in self.__dict__.items()}
        )


def pack_groups(
    groups: list[ScoredGroup], scale: ScaleRewards = "group", pad_token_id: int = 0
) -> Batch:
    """One row per sample: prompt_token_ids + sample.token_ids, right-padded with pad_token_id."""
    rows: list[list[int]] = []
    prompt_lens: list[int] = []
    behaviour: list[list[float]] = []
    rewards: list[float] = []
    group_index: list[int] = []
    for g, group in enumerate(groups):
        if len(group.rewards) != len(group.samples):
            raise ValueError(
                f"group {group.group_id}: {len(group.rewards)} rewards for "
                f"{len(group.samples)} samples"
            )
        if not group.prompt_token_ids:
            raise ValueError(f"group {group.group_id} has no prompt tokens")
        for sample, reward in zip(group.samples, group.rewards, strict=True):
            if len(sample.logprobs) != len(sample.token_ids):
                raise ValueError(
                    f"group {group.group_id}: a sample has {len(sample.token_ids)} "
                    f"tokens but {len(sample.logprobs)} logprobs"
                )
            rows.append(group.prompt_token_ids + sample.token_ids)
            prompt_lens.append(len(group.prompt_token_ids))
            behaviour.append(sample.logprobs)
            rewards.append(float(reward))
            group_index.append(g)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if rows else 0
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    behaviour_lp = torch.zeros((len(rows), width), dtype=torch.float32)
    completion = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, start, lp) in enumerate(zip(rows, prompt_lens, behaviour, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        lp_t = torch.tensor(lp, dtype=torch.float32)
        finite = torch.isfinite(lp_t)  # a token without a usable logprob stays as context only
        behaviour_lp[i, start : len(row)] = torch.where(finite, lp_t, 0.0)
        completion[i, start : len(row)] = finite
    reward_t = torch.tensor(rewards, dtype=torch.float32)
    groups_t = torch.tensor(group_index, dtype=torch.long)
    return Batch(
        input_ids=input_ids,
        attention_mask=(torch.arange(width) < lengths.unsqueeze(1)).long(),
        completion_mask=completion,
        behaviour_logprobs=behaviour_lp,
        advantages=group_advantages(reward_t, groups_t, scale).float(),
        rewards=reward_t,
        group_index=groups_t,
        lengths=lengths,
    )


def token_logprobs(model: nn.Module, batch: Batch) -> Tensor:
    """log p(input_ids[i, t] | input_ids[i, :t]) on completion positions, 0 elsewhere; (B, T)
    float32, with grad when the model has any."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    mask = batch.completion_mask[:, 1:]
    targets = batch.input_ids[:, 1:][mask]
    if _plain_lm_head(causal_lm):
        # Right padding under causal attention: no real token attends to a pad, so no mask.
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        hidden = backbone(input_ids=batch.input_ids, use_cache=False).last_hidden_state
        logits = causal_lm.get_output_embeddings()(hidden[:, :-1][mask])
    else:  # logit soft-capping or scaling lives in the model's own forward
        logits = model(input_ids=batch.input_ids, use_cache=False).logits[:, :-1][mask]
    picked = -F.cross_entropy(logits.float(), targets, reduction="none")
    per_token = picked.new_zeros(mask.shape).masked_scatter(mask, picked)
    return F.pad(per_token, (1, 0))


def _plain_lm_head(causal_lm: nn.Module) -> bool:
    """True where logits = lm_head(backbone(x)), so the head can run on completion rows only."""
    prefix = getattr(causal_lm, "base_model_prefix", "")
    special = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    return (
        bool(prefix)
        and hasattr(causal_lm, prefix)
        and hasattr(causal_lm, "get_output_embeddings")
        and not any(getattr(causal_lm.config, name, None) not in (None, 1.0) for name in special)
    )

"""Packing judged groups into training rows, and scoring those rows under a model.

A group's K samples answer the same prompt, so :func:`pack_groups` writes each group as ONE row,
the prompt once and then every sample's completion (the layout of ratchet/rewards/packing.py).
:func:`token_logprobs` runs the model on such rows under the shared-prompt attention mask: every
completion token gets exactly the logprob it has in its own (prompt + completion) sequence, while
the prompt is computed once instead of K times. With SmolLM2's demo prompts (78 tokens) and
K = 6 answers of about 45 tokens that is 2.1x fewer tokens forwarded and back-propagated. The
mask is (T x T) per row, so a row costs attention memory quadratic in its length, which is small
beside the K-fold prompt it saves for the prompt and answer lengths the judge samples
(``learning.max_prompt_tokens``, ``sampling.max_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from learner.loss import group_advantages
from ratchet.records import ScoredGroup
from ratchet.rewards.packing import PAD_SEGMENT, padded, row_layout, shared_prompt_mask
from ratchet.settings import ScaleRewards

__all__ = ["Batch", "pack_groups", "shared_prompt_mask", "token_logprobs"]
# Completion positions whose logits exist at once (see token_logprobs): 200 MB of float32
# logits at a 49,152-token vocabulary, small beside the backbone's activations of a micro-batch.
LOGPROB_CHUNK = 1024


@dataclass
class Batch:
    """Groups packed one per row; every (R, T) tensor is aligned with ``input_ids`` positions."""

    input_ids: Tensor  # (R, T) long: prompt, then each completion; right-padded
    position_ids: Tensor  # (R, T) long: each completion continues from the prompt's end
    segment_ids: Tensor  # (R, T) long: 0 prompt, k + 1 the k-th sample's completion, -1 padding
    predicted_at: Tensor  # (R, T) long: the position whose output predicts this token
    completion_mask: Tensor  # (R, T) bool: True only on sampled tokens that are trained on
    behaviour_logprobs: Tensor  # (R, T) float32: vLLM's logprob of input_ids[r, t]; 0 elsewhere
    advantages: Tensor  # (R, T) float32: the advantage of the token's sample; 0 elsewhere
    group_index: Tensor  # (R,) long: position of the row's group in the packed list
    samples: Tensor  # (R,) long: samples in the row
    lengths: Tensor  # (R,) long: tokens in the row (prompt + every completion)

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


def pack_groups(groups: list[ScoredGroup], scale: ScaleRewards, pad_token_id: int = 0) -> Batch:
    """One row per group (see the module docstring), right-padded with ``pad_token_id``. A
    completion token whose logged logprob is not finite stays as context but is not trained on."""
    rows: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []
    predicted_at: list[list[int]] = []
    behaviour: list[list[float]] = []
    sample_of_token: list[list[int]] = []  # index into the flat list of samples, -1 = none
    rewards: list[float] = []
    sample_group: list[int] = []
    for g, group in enumerate(groups):
        if len(group.rewards) != len(group.samples):
            raise ValueError(
                f"group {group.group_id}: {len(group.rewards)} rewards for "
                f"{len(group.samples)} samples"
            )
        prompt = group.prompt_token_ids
        if not prompt:
            raise ValueError(f"group {group.group_id} has no prompt tokens")
        p = len(prompt)
        row, pos, seg = row_layout(prompt, [sample.token_ids for sample in group.samples])
        pred, lps, owner = [0] * p, [0.0] * p, [-1] * p
        start = p
        for sample, reward in zip(group.samples, group.rewards, strict=True):
            n = len(sample.token_ids)
            if len(sample.logprobs) != n:
                raise ValueError(
                    f"group {group.group_id}: a sample has {n} tokens but "
                    f"{len(sample.logprobs)} logprobs"
                )
            # the first token is predicted by the prompt's last, the others by their own previous
            pred += [p - 1, *range(start, start + n - 1)] if n else []
            start += n
            lps += sample.logprobs
            owner += [len(rewards)] * n
            rewards.append(float(reward))
            sample_group.append(g)
        rows.append(row)
        positions.append(pos)
        segments.append(seg)
        predicted_at.append(pred)
        behaviour.append(lps)
        sample_of_token.append(owner)

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if rows else 0
    owner_t = padded(sample_of_token, -1)
    lp_t = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, lp in enumerate(behaviour):
        lp_t[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    finite = torch.isfinite(lp_t)
    completion = (owner_t >= 0) & finite
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(sample_group, dtype=torch.long),
        scale,
    ).float()
    token_adv = torch.where(completion, advantages[owner_t.clamp(min=0)], 0.0)
    return Batch(
        input_ids=padded(rows, pad_token_id),
        position_ids=padded(positions, 0),
        segment_ids=padded(segments, PAD_SEGMENT),
        predicted_at=padded(predicted_at, 0),
        completion_mask=completion,
        behaviour_logprobs=torch.where(completion, lp_t, 0.0),
        advantages=token_adv,
        group_index=torch.arange(len(rows), dtype=torch.long),
        samples=torch.tensor([len(g.samples) for g in groups], dtype=torch.long),
        lengths=lengths,
    )


def token_logprobs(model: nn.Module, batch: Batch, chunk: int = LOGPROB_CHUNK) -> Tensor:
    """log p(input_ids[r, t] | its prompt and its own earlier tokens) on completion positions,
    0 elsewhere; (R, T) float32, with grad when the model has any.

    The LM head runs on ``chunk`` completion positions at a time, each chunk under a
    non-reentrant checkpoint: a chunk's (chunk x vocab) logits and log-softmax are freed once
    its logprobs are picked, and backward recomputes them chunk by chunk. Without it, every
    completion position of the micro-batch would keep two float32 (positions x vocab) tensors
    alive until backward (49,152 columns for SmolLM2: 400 MB per 1,024 positions)."""
    # Any: transformers' models are typed as plain nn.Modules, whose attributes are Tensors.
    peft_or_plain: Any = model
    causal_lm: Any = (
        peft_or_plain.get_base_model() if hasattr(model, "get_base_model") else peft_or_plain
    )
    mask = batch.completion_mask
    targets = batch.input_ids[mask]
    rows = mask.nonzero()[:, 0]
    sources = batch.predicted_at[mask]
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": shared_prompt_mask(batch.segment_ids),
        "position_ids": batch.position_ids,
        "use_cache": False,
    }
    if _plain_lm_head(causal_lm):
        # Only the positions that predict a completion token go through the LM head.
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        hidden = backbone(**inputs).last_hidden_state
        head = causal_lm.get_output_embeddings()
        picked = _chunked_head_logprobs(head, hidden, rows, sources, targets, chunk)
    else:  # logit soft-capping or scaling lives in the model's own forward
        logits = model(**inputs).logits[rows, sources]
        picked = -F.cross_entropy(logits.float(), targets, reduction="none")
    return picked.new_zeros(mask.shape).masked_scatter(mask, picked)


def _chunked_head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    rows: Tensor,
    sources: Tensor,
    targets: Tensor,
    chunk: int,
) -> Tensor:
    """The targets' logprobs under ``head(hidden[rows, sources])``, ``chunk`` positions at a
    time; with grad, each chunk is checkpointed (see :func:`token_logprobs`)."""

    def logprobs(positions: Tensor, wanted: Tensor) -> Tensor:
        return -F.cross_entropy(head(positions).float(), wanted, reduction="none")

    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    pieces = []
    for start in range(0, targets.numel(), max(1, chunk)):
        end = start + chunk
        positions = hidden[rows[start:end], sources[start:end]]
        if grad:
            piece = checkpoint(logprobs, positions, targets[start:end], use_reentrant=False)
            pieces.append(cast(Tensor, piece))
        else:
            pieces.append(logprobs(positions, targets[start:end]))
    if not pieces:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


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

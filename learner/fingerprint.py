"""A version's fingerprint: the learner's own logprobs of a fixed probe, and how far another
computation of the same tokens may stray from them. Pure but for :func:`model_logprobs`.

vLLM loads an adapter by path on whichever replica is asked for it, and can serve something other
than what was trained without an error (a LoRA scaling read differently, target modules it does
not apply, a store a replica sees stale). Both sides can compute the logprob of given tokens: the
learner with its model when the candidate is written (stored in the candidate's ``ratchet.json``),
each replica through ``/v1/completions`` with ``prompt_logprobs`` (learner/served_check.py). The
same tokens under the same weights give the same logprobs up to the arithmetic's rounding, so the
distance between the two, the mean over the probe's tokens of ``|learner - served|``, is below a
tolerance for the precision they compute in; a different adapter is far past it.

The same distance, over the completion tokens of a round's groups, compares the logprobs vLLM
logged when it sampled with those the learner recomputes under the weights that served them
(learner/drift.py).

The tolerances (``learner.served_check.tolerance_float32`` and ``_bfloat16``) are a mean
``|Δ logprob|`` per token, measured on SmolLM2-135M-Instruct (docs/results/served-check.md):
float32 learner vs float32 vLLM, and a bfloat16 computation vs a float32 one; the less precise
of the two sides picks the tolerance.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

Precision = Literal["float32", "bfloat16"]

# The probe: prompts and answers of the kinds an alias serves (arithmetic, prose, JSON, another
# language), tokenized by the base model's tokenizer when a fingerprint is taken; the token ids
# are stored with it, so a replica is asked for exactly those.
PROBE_TEXTS: tuple[str, ...] = (
    "User: What is 17 plus 25?\nAssistant: 17 plus 25 is 42.",
    "User: Write a short line about autumn rain.\nAssistant: Cold rain on the roof; the maple "
    "lets go of its last red leaves.",
    'User: Give me a JSON object with a name and an age.\nAssistant: {"name": "Ada", "age": 36}',
    "User: Translate to French: good morning, how are you?\nAssistant: Bonjour, comment "
    "allez-vous ?",
)
MAX_PROBE_TOKENS = 64  # per probe: its cost on a replica is one short prefill

PRECISIONS: tuple[Precision, ...] = ("float32", "bfloat16")


def precision_of(dtype: torch.dtype | None) -> Precision:
    """The precision a computation in ``dtype`` rounds to (float16 counts as bfloat16's)."""
    return "bfloat16" if dtype in (torch.bfloat16, torch.float16) else "float32"


@dataclass(frozen=True)
class Fingerprint:
    """Per probe, its token ids and the logprob of each token after the first given those
    before it, as the learner computed them in ``precision``."""

    precision: Precision
    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "token_ids": [list(t) for t in self.token_ids],
            "logprobs": [list(lp) for lp in self.logprobs],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Fingerprint | None:
        """The fingerprint stored in a candidate's metadata; None when there is none or it is
        not one (a version from before fingerprints, an imported adapter)."""
        if not isinstance(data, dict):
            return None
        try:
            token_ids = tuple(tuple(int(t) for t in ids) for ids in data["token_ids"])
            logprobs = tuple(tuple(float(x) for x in lp) for lp in data["logprobs"])
            precision = data["precision"]
        except (KeyError, TypeError, ValueError):
            return None
        if precision not in PRECISIONS or len(token_ids) != len(logprobs):
            return None
        if any(len(lp) != len(ids) - 1 for ids, lp in zip(token_ids, logprobs, strict=True)):
            return None
        return cls(precision, token_ids, logprobs)


@dataclass(frozen=True)
class Distance:
    """How far one computation of the same tokens' logprobs is from another."""

    mean_abs: float  # mean over the tokens of |a - b|; inf where they could not be compared
    max_abs: float
    tokens: int

    def within(self, limit: float) -> bool:
        return self.tokens > 0 and self.mean_abs <= limit

    def describe(self) -> str:
        return (
            f"mean |Δ logprob| {self.mean_abs:.4f} (max {self.max_abs:.3f}, {self.tokens} tokens)"
        )


def distance(expected: Sequence[Sequence[float]], served: Sequence[Sequence[float]]) -> Distance:
    """The distance between two computations of the same probes' logprobs; ValueError when they
    are not of the same tokens (a probe or a token missing)."""
    if len(expected) != len(served) or any(
        len(a) != len(b) for a, b in zip(expected, served, strict=True)
    ):
        raise ValueError("the served logprobs are not of the fingerprint's tokens")
    pairs = zip(expected, served, strict=True)
    gaps = [abs(a - b) for xs, ys in pairs for a, b in zip(xs, ys, strict=True)]
    if not gaps:
        return Distance(math.inf, math.inf, 0)
    if not all(math.isfinite(g) for g in gaps):
        return Distance(math.inf, math.inf, len(gaps))
    return Distance(sum(gaps) / len(gaps), max(gaps), len(gaps))


def token_distance(learner: Tensor, served: Tensor, mask: Tensor) -> Distance:
    """:func:`distance` over the positions of ``mask`` of two (R, T) logprob tensors."""
    gaps = (learner.detach().float() - served.detach().float()).abs()[mask]
    if gaps.numel() == 0:
        return Distance(math.inf, math.inf, 0)
    if not bool(torch.isfinite(gaps).all()):
        return Distance(math.inf, math.inf, int(gaps.numel()))
    return Distance(float(gaps.mean()), float(gaps.max()), int(gaps.numel()))


def probe_token_ids(tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """:data:`PROBE_TEXTS` as the base model's tokens (at most :data:`MAX_PROBE_TOKENS` each)."""
    return tuple(
        tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])[
            :MAX_PROBE_TOKENS
        ]
        for text in PROBE_TEXTS
    )


def model_logprobs(
    model: nn.Module,
    token_ids: Sequence[Sequence[int]],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[tuple[float, ...], ...]:
    """Per probe, the logprob of each token after the first under ``model`` in eval mode (no
    dropout), without grad; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    out = []
    try:
        with torch.no_grad(), autocast:
            for ids in token_ids:
                inputs = torch.tensor([list(ids)], dtype=torch.long, device=device)
                logits = model(input_ids=inputs, use_cache=False).logits[0, :-1].float()
                picked = torch.log_softmax(logits, dim=-1).gather(1, inputs[0, 1:, None])
                out.append(tuple(float(x) for x in picked[:, 0].tolist()))
    finally:
        model.train(was_training)
    return tuple(out)


def fingerprint(
    model: nn.Module,
    token_ids: Sequence[Sequence[int]],
    device: torch.device,
    precision: Precision,
    autocast_dtype: torch.dtype | None = None,
) -> Fingerprint:
    """The model's fingerprint on the probe ``token_ids``."""
    logprobs = model_logprobs(model, token_ids, device, autocast_dtype)
    return Fingerprint(precision, tuple(tuple(ids) for ids in token_ids), logprobs)

"""A vLLM plugin for the embedded stack: correct and fast LoRA on vLLM's CPU build.

vLLM's CPU platform applies LoRA adapters through PyTorch fallbacks
(``vllm/lora/ops/torch_ops/lora_ops.py``, the ``bgmv_*`` ops, which the ``sgmv_*`` prefill ops
call) that gather one weight matrix per token, ``weights[indices]``. That has two costs here:

* **Wrong answers.** An index of -1 means "this token uses no adapter" (the GPU kernels skip it),
  but ``weights[-1]`` is the last adapter slot. Once ``--max-loras`` adapters are in use, a
  request for the base model that shares a batch with adapter requests gets the last slot's
  adapter applied (vllm-project/vllm#48421, open for 0.32). Measured on the embedded stack:
  every one of 8 greedy base answers changed when batched beside adapter requests. For Ratchet
  that corrupts exactly what matters: the gate compares v0 with a candidate in the same batches,
  and a canary splits live traffic between two versions.
* **Slow adapters.** The per-token copies of (out x rank) matrices made an adapter's greedy
  answers 3.4x slower than the base model's (64 prompts, SmolLM2-135M, rank 32 slots).

:func:`register` (the ``vllm.general_plugins`` entry point ``ratchet_cpu_lora``; the embedded
stack lists it in ``VLLM_PLUGINS``) swaps in versions with the same signatures that group a
batch's tokens by adapter: one matmul per adapter present, and a zero delta for -1 tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

# Under vLLM's logger, whose handler vLLM sets up in every process it starts: a plain module
# logger has none there, and its lines would be lost.
log = logging.getLogger("vllm.ratchet_cpu_lora")

PLUGIN_NAME = "ratchet_cpu_lora"
NO_LORA = -1


def _lora_delta(inputs: Tensor, weights: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """Row t of the result is ``inputs[t] @ weights[indices[t]].T``, or zeros where the index
    is -1. ``weights`` is (slots, out, in) or (slots, 1, out, in); the result is (T, out)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices).tolist()  # a CPU tensor: no device sync to speak of
    if len(slots) == 1 and slots[0] != NO_LORA:
        # The common case: every token of the batch uses the same adapter.
        return inputs @ weights[slots[0]].to(dtype).T
    out = inputs.new_zeros((inputs.shape[0], weights.shape[1]))
    for slot in slots:
        if slot == NO_LORA:
            continue
        rows = (indices == slot).nonzero().flatten()
        out[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = _lora_delta(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _lora_delta(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As vLLM's op: a single output row is broadcast, and the widths may differ by padding.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _lora_delta(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


REPLACEMENTS: dict[str, Any] = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def register() -> None:
    """Swap vLLM's CPU LoRA ops for ours, wherever vLLM bound them by name. Idempotent (vLLM
    loads general plugins once per process, in every process)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    # lora_ops: its sgmv_* call these through the module's globals; the other two imported them.
    for module in (lora_ops, torch_ops, punica_cpu):
        for name, replacement in REPLACEMENTS.items():
            if hasattr(module, name):
                setattr(module, name, replacement)
    log.info("%s: vLLM's CPU LoRA ops replaced (grouped by adapter, -1 = no adapter)", PLUGIN_NAME)
    _log_slot_loads()


SLOT_LOAD = "adapter loaded into a slot"


def _log_slot_loads() -> None:
    """A log line each time an adapter is moved into one of the ``--max-loras`` slots (vLLM
    counts none): how often a replica's adapters churn, which bench/fleet_routing.py reads."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager

    original = LRUCacheLoRAModelManager.activate_adapter
    if getattr(original, "_ratchet_logged", False):
        return
    loads = 0

    def activate_adapter(self: Any, lora_id: int) -> bool:
        nonlocal loads
        activated = bool(original(self, lora_id))
        if activated:
            loads += 1
            log.info("%s: %s (id %d; %d so far)", PLUGIN_NAME, SLOT_LOAD, lora_id, loads)
        return activated

    activate_adapter._ratchet_logged = True  # type: ignore[attr-defined]
    LRUCacheLoRAModelManager.activate_adapter = activate_adapter  # type: ignore[method-assign]

"""Real LoRA adapters with random weights, for tests and benchmarks that need vLLM to serve
versions that answer differently (no training): written to the store as the learner writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ratchet.store import AdapterStore


def write_random_adapters(
    model_path: Path, store: AdapterStore, alias: str, versions: list[int]
) -> None:
    """``alias@v<N>`` for each of ``versions`` not in the store yet: rank 8 on q and v, seeded by
    the version, so each answers differently and the same way on every run."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    missing = [version for version in versions if not store.exists(alias, version)]
    if not missing:
        return
    # One load of the base for all versions; each gets its own adapter, unloaded after writing
    # so the next one wraps the bare base again.
    # Any: peft's unload() gives the base back typed as a bare torch Module.
    base: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for version in missing:
        torch.manual_seed(version)
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        model: Any = get_peft_model(base, config)
        store.write(
            alias,
            version,
            model.save_pretrained,
            base_model_path=str(model_path),
            meta={"parent_version": 0, "note": "random test adapter"},
        )
        base = model.unload()  # the base without this version's LoRA layers

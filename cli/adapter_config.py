"""What `ratchet import` keeps of an adapter's ``adapter_config.json``, key by key (security
audit N-11: the rest of the file was copied unchecked).

vLLM reads the stored config to serve the adapter (vllm/lora/peft_helper.py: ``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ``bias``, ``modules_to_save``, and the
features it refuses); the learner trains on from the stored weights with its own
``LoraConfig`` (learner/trainer.py: rank, alpha, target modules, ``bias="none"``, plain alpha/r
scaling). An imported adapter must mean the same to both, so each key is one of:

- **kept**, checked: ``peft_type`` ("LORA"), ``r`` and ``lora_alpha`` (the learner's, checked by
  cli/adapter_checks.py; ``r`` is then at most vLLM's ``--max-lora-rank``, which is started at the
  learner's rank), ``target_modules`` (the learner's list, "all-linear" resolved),
  ``base_model_name_or_path`` (a string of at most :data:`MAX_TEXT` characters: provenance only);
- **normalised** to what the learner trains, any value that means the same accepted:
  ``task_type`` ("CAUSAL_LM"), ``inference_mode`` (true), ``bias`` ("none"), ``use_rslora``,
  ``use_dora``, ``lora_bias``, ``fan_in_fan_out`` (false), ``init_lora_weights`` (true: how the
  weights began does not matter once they are trained, unless it changed the base);
- **refused** when set to anything else (:data:`REFUSED`): what the learner would train, or vLLM
  would serve, differently from the other, or what vLLM refuses to load;
- **dropped**: every other key (dropout, revision, PEFT's version, ...): neither reads it for
  serving or training; the import names those set to something (not null, false or empty).
"""

from __future__ import annotations

from typing import Any

from cli.adapter_checks import ADAPTER_CONFIG, AdapterRefused, LoraShape

MAX_TEXT = 1024
# Initialisations that rewrite the base model's weights when PEFT loads the adapter: the served
# base is not the one they were trained against.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# key -> why a value other than "off" is refused.
REFUSED = {
    "use_rslora": "vLLM would scale it by alpha/sqrt(r) while the learner trains it at alpha/r",
    "use_dora": "vLLM does not serve DoRA and the learner does not train it",
    "bias": "vLLM refuses adapter biases and the learner trains none (bias: none)",
    "lora_bias": "vLLM refuses LoRA biases and the learner trains none",
    "modules_to_save": "vLLM serves no fully trained modules and the learner trains none",
    "rank_pattern": "the learner trains one rank on every module",
    "alpha_pattern": "the learner trains one alpha on every module",
    "layers_to_transform": "the learner trains every layer's target modules",
    "layers_pattern": "the learner trains every layer's target modules",
    "layer_replication": "vLLM does not serve replicated layers",
    "exclude_modules": "the learner trains every target module of every layer",
    "fan_in_fan_out": "the weights would be transposed (Conv1D layout): vLLM reads Linear's",
    "alora_invocation_tokens": "vLLM does not serve activated LoRA",
    "use_bdlora": "vLLM does not serve block-diagonal LoRA",
    "use_qalora": "vLLM does not serve QALoRA",
    "trainable_token_indices": "vLLM serves no trained token embeddings",
    "target_parameters": "the learner wraps modules, not parameters",
}
FALSE_KEYS = ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "use_qalora")


def stored_config(config: dict[str, Any], shape: LoraShape) -> tuple[dict[str, Any], list[str]]:
    """The config to store for an adapter of the learner's ``shape`` (checked before), and the
    keys dropped; AdapterRefused for a key set to what the learner or vLLM would not match."""
    for key, why in REFUSED.items():
        if _set(key, config.get(key)):
            raise AdapterRefused(
                f"{ADAPTER_CONFIG} sets {key}={_show(config[key])}: {why}. Train the adapter "
                f"without it (PEFT's default)"
            )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise AdapterRefused(
            f"{ADAPTER_CONFIG} sets init_lora_weights={init[:40]!r}, which rewrites the base "
            "model's weights when loaded: vLLM serves, and the learner trains on, the base as "
            "it is. Convert it to a plain LoRA (PEFT's path_initial_model_for_weight_conversion)"
        )
    stored: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": shape.rank,
        "lora_alpha": shape.alpha,
        "target_modules": list(shape.target_modules),
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        **dict.fromkeys(FALSE_KEYS, False),
    }
    declared = config.get("base_model_name_or_path")
    if isinstance(declared, str) and len(declared) <= MAX_TEXT:
        stored["base_model_name_or_path"] = declared
    dropped = sorted(key for key, value in config.items() if key not in stored and _set(key, value))
    return stored, dropped


def _set(key: str, value: Any) -> bool:
    """Whether ``value`` turns the feature on as vLLM and PEFT read it: by truth (so ``0`` and
    ``[]`` are off, and the string ``"false"`` is on), and for ``bias`` anything but "none"."""
    if key == "bias":
        return value is not None and value != "none"
    return bool(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""Checks on a LoRA adapter trained outside the loop, before it may enter the store.

An imported adapter is served by vLLM, gated like a learned candidate and, once live, trained on
by the learner, so it must be exactly what those three expect: a PEFT LoRA in safetensors (a
pickle runs code when loaded: ``adapter_model.bin`` is refused, never opened), of the learner's
shape (rank, alpha and target modules: the learner continues from the live version, and vLLM is
started with ``--max-lora-rank`` at least the learner's rank), with every tensor a LoRA A or B
of a linear layer the base model has, in that layer's dimensions. The base's dimensions come from
its safetensors headers, read here without loading a tensor or torch, so the CLI checks an
adapter in a second on a machine without the learner's libraries.

Pure: no Redis, no Kafka. ``cli/adapters.py`` stores what passes; the learner gates it.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Weights in these formats are pickles (torch.save, HF Trainer's .bin): loading one runs code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Bounds on what is read of files from elsewhere: a header or config past these is refused.
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_LAYER_WEIGHT = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<path>.+)\.weight$")
_LORA_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class AdapterRefused(ValueError):
    """The adapter cannot be imported; the message says why and what to change."""


@dataclass(frozen=True)
class LoraShape:
    """What the learner trains: rank, alpha and the names of the linear modules it wraps."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that passed every check, with what its provenance records."""

    folder: Path
    shape: LoraShape
    declared_base: str | None  # the adapter's own base_model_name_or_path
    sha256: str  # of adapter_model.safetensors
    tensors: int
    ignored_files: tuple[str, ...]  # present in the folder, never read or copied


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file (name -> ``dtype``, ``shape``, ``data_offsets``), read
    from its header alone and checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterRefused(f"{path.name} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise AdapterRefused(f"{path.name} is not a safetensors file (header of {length} B)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterRefused(f"{path.name}: its safetensors header is not JSON") from exc
    if not isinstance(header, dict):
        raise AdapterRefused(f"{path.name}: its safetensors header is not an object")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and 0 <= o <= data for o in offsets)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise AdapterRefused(f"{path.name}: tensor {name!r} is malformed or past the file")
    return header


def base_linear_shapes(base_model: Path) -> dict[str, tuple[int, int]]:
    """Every linear weight of the base's transformer blocks: module path (as PEFT names it,
    ``model.layers.0.self_attn.q_proj``) -> (out, in). Read from the safetensors headers."""
    files = sorted(base_model.glob("*.safetensors"))
    if not files:
        raise AdapterRefused(
            f"no safetensors weights in {base_model}: learner.base_model_path must be the "
            "folder vLLM serves the base from"
        )
    shapes: dict[str, tuple[int, int]] = {}
    for file in files:
        for name, info in safetensors_header(file).items():
            match = _LAYER_WEIGHT.match(name)
            if match and len(info["shape"]) == 2:
                out_features, in_features = info["shape"]
                shapes[name.removesuffix(".weight")] = (out_features, in_features)
    return shapes


def linear_module_names(shapes: Iterable[str]) -> tuple[str, ...]:
    """The short names of the linear modules (``q_proj``, ...): what "all-linear" means."""
    return tuple(sorted({path.rsplit(".", 1)[-1] for path in shapes}))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterRefused(f"{folder} has no {ADAPTER_CONFIG}: is it a PEFT adapter folder?")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRefused(f"{ADAPTER_CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _check_weights_file(folder: Path) -> Path:
    weights = folder / ADAPTER_WEIGHTS
    pickles = sorted(
        p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES
    )
    if not weights.is_file():
        if pickles:
            raise AdapterRefused(
                f"the weights are a pickle ({', '.join(pickles)}), which runs code when loaded: "
                f"Ratchet imports safetensors only. Save with safe_serialization=True (PEFT's "
                f"default), or convert it where you trust it, to {ADAPTER_WEIGHTS}"
            )
        raise AdapterRefused(f"{folder} has no {ADAPTER_WEIGHTS}")
    return weights


def _config_shape(config: dict[str, Any]) -> LoraShape:
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(f"peft_type is {config.get('peft_type')!r}: only LoRA is served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    targets = config.get("target_modules")
    if not isinstance(rank, int) or not isinstance(alpha, int | float):
        raise AdapterRefused(f"{ADAPTER_CONFIG} has no integer r and numeric lora_alpha")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(f"{ADAPTER_CONFIG} has no list of target_modules")
    for unsupported in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(unsupported):
            raise AdapterRefused(
                f"{ADAPTER_CONFIG} sets {unsupported}: vLLM serves, and the learner trains, one "
                "rank and alpha on the target modules of every layer, nothing else"
            )
    if config.get("use_dora"):
        raise AdapterRefused("DoRA adapters are not served by vLLM")
    return LoraShape(int(rank), int(alpha), tuple(sorted(set(targets))))


def _check_shape(found: LoraShape, wanted: LoraShape, base: dict[str, tuple[int, int]]) -> None:
    targets = found.target_modules
    if targets == ("all-linear",):
        targets = linear_module_names(base)
    found = LoraShape(found.rank, found.alpha, targets)
    if found != wanted:
        raise AdapterRefused(
            f"the adapter's (rank, alpha, target modules) are ({found.rank}, {found.alpha}, "
            f"{list(found.target_modules)}), the learner's ({wanted.rank}, {wanted.alpha}, "
            f"{list(wanted.target_modules)}): the learner trains on from the live version and "
            "vLLM serves ranks up to the learner's, so train the adapter with these, or change "
            "learner.lora.rank, learner.lora.alpha and learner.lora.target_modules for the alias's "
            "next versions"
        )


def _check_tensors(
    header: dict[str, dict[str, Any]], shape: LoraShape, base: dict[str, tuple[int, int]]
) -> None:
    """Every tensor a LoRA A (rank x in) or B (out x rank) of a targeted base linear layer, and
    every targeted layer with both."""
    wanted = {path for path in base if path.rsplit(".", 1)[-1] in shape.target_modules}
    seen: set[tuple[str, str]] = set()
    for name, info in header.items():
        match = _LORA_TENSOR.match(name)
        if match is None:
            raise AdapterRefused(f"tensor {name!r} is not a LoRA A or B weight of a linear layer")
        module, part = match["module"], match["part"]
        if module not in wanted:
            raise AdapterRefused(f"tensor {name!r} names no targeted linear layer of the base")
        if info.get("dtype") not in FLOAT_DTYPES:
            raise AdapterRefused(f"tensor {name!r} is {info.get('dtype')}, not a float type")
        out_features, in_features = base[module]
        expected = [shape.rank, in_features] if part == "A" else [out_features, shape.rank]
        if info["shape"] != expected:
            raise AdapterRefused(
                f"tensor {name!r} has shape {info['shape']}, the base needs {expected}: the "
                "adapter was trained on another base model"
            )
        seen.add((module, part))
    missing = sorted(m for m in wanted for p in "AB" if (m, p) not in seen)
    if missing:
        raise AdapterRefused(
            f"the adapter lacks LoRA weights for {len(missing)} targeted layers "
            f"(first: {missing[0]})"
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_adapter(folder: Path, base_model: Path, learner_shape: LoraShape) -> CheckedAdapter:
    """The adapter in ``folder`` if it can be imported for ``base_model``; else AdapterRefused."""
    if not folder.is_dir():
        raise AdapterRefused(f"{folder} is not a folder: give the PEFT adapter's folder")
    weights = _check_weights_file(folder)
    config = _read_config(folder)
    base = base_linear_shapes(base_model)
    found = _config_shape(config)
    _check_shape(found, learner_shape, base)
    header = safetensors_header(weights)
    _check_tensors(header, learner_shape, base)
    declared = config.get("base_model_name_or_path")
    ignored = sorted(
        p.name for p in folder.iterdir() if p.name not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
    )
    return CheckedAdapter(
        folder=folder,
        shape=learner_shape,
        declared_base=declared if isinstance(declared, str) else None,
        sha256=file_sha256(weights),
        tensors=len(header),
        ignored_files=tuple(ignored),
    )

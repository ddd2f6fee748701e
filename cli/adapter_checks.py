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
import math
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
# Bytes per element of every safetensors dtype (the format's own list).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
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
    config: dict[str, Any]  # adapter_config.json as stored (cli/adapter_config.py)
    dropped_keys: tuple[str, ...]  # of adapter_config.json: neither vLLM nor the learner reads them


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
    spans = [_span(path, name, info, size - 8 - length) for name, info in header.items()]
    _check_layout(path, sorted(spans), size - 8 - length)
    return header


def _span(path: Path, name: str, info: Any, data: int) -> tuple[int, int, str]:
    """The tensor's bytes in the data region, checked against its dtype and shape."""
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    dtype = info.get("dtype") if isinstance(info, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or dtype not in DTYPE_BYTES
    ):
        raise AdapterRefused(f"{path.name}: tensor {name!r} is malformed or past the file")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise AdapterRefused(
            f"{path.name}: tensor {name!r} spans {end - begin} bytes, its {dtype} shape {shape} "
            f"needs {math.prod(shape) * DTYPE_BYTES[dtype]}"
        )
    return begin, end, name


def _check_layout(path: Path, spans: list[tuple[int, int, str]], data: int) -> None:
    """The tensors tile the data region: no two share a byte and none is left over (as the
    safetensors format requires; a reader would otherwise see one tensor's bytes in another)."""
    at = 0
    for begin, end, name in spans:
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else "leaves a gap before it"
            raise AdapterRefused(f"{path.name}: tensor {name!r} {what}")
        at = end
    if at != data:
        raise AdapterRefused(f"{path.name}: {data - at} bytes after the last tensor")


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
    # bool is an int to Python, and an alpha of 16.5 is no integer alpha the learner trains.
    if (
        not isinstance(rank, int)
        or isinstance(rank, bool)
        or not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
    ):
        raise AdapterRefused(f"{ADAPTER_CONFIG} has no integer r and numeric lora_alpha")
    if not float(alpha).is_integer():
        raise AdapterRefused(
            f"{ADAPTER_CONFIG} has lora_alpha {alpha!r}: the learner trains an integer alpha"
        )
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(f"{ADAPTER_CONFIG} has no list of target_modules")
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


def _check_weights_size(weights: Path, shape: LoraShape, base: dict[str, tuple[int, int]]) -> None:
    """No larger than the learner's adapter for this base can be, in float32, with the largest
    header allowed: checked before the file is read or hashed."""
    lora = sum(
        shape.rank * (out + inp) * 4
        for path, (out, inp) in base.items()
        if path.rsplit(".", 1)[-1] in shape.target_modules
    )
    most = 8 + MAX_HEADER_BYTES + lora
    size = weights.stat().st_size
    if size > most:
        raise AdapterRefused(
            f"{ADAPTER_WEIGHTS} is {size} bytes: a LoRA of rank {shape.rank} on this base's "
            f"target modules is at most {most} in float32 with its header"
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
    from cli.adapter_config import stored_config  # it builds on this module's types

    weights = _check_weights_file(folder)
    config = _read_config(folder)
    base = base_linear_shapes(base_model)
    found = _config_shape(config)
    stored, dropped = stored_config(config, learner_shape)
    _check_shape(found, learner_shape, base)
    _check_weights_size(weights, learner_shape, base)
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
        config=stored,
        dropped_keys=tuple(dropped),
    )

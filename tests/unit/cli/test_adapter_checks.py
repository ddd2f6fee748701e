"""The checks an adapter trained elsewhere must pass before `ratchet import` stores it, on a tiny
base model and adapters written here as real safetensors files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from cli.adapter_checks import (
    AdapterRefused,
    LoraShape,
    base_linear_shapes,
    check_adapter,
    linear_module_names,
    safetensors_header,
)

HIDDEN, KV, MLP, LAYERS = 8, 4, 16, 2
# module -> (out, in), as in a Llama block
MODULES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (MLP, HIDDEN),
    "mlp.up_proj": (MLP, HIDDEN),
    "mlp.down_proj": (HIDDEN, MLP),
}
ALL = tuple(sorted(m.rsplit(".", 1)[-1] for m in MODULES))
SHAPE = LoraShape(rank=4, alpha=8, target_modules=ALL)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    tensors = {"model.embed_tokens.weight": np.zeros((32, HIDDEN), np.float32)}
    for layer in range(LAYERS):
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = np.zeros(HIDDEN, np.float32)
        for module, (out, inp) in MODULES.items():
            tensors[f"model.layers.{layer}.{module}.weight"] = np.zeros((out, inp), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def lora_tensors(rank: int = 4, in_scale: int = 1) -> dict[str, np.ndarray]:
    tensors = {}
    for layer in range(LAYERS):
        for module, (out, inp) in MODULES.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = np.ones((rank, inp * in_scale), np.float32)
            tensors[f"{name}.lora_B.weight"] = np.zeros((out, rank), np.float32)
    return tensors


def write_adapter(
    folder: Path,
    tensors: dict[str, np.ndarray] | None = None,
    **config: object,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": list(ALL),
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    save_file(
        lora_tensors() if tensors is None else tensors, str(folder / "adapter_model.safetensors")
    )
    return folder


def test_an_adapter_of_the_learners_shape_passes_and_others_files_are_never_read(
    base: Path, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / "training_args.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")
    (folder / "README.md").write_text("card")
    checked = check_adapter(folder, base, SHAPE)
    assert checked.tensors == 2 * LAYERS * len(MODULES)
    assert checked.declared_base == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert checked.ignored_files == ("README.md", "training_args.bin")
    assert len(checked.sha256) == 64


def test_all_linear_is_every_linear_module_of_the_blocks(base: Path, tmp_path: Path) -> None:
    assert linear_module_names(base_linear_shapes(base)) == ALL
    folder = write_adapter(tmp_path / "a", target_modules="all-linear")
    assert check_adapter(folder, base, SHAPE).shape == SHAPE


def test_a_pickled_adapter_is_refused_without_being_opened(base: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (folder / "adapter_model.bin").write_bytes(b"not even a valid pickle")
    with pytest.raises(AdapterRefused, match=r"pickle \(adapter_model.bin\).*safetensors only"):
        check_adapter(folder, base, SHAPE)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"r": 8}, r"\(8, 8, .*learner\.lora\.rank"),
        ({"lora_alpha": 16}, r"\(4, 16, "),
        ({"target_modules": ["q_proj", "v_proj"]}, r"'q_proj', 'v_proj'\]\), the learner's"),
        ({"peft_type": "IA3"}, "only LoRA"),
        ({"modules_to_save": ["lm_head"]}, "sets modules_to_save"),
        ({"use_dora": True}, "DoRA"),
    ],
)
def test_an_adapter_of_another_shape_or_kind_is_refused(
    base: Path, tmp_path: Path, config: dict[str, object], message: str
) -> None:
    folder = write_adapter(tmp_path / "a", **config)
    with pytest.raises(AdapterRefused, match=message):
        check_adapter(folder, base, SHAPE)


def test_an_adapter_of_another_base_is_refused(base: Path, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", tensors=lora_tensors(in_scale=2))
    with pytest.raises(AdapterRefused, match="trained on another base model"):
        check_adapter(folder, base, SHAPE)


def test_tensors_beyond_lora_on_the_blocks_are_refused(base: Path, tmp_path: Path) -> None:
    extra = {**lora_tensors(), "base_model.model.lm_head.weight": np.zeros((32, 8), np.float32)}
    with pytest.raises(AdapterRefused, match="not a LoRA A or B"):
        check_adapter(write_adapter(tmp_path / "a", tensors=extra), base, SHAPE)
    layer9 = {
        **lora_tensors(),
        "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": np.ones(
            (4, HIDDEN), np.float32
        ),
    }
    with pytest.raises(AdapterRefused, match="names no targeted linear layer"):
        check_adapter(write_adapter(tmp_path / "b", tensors=layer9), base, SHAPE)
    ints = {k: v.astype(np.int32) for k, v in lora_tensors().items()}
    with pytest.raises(AdapterRefused, match="not a float type"):
        check_adapter(write_adapter(tmp_path / "c", tensors=ints), base, SHAPE)


def test_an_adapter_missing_a_layer_is_refused(base: Path, tmp_path: Path) -> None:
    partial = {k: v for k, v in lora_tensors().items() if ".layers.1.mlp.down_proj." not in k}
    with pytest.raises(AdapterRefused, match=r"lacks LoRA weights for 2 targeted layers"):
        check_adapter(write_adapter(tmp_path / "a", tensors=partial), base, SHAPE)


def test_a_header_that_lies_about_its_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(AdapterRefused, match="not a safetensors file"):
        safetensors_header(path)
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(AdapterRefused, match="past the file"):
        safetensors_header(path)


def test_a_folder_without_an_adapter_is_refused(base: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterRefused, match="not a folder"):
        check_adapter(tmp_path / "missing", base, SHAPE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterRefused, match=r"no adapter_model\.safetensors"):
        check_adapter(tmp_path / "empty", base, SHAPE)

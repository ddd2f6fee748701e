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


# ---- N-11: every key kept is checked; the weights file's layout and size ----------------------


def test_the_stored_config_keeps_only_checked_keys_and_names_the_dropped(
    base: Path, tmp_path: Path
) -> None:
    folder = write_adapter(
        tmp_path / "a",
        lora_alpha=8.0,  # the same alpha written as a float
        use_rslora=0,  # off, however spelled
        bias="none",
        lora_bias=False,
        modules_to_save=None,
        rank_pattern={},
        init_lora_weights="gaussian",  # how it began: no matter once trained
        task_type="SEQ_2_SEQ_LM",
        inference_mode=False,
        lora_dropout=0.05,
        revision="main",
        vllm_lora_scaling_factor=100.0,
    )
    checked = check_adapter(folder, base, SHAPE)
    assert checked.config == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": list(ALL),
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "fan_in_fan_out": False,
        "use_qalora": False,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    # Named when set to something: an empty rank_pattern or a null modules_to_save says nothing.
    assert checked.dropped_keys == ("lora_dropout", "revision", "vllm_lora_scaling_factor")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_rslora": True}, r"use_rslora=True: vLLM would scale it by alpha/sqrt\(r\)"),
        ({"use_rslora": "false"}, "use_rslora='false'"),  # a string vLLM reads as on
        ({"use_rslora": 1}, "use_rslora=1"),
        ({"bias": "all"}, "bias='all': vLLM refuses"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"layer_replication": [[0, 1]]}, "layer_replication"),
        ({"exclude_modules": ["q_proj"]}, "exclude_modules"),
        ({"fan_in_fan_out": True}, "Conv1D layout"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"target_parameters": ["experts.gate_up_proj"]}, "target_parameters"),
        ({"alora_invocation_tokens": [5]}, "activated LoRA"),
        ({"init_lora_weights": "pissa_niter_4"}, "rewrites the base model's weights"),
        ({"init_lora_weights": "olora"}, "rewrites the base"),
        ({"init_lora_weights": "loftq"}, "rewrites the base"),
        ({"lora_alpha": 8.5}, "lora_alpha 8.5: the learner trains an integer alpha"),
        ({"r": True}, "no integer r"),
    ],
)
def test_a_key_that_vllm_or_the_learner_would_read_otherwise_is_refused(
    base: Path, tmp_path: Path, config: dict[str, object], message: str
) -> None:
    with pytest.raises(AdapterRefused, match=message):
        check_adapter(write_adapter(tmp_path / "a", **config), base, SHAPE)


def written(path: Path, tensors: dict[str, dict[str, object]], data: bytes) -> Path:
    header = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    ("tensors", "data", "message"),
    [
        (  # b shares a's bytes: a reader would see one in the other
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "'b' overlaps the tensor before it",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            "leaves a gap before it",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4096,
            "4088 bytes after the last tensor",
        ),
        (
            {"a": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 16]}},
            b"\0" * 16,
            r"spans 16 bytes, its F16 shape \[2, 2\] needs 8",
        ),
        (
            {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
            b"\0" * 16,
            "malformed",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
            b"\0" * 8,
            "malformed",
        ),
    ],
)
def test_tensor_offsets_must_tile_the_data_exactly(
    tmp_path: Path, tensors: dict[str, dict[str, object]], data: bytes, message: str
) -> None:
    with pytest.raises(AdapterRefused, match=message):
        safetensors_header(written(tmp_path / "x.safetensors", tensors, data))


def test_a_weights_file_larger_than_any_adapter_of_the_shape_is_refused_unread(
    base: Path, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(1 << 30)  # sparse: a GiB on paper, nothing on disk
    with pytest.raises(AdapterRefused, match=r"is 1073741824 bytes: a LoRA of rank 4"):
        check_adapter(folder, base, SHAPE)

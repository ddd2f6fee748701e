"""`ratchet import` against the real stack: an adapter trained outside the loop (a few steps of
plain PEFT supervised training, in this process) is checked, stored as the alias's next version,
gated by the real learner against the live version on held-out prompts through vLLM, and
promoted or rejected by that gate, as a learned candidate would be; a pickled adapter is refused
before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from console.views import ConsoleData
from ratchet.records import EVENTS_TOPIC, LifecycleEvent
from ratchet.registry import AliasRoute
from ratchet.settings import load_settings
from ratchet.store import AdapterStore
from ratchet.versions import queued_imports
from tests.integration.conftest import BASE_MODEL, Embedded, ratchet_cli
from tests.integration.test_learner import (
    LONG_ROUND_S,
    SHORT_GATE,
    TRAIN,
    heldout_prompts,
    history,
    learner_config,
    produce,
    right_answer,
    running_learner,
    wait_for_event,
)

pytestmark = pytest.mark.integration


def train_elsewhere(model_path: Path, out: Path, safe: bool = True, steps: int = 8) -> Path:
    """A LoRA of the learner's default shape (rank 8, alpha 16, every linear layer) trained with
    plain PEFT and torch on the demo task's right answers: nothing of Ratchet's learner."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for step in range(steps):
        prompt = TRAIN[step % len(TRAIN)]
        ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True)
        prompt_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        answer = tokenizer(right_answer(prompt), add_special_tokens=False)["input_ids"] + [end]
        inputs = torch.tensor([prompt_ids + answer])
        labels = torch.tensor([[-100] * len(prompt_ids) + answer])
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out), safe_serialization=safe)
    return out


@pytest.mark.timeout(900)
def test_an_adapter_trained_elsewhere_is_imported_gated_and_settled_and_a_pickle_refused(
    embedded: Embedded, tmp_path: Path
) -> None:
    alias = "imp-gate"
    # Either verdict passes (an import is gated as a learned candidate is): a short gate.
    config = learner_config(embedded, tmp_path, alias, gate_tokens=16, gate=SHORT_GATE)
    settings = load_settings(config)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    produce(embedded, heldout_prompts(alias))
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]

    pickled = train_elsewhere(embedded.model_path, tmp_path / "pickled", safe=False, steps=1)
    assert (pickled / "adapter_model.bin").is_file()
    refused = ratchet_cli("import", alias, str(pickled), "--config", str(config))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "pickle (adapter_model.bin)" in refused.stdout and "safetensors only" in refused.stdout
    assert store.versions(alias) == [] and not history(settings, alias)

    adapter = train_elsewhere(embedded.model_path, tmp_path / "elsewhere")
    # The same weights, but a config vLLM would scale by alpha/sqrt(r): refused, nothing stored.
    rslora = tmp_path / "rslora"
    shutil.copytree(adapter, rslora)
    rslora_config = json.loads((rslora / "adapter_config.json").read_text())
    (rslora / "adapter_config.json").write_text(json.dumps({**rslora_config, "use_rslora": True}))
    refused = ratchet_cli("import", alias, str(rslora), "--config", str(config))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "use_rslora=True" in refused.stdout and "alpha/sqrt(r)" in refused.stdout
    assert store.versions(alias) == [] and not history(settings, alias)

    imported = ratchet_cli("import", alias, str(adapter), "--config", str(config))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert f"{alias}: imported as v1" in imported.stdout
    # Only what vLLM and the learner read alike is stored; PEFT's other keys are named.
    stored = json.loads((store.path(alias, 1) / "adapter_config.json").read_text())
    assert stored["use_rslora"] is False and stored["bias"] == "none"
    assert stored["target_modules"] == sorted(stored["target_modules"]) and stored["r"] == 8
    kept = {"peft_type", "task_type", "r", "lora_alpha", "target_modules", "bias"}
    kept |= {"inference_mode", "init_lora_weights", "base_model_name_or_path"}
    kept |= {"use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "use_qalora"}
    assert set(stored) <= kept and "keys not kept" in imported.stdout
    meta = store.meta(alias, 1)
    assert meta["origin"] == "import" and meta["source"] == str(adapter.resolve())
    assert meta["parent_version"] == 0
    [candidate] = history(settings, alias)
    assert candidate["kind"] == "candidate" and candidate["actor"] == "cli"
    assert candidate["detail"]["origin"] == "import"
    assert queued_imports(embedded.registry.redis, alias) == [1]

    with running_learner(config, tmp_path / "state"):
        [outcome] = wait_for_event(settings, alias, {"promote", "reject"}, timeout_s=LONG_ROUND_S)
    gate: dict[str, Any] = next(e for e in history(settings, alias) if e["kind"] == "gate")
    assert gate["version"] == 1 and gate["previous_version"] == 0
    assert gate["detail"]["pairs"] >= 1 and gate["detail"]["win_rate"] is not None
    # The gate decided, as for a learned candidate (no canary in this alias's config).
    assert outcome["kind"] == ("promote" if gate["detail"]["passed"] else "reject"), gate
    assert outcome["version"] == 1 and outcome["detail"]["origin"] == "import"
    assert queued_imports(embedded.registry.redis, alias) == []
    status = store.status(alias, 1)
    assert status is not None
    assert status["status"] == ("promoted" if gate["detail"]["passed"] else "rejected")
    if gate["detail"]["passed"]:
        embedded.wait_for_proxy_route(alias, active_version=1)

    kinds = [
        (r.kind, r.actor)
        for r in embedded.find_records(
            EVENTS_TOPIC,
            lambda r: isinstance(r, LifecycleEvent) and r.alias == alias,
            count=3,
            timeout_s=30,
        )
    ]
    assert kinds == [("candidate", "cli"), ("gate", "learner"), (outcome["kind"], "learner")]

    # The console says where the version came from, in its lineage and its round.
    detail = ConsoleData(settings).detail(alias)
    assert detail is not None
    [node] = [n for n in detail.lineage if n.version == 1]
    assert (node.origin, node.source) == ("import", str(adapter.resolve()))
    [row] = detail.rounds
    assert row.origin == "import" and row.win_rate == gate["detail"]["win_rate"]
    status_cli = ratchet_cli("status", "--config", str(config))
    assert "v1 (imported)" in status_cli.stdout, status_cli.stdout

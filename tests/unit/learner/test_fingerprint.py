"""Served equals trained, without a network: the fingerprint's tolerance in float32 and bfloat16
on the real base model (learner/fingerprint.py), a replica's answer read and compared
(learner/served_check.py), and the per-round drift of a group whose logged logprobs were
perturbed (learner/drift.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.batch import pack_groups, token_logprobs
from learner.drift import Measures, drift_block, drift_record, round_drift
from learner.fingerprint import (
    Distance,
    Fingerprint,
    distance,
    fingerprint,
    model_logprobs,
    probe_token_ids,
)
from learner.metrics import LearnerMetrics
from learner.served_check import ReplicaCheck, ServedCheck, ServedVerdict, served_logprobs
from learner.trainer import LoraGRPOLearner
from ratchet.records import Sample, ScoredGroup
from ratchet.settings import LearnerSettings, LoraSettings, RatchetSettings, ServedCheckSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KNOBS = ServedCheckSettings(served_precision="float32")  # the tolerance is the learner's
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def real_probe(real_base_model: Path) -> tuple[Any, tuple[tuple[int, ...], ...]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_base_model, dtype=torch.float32)
    return model, probe_token_ids(AutoTokenizer.from_pretrained(real_base_model))


def test_float32_and_bfloat16_stay_within_their_tolerance_and_another_adapter_does_not(
    real_probe: tuple[Any, tuple[tuple[int, ...], ...]],
) -> None:
    from peft import LoraConfig, get_peft_model

    model, probe = real_probe
    f32 = fingerprint(model, probe, CPU, "float32")
    assert all(len(lp) == len(ids) - 1 for ids, lp in zip(probe, f32.logprobs, strict=True))
    same = distance(f32.logprobs, model_logprobs(model, probe, CPU))
    bf16 = distance(f32.logprobs, model_logprobs(model, probe, CPU, torch.bfloat16))
    torch.manual_seed(1)
    other = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                   init_lora_weights=False, task_type="CAUSAL_LM"),
    )  # fmt: skip
    try:
        wrong = distance(f32.logprobs, model_logprobs(other, probe, CPU))
    finally:
        other.unload()
    # The same float32 computation again: within float32's tolerance.
    assert same.within(KNOBS.tolerance("float32")), same
    # bfloat16's rounding alone is past float32's tolerance, and within bfloat16's.
    assert not bf16.within(KNOBS.tolerance("float32")), bf16
    assert bf16.within(KNOBS.tolerance("bfloat16")), bf16
    # Another adapter under the same name is far past either.
    assert wrong.mean_abs > 3 * KNOBS.tolerance("bfloat16"), wrong
    print(f"\nprobe distances: float32 {same.describe()}; bfloat16 {bf16.describe()}; "
          f"another adapter {wrong.describe()}")  # fmt: skip


def test_the_tolerance_is_the_less_precise_sides() -> None:
    f32 = ServedCheckSettings(served_precision="float32")
    assert f32.tolerance("float32") == f32.tolerance_float32
    assert f32.tolerance("bfloat16") == f32.tolerance_bfloat16
    assert ServedCheckSettings(served_precision="bfloat16").tolerance("float32") == (
        f32.tolerance_bfloat16
    )


def test_a_fingerprint_survives_its_json_and_refuses_what_is_not_one() -> None:
    taken = Fingerprint("float32", ((5, 6, 7),), ((-1.5, -0.25),))
    assert Fingerprint.from_dict(taken.as_dict()) == taken
    assert Fingerprint.from_dict(None) is None
    assert Fingerprint.from_dict({**taken.as_dict(), "precision": "int8"}) is None
    assert Fingerprint.from_dict({**taken.as_dict(), "logprobs": [[-1.5]]}) is None


def vllm_answer(token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> dict[str, Any]:
    """One choice as vLLM's /v1/completions answers ``prompt_logprobs: 0``: None first, then the
    prompt's own token (and, where it was not the top one, the top one) per position."""
    entries: list[Any] = [None]
    for token, lp in zip(token_ids[1:], logprobs, strict=True):
        entries.append({str(token): {"logprob": lp, "rank": 2}, "0": {"logprob": -0.1, "rank": 1}})
    return {"index": 0, "text": "x", "prompt_logprobs": entries}


def test_a_replica_within_the_tolerance_matches_and_one_past_it_is_named() -> None:
    taken = Fingerprint("float32", ((5, 6, 7), (8, 9)), ((-1.5, -0.25), (-3.0,)))
    check = ServedCheck("key", timeout_s=1, wait_s=0, limit=0.01)
    close = [vllm_answer(ids, tuple(x + 0.001 for x in lp))
             for ids, lp in zip(taken.token_ids, taken.logprobs, strict=True)]  # fmt: skip
    far = [vllm_answer(ids, tuple(x - 0.5 for x in lp))
           for ids, lp in zip(taken.token_ids, taken.logprobs, strict=True)]  # fmt: skip
    far[1]["index"] = 1
    close[1]["index"] = 1
    good = check.compare("http://a:8000", {"choices": close}, taken)
    bad = check.compare("http://b:8000", {"choices": far[::-1]}, taken)  # any order of choices
    assert good.outcome == "match" and good.distance is not None
    assert good.distance.mean_abs == pytest.approx(0.001)
    assert bad.outcome == "mismatch" and bad.distance is not None
    assert bad.distance.mean_abs == pytest.approx(0.5)
    verdict = ServedVerdict("support@v3", (good, bad), 0.01)
    assert not verdict.passed
    assert "http://b:8000 serves other weights" in verdict.reason
    assert "http://a:8000" not in verdict.reason
    # An answer without the probe's logprobs is not a match.
    assert check.compare("http://c", {"choices": [{"index": 0}]}, taken).outcome == "unloaded"
    unloaded = ReplicaCheck("http://c", "unloaded", detail="HTTP 404 not found")
    assert "http://c cannot serve it: HTTP 404" in ServedVerdict("s", (unloaded,), 0.01).reason
    assert not ServedVerdict("s", (), 0.01).passed


def test_served_logprobs_refuse_an_answer_of_other_tokens() -> None:
    body = {"choices": [vllm_answer((5, 6, 7), (-1.0, -2.0))]}
    assert served_logprobs(body, (5, 6, 7)) == (-1.0, -2.0)
    with pytest.raises(ValueError):
        served_logprobs(body, (5, 6, 8))
    with pytest.raises(ValueError):
        served_logprobs(body, (5, 6))


# --- the per-round drift -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_learner(tmp_path_factory: pytest.TempPathFactory) -> LoraGRPOLearner:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return LoraGRPOLearner(
        folder, LoraSettings(rank=4, alpha=8, dropout=0.5), LearnerSettings(precision="fp32"), "cpu"
    )


def served_group(learner: LoraGRPOLearner, version: int, shift: float = 0.0) -> ScoredGroup:
    """A group of two answers whose logged logprobs are the learner's own, moved by ``shift``."""
    prompt, answers = [3, 4, 5, 6], [[7, 8, 9], [10, 11]]
    samples = [
        Sample(message={"role": "assistant"}, text="", token_ids=a, logprobs=[0.0] * len(a))
        for a in answers
    ]
    group = ScoredGroup(
        group_id=f"g{version}", alias="support", version=version, response_model="m",
        prompt_messages=[], prompt_token_ids=prompt, samples=samples, rewards=[0.0, 1.0],
        traffic_request_id="r",
    )  # fmt: skip
    batch = pack_groups([group], "group")
    learner.model.eval()
    with torch.no_grad():
        exact = token_logprobs(learner.model, batch)[0]
    learner.model.train()
    row = batch.completion_mask[0]
    values = (exact[row] + shift).tolist()
    for sample in group.samples:
        sample.logprobs = [values.pop(0) for _ in sample.token_ids]
    return group


def test_the_round_drift_of_perturbed_logprobs_blocks_the_candidate(
    tiny_learner: LoraGRPOLearner,
) -> None:
    settings = RatchetSettings(
        learner=LearnerSettings(
            served_check=ServedCheckSettings(served_precision="float32", drift_min_tokens=1)
        )
    )
    limit = settings.learner.served_check.tolerance("float32")
    served = served_group(tiny_learner, version=3)
    exact = round_drift(tiny_learner, [served], 3, 8, "group")
    # Eval mode: the LoRA dropout of 0.5 does not move the learner's logprobs.
    assert exact is not None and exact.tokens == 5 and exact.mean_abs < 1e-5, exact
    assert drift_block(drift_record(3, exact, "float32"), settings) is None

    perturbed = served_group(tiny_learner, version=3, shift=0.3)
    drift = round_drift(tiny_learner, [perturbed], 3, 8, "group")
    assert drift is not None and drift.mean_abs == pytest.approx(0.3, abs=1e-4)
    assert not drift.within(limit)
    reason = drift_block(drift_record(3, drift, "float32"), settings)
    assert reason is not None and "v3" in reason and "0.3000" in reason, reason
    # Only the groups sampled from the weights the learner holds are compared.
    assert round_drift(tiny_learner, [perturbed], 2, 8, "group") is None
    assert round_drift(tiny_learner, [perturbed], 3, 0, "group") is None


def test_measures_export_the_drift_and_keep_it_for_the_candidate(
    tiny_learner: LoraGRPOLearner,
) -> None:
    metrics = LearnerMetrics()
    measures = Measures(RatchetSettings(), metrics)
    measures.before_training(tiny_learner, "support", 4, [served_group(tiny_learner, 4, 0.2)])
    value = metrics.registry.get_sample_value
    drift = value("ratchet_learner_served_drift", {"alias": "support", "replica": "unknown"})
    assert drift == pytest.approx(0.2, 1e-3)
    assert value("ratchet_learner_served_drift_version", {"alias": "support"}) == 4
    measures._probe = ((1, 2, 3, 4),)  # the tiny model has no tokenizer
    meta = measures.for_candidate(tiny_learner, "support")
    assert meta["served_drift"]["version"] == 4
    taken = Fingerprint.from_dict(meta["fingerprint"])
    assert taken is not None and len(taken.logprobs[0]) == 3
    assert all(math.isfinite(x) for x in taken.logprobs[0])
    assert measures.for_candidate(tiny_learner, "support").get("served_drift") is None


def test_a_distance_of_nothing_or_of_non_finite_logprobs_is_never_within() -> None:
    assert not Distance(math.inf, math.inf, 0).within(1.0)
    assert not distance([[]], [[]]).within(1.0)
    assert not distance([[-1.0]], [[math.nan]]).within(1.0)
    with pytest.raises(ValueError):
        distance([[-1.0, -2.0]], [[-1.0]])

"""The GRPO learner (learner/trainer.py): packing, logprobs, a round, save and load.

Most tests use a tiny random Llama (fast on a loaded CPU); the folder vLLM will load is checked
with the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from learner.batch import Batch, pack_groups, shared_prompt_mask, token_logprobs
from learner.loss import group_advantages, grpo_loss
from learner.trainer import (
    OPTIMIZER_FILE,
    TRAINING_FIELDS,
    LoraGRPOLearner,
    StepProgress,
)
from ratchet.records import Sample, ScoredGroup
from ratchet.settings import LearnerSettings, LoraSettings, LossSettings
from ratchet.store import META_FILE, AdapterStore

LLAMA_PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
VOCAB = 96


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
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
    return folder


def train(**knobs: Any) -> LearnerSettings:
    """The learner settings with these knobs changed. In float32 unless a test names the
    precision: these tests check exact arithmetic, whatever ``auto`` comes to mean
    (tests/unit/learner/test_epochs.py checks bf16's parity)."""
    return LearnerSettings(**{"precision": "fp32", **knobs})


def lora(**knobs: Any) -> LoraSettings:
    return LoraSettings(**knobs)


def small_lora() -> LoraSettings:
    return lora(rank=4, alpha=8)


def group(
    prompt: list[int],
    completions: list[list[int]],
    rewards: list[float],
    logprobs: list[list[float]] | None = None,
    gid: str = "g",
) -> ScoredGroup:
    logprobs = logprobs or [[-1.0 - 0.1 * t for t in range(len(c))] for c in completions]
    samples = [
        Sample(message={"role": "assistant", "content": ""}, text="", token_ids=c, logprobs=lp)
        for c, lp in zip(completions, logprobs, strict=True)
    ]
    return ScoredGroup(
        group_id=gid,
        alias="support",
        version=0,
        response_model="smollm2-135m-instruct",
        prompt_messages=[{"role": "user", "content": "hi"}],
        prompt_token_ids=prompt,
        samples=samples,
        rewards=rewards,
        traffic_request_id="req",
    )


def random_groups(seed: int, n: int = 3, k: int = 3) -> list[ScoredGroup]:
    """Groups of varied prompt and completion lengths, with spread-out rewards."""
    gen = torch.Generator().manual_seed(seed)

    def ids(length: int) -> list[int]:
        return torch.randint(3, VOCAB, (length,), generator=gen).tolist()

    out = []
    for i in range(n):
        completions = [ids(int(torch.randint(2, 9, (1,), generator=gen))) for _ in range(k)]
        logprobs = [(-torch.rand(len(c), generator=gen) * 4 - 2.5).tolist() for c in completions]
        rewards = torch.rand(k, generator=gen).tolist()
        out.append(group(ids(3 + 2 * i), completions, rewards, logprobs, gid=f"{seed}-{i}"))
    return out


def lora_state(learner: LoraGRPOLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.params]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0.0, atol=atol)


# --- packing and logprobs ------------------------------------------------------------------------


def sample_logprobs(logprobs: torch.Tensor, batch: Batch, row: int, k: int) -> torch.Tensor:
    """The k-th sample's part of a row of per-token values."""
    return logprobs[row][(batch.segment_ids[row] == k + 1) & batch.completion_mask[row]]


def test_pack_groups_writes_each_prompt_once_then_every_completion() -> None:
    groups = [
        group(
            [5, 6, 7], [[10, 11], [12, 13, 14, 15]], [1.0, 0.0], [[-0.1, -0.2], [-1, -2, -3, -4]]
        ),
        group([8], [[20]], [0.5], [[-0.5]]),
    ]
    batch = pack_groups(groups, "group", pad_token_id=0)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 10, 11, 12, 13, 14, 15],
        [8, 20, 0, 0, 0, 0, 0, 0, 0],
    ]
    # each completion continues the prompt's positions, as in its own sequence
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6], [0, 1] + [0] * 7]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1] + [-1] * 7]
    # the first token of a completion is predicted by the prompt's last, the rest by their own
    assert batch.predicted_at.tolist() == [[0, 0, 0, 2, 3, 2, 5, 6, 7], [0, 0] + [0] * 7]
    assert batch.completion_mask.int().tolist() == [[0, 0, 0] + [1] * 6, [0, 1] + [0] * 7]
    torch.testing.assert_close(
        batch.behaviour_logprobs,
        torch.tensor([[0, 0, 0, -0.1, -0.2, -1, -2, -3, -4], [0, -0.5] + [0] * 7]),
    )
    assert batch.lengths.tolist() == [9, 2] and batch.samples.tolist() == [2, 1]
    # every token of a sample carries that sample's group-relative advantage
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1]), "group")
    torch.testing.assert_close(
        batch.advantages[0], torch.tensor([0.0] * 3 + [expected[0]] * 2 + [expected[1]] * 4)
    )
    assert batch.advantages[1].tolist() == [0.0] * 9  # a lone sample: zero advantage
    sub = batch.select(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[8, 20]]

    # A token without a usable behaviour logprob stays in the context but is not trained on.
    holed = pack_groups(
        [group([1, 2], [[3, 4, 5]], [1.0], [[-0.5, float("-inf"), float("nan")]])], "group"
    )
    assert holed.completion_mask.int().tolist() == [[0, 0, 1, 0, 0]]
    assert holed.behaviour_logprobs.tolist() == [[0.0, 0.0, -0.5, 0.0, 0.0]]

    with pytest.raises(ValueError, match="logprobs"):
        pack_groups([group([1], [[2, 3]], [1.0], [[-1.0]])], "group")
    with pytest.raises(ValueError, match="rewards"):
        pack_groups([group([1], [[2]], [1.0, 0.0])], "group")


def test_a_token_sees_the_prompt_and_its_own_completion_only() -> None:
    batch = pack_groups([group([5, 6], [[10, 11], [12]], [1.0, 0.0])], "group")
    mask = shared_prompt_mask(batch.segment_ids)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],  # prompt
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # first sample
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # second sample: not the first one's tokens
    ]


def test_token_logprobs_match_each_sample_in_its_own_sequence(tiny_model: Path) -> None:
    learner = LoraGRPOLearner(tiny_model, lora(), train(), device="cpu")
    groups = random_groups(1)
    batch = pack_groups(groups, "group")
    with torch.no_grad():
        got = token_logprobs(learner.model, batch)
        for r, g in enumerate(groups):
            p = len(g.prompt_token_ids)
            for k, sample in enumerate(g.samples):
                sequence = torch.tensor([g.prompt_token_ids + sample.token_ids])
                logp = learner.model(input_ids=sequence).logits[0].float().log_softmax(-1)
                expected = logp[p - 1 : -1].gather(1, sequence[0, p:, None]).squeeze(1)
                torch.testing.assert_close(
                    sample_logprobs(got, batch, r, k), expected, rtol=1e-5, atol=1e-5
                )
    assert (got[~batch.completion_mask] == 0).all()


def test_logprobs_of_own_samples_equal_those_recorded_when_sampling(tiny_model: Path) -> None:
    """On-policy: what generate() saw when it sampled is what the learner computes."""
    learner = LoraGRPOLearner(tiny_model, lora(), train(), device="cpu")
    model = learner.model.get_base_model()
    torch.manual_seed(3)
    prompt = torch.tensor([[4, 9, 17, 33]])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            top_k=0,
            max_new_tokens=8,
            min_new_tokens=8,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    completions = out.sequences[:, prompt.shape[1] :]
    recorded = torch.stack(out.logits, 1).float().log_softmax(-1)
    recorded = recorded.gather(2, completions[..., None]).squeeze(-1)
    g = group(prompt[0].tolist(), completions.tolist(), [1.0], recorded.tolist())
    batch = pack_groups([g], "group")
    with torch.no_grad():
        ours = token_logprobs(learner.model, batch)[batch.completion_mask]
    torch.testing.assert_close(ours, recorded.flatten(), rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_and_their_lora_grads_equal_the_whole_head_at_once(
    tiny_model: Path,
) -> None:
    """The LM head in checkpointed chunks (a ragged last one too) gives the values and LoRA
    gradients of projecting every completion position at once."""
    learner = LoraGRPOLearner(tiny_model, small_lora(), train(), device="cpu")
    with torch.no_grad():  # a fresh LoRA's B is 0, which would leave A without a gradient
        gen = torch.Generator().manual_seed(11)
        for param in learner.params:
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    batch = pack_groups(random_groups(4, n=3, k=4), "group")
    n = int(batch.completion_mask.sum())
    weights = torch.randn(batch.completion_mask.shape, generator=gen)

    def reference() -> torch.Tensor:
        """Every completion position through the model's own forward (full logits)."""
        mask = batch.completion_mask
        logits = learner.model(
            input_ids=batch.input_ids,
            attention_mask=shared_prompt_mask(batch.segment_ids),
            position_ids=batch.position_ids,
        ).logits
        picked = logits[mask.nonzero()[:, 0], batch.predicted_at[mask]].log_softmax(-1)
        picked = picked.gather(1, batch.input_ids[mask][:, None]).squeeze(1)
        return picked.new_zeros(mask.shape).masked_scatter(mask, picked)

    def values_and_grads(compute: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        learner.model.zero_grad(set_to_none=True)
        logprobs = compute()
        (logprobs * weights).sum().backward()
        grads = [p.grad.detach().clone() for p in learner.params if p.grad is not None]
        assert len(grads) == len(learner.params)
        return logprobs.detach(), grads

    learner.model.eval()  # no LoRA dropout: the passes must see the same function
    expected, expected_grads = values_and_grads(reference)
    assert n > 7 and n % 7  # several chunks, the last one shorter
    for chunk in (7, n, 10 * n):
        got, grads = values_and_grads(lambda c=chunk: token_logprobs(learner.model, batch, c))
        torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-5)
        assert_same(grads, expected_grads, atol=1e-5)
    with torch.no_grad():  # the reference (KL) pass: no checkpoint, same values
        torch.testing.assert_close(
            token_logprobs(learner.model, batch, 7), expected, atol=1e-5, rtol=0.0
        )


# --- training ------------------------------------------------------------------------------------


def test_every_trainer_knob_comes_from_the_learner_settings(tiny_model: Path) -> None:
    """The trainer takes the settings' own models (no copies with defaults of their own), and
    every knob set in them reaches it: weight decay and learning rate the optimizer, the LoRA
    shape peft, and all of them the adapter's metadata."""
    lora_knobs: dict[str, Any] = {
        "rank": 4,
        "alpha": 8,
        "dropout": 0.1,
        "target_modules": ["v_proj", "q_proj"],
    }
    loss_knobs: dict[str, Any] = {
        "scale_rewards": "none",
        "mode": "cispo",
        "epsilon_low": 0.1,
        "epsilon_high": 0.3,
        "cispo_max_weight": 2.0,
        "kl_beta": 0.05,
    }
    knobs: dict[str, Any] = {
        "learning_rate": 3e-3,
        "steps_per_round": 3,
        "micro_batch_tokens": 512,
        "max_grad_norm": 0.5,
        "weight_decay": 0.01,
        "seed": 5,
        "epochs_per_round": 3,
        "epoch_max_kl": 0.05,
        "epoch_max_clip_frac": 0.3,
        "precision": "bf16",
        "sharding": "fsdp",
    }
    defaults = LearnerSettings()
    assert all(getattr(defaults, knob) != value for knob, value in knobs.items())
    assert all(getattr(defaults.lora, knob) != value for knob, value in lora_knobs.items())
    assert all(getattr(defaults.loss, knob) != value for knob, value in loss_knobs.items())
    settings = LearnerSettings(lora=lora_knobs, loss=loss_knobs, **knobs)
    assert set(TRAINING_FIELDS) == set(knobs) | {"loss"}
    learner = LoraGRPOLearner(tiny_model, settings.lora, settings, "cpu")
    assert learner.train.loss.model_dump() == loss_knobs
    (params,) = learner.optimizer.param_groups
    assert (params["lr"], params["weight_decay"]) == (3e-3, 0.01)
    assert learner.target_modules == ("q_proj", "v_proj")
    assert learner.model.peft_config["default"].lora_dropout == 0.1


def test_a_round_learns_is_seeded_and_leaves_the_base_untouched(tiny_model: Path) -> None:
    settings = train(learning_rate=2e-2, steps_per_round=2, seed=7)
    learner = LoraGRPOLearner(tiny_model, small_lora(), settings, device="cpu")
    base_before = {
        n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n
    }
    # One prompt, a good and a bad answer, sampled on-policy by the current model.
    prompt, good, bad = [3, 14, 15, 9], [26, 53, 58, 9], [79, 32, 38, 46]
    draft = pack_groups([group(prompt, [good, bad], [1.0, 0.0])], "group")
    with torch.no_grad():
        on_policy = token_logprobs(learner.model, draft)
    logprobs = [sample_logprobs(on_policy, draft, 0, k).tolist() for k in range(2)]
    fixed = [group(prompt, [good, bad], [1.0, 0.0], logprobs)]
    batch = pack_groups(fixed, "group")

    def loss_and_gap() -> tuple[float, float]:
        with torch.no_grad():
            lp = token_logprobs(learner.model, batch)
            loss, _ = grpo_loss(
                lp,
                batch.behaviour_logprobs,
                batch.advantages,
                batch.completion_mask,
                settings.loss,
            )
        good_lp, bad_lp = (sample_logprobs(lp, batch, 0, k).sum() for k in range(2))
        return float(loss), float(good_lp - bad_lp)

    loss0, gap0 = loss_and_gap()
    stats = [learner.train_round(fixed) for _ in range(3)]
    loss1, gap1 = loss_and_gap()
    assert loss1 < loss0 - 1e-3
    assert gap1 > gap0 + 1e-2
    # One group and two steps: each step trains on the whole group (prompt once, 2 x 4 tokens).
    assert (stats[0].steps, stats[0].samples, stats[0].completion_tokens) == (2, 2, 16)
    assert stats[0].total_tokens == 2 * (4 + 8)
    # The first step is on-policy (ratio 1); the second has moved away, but not far.
    assert stats[0].mean_reward == 0.5 and stats[0].ratio_mean == pytest.approx(1.0, abs=0.1)
    assert stats[-1].round == 3 and learner.optimizer_steps == 6

    for name, param in learner.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), name

    again = LoraGRPOLearner(tiny_model, small_lora(), settings, device="cpu")
    for _ in range(3):
        again.train_round(fixed)
    assert_same(lora_state(again), lora_state(learner))

    # A group whose answers all scored the same carries no signal and is not trained on.
    before = lora_state(learner)
    flat = learner.train_round([group(prompt, [good, bad], [0.5, 0.5])])
    assert (flat.steps, flat.groups_skipped, flat.completion_tokens) == (0, 1, 0)
    assert_same(lora_state(learner), before)


def test_the_same_groups_in_another_order_train_the_same_adapter(tiny_model: Path) -> None:
    """The judge's timing orders a round's groups; the candidate must not depend on it."""
    groups = random_groups(5, n=6)
    states = []
    for order in (groups, groups[::-1], groups[3:] + groups[:3]):
        learner = LoraGRPOLearner(tiny_model, small_lora(), train(steps_per_round=3), "cpu")
        learner.train_round(order)
        states.append(lora_state(learner))
    assert_same(states[0], states[1])
    assert_same(states[0], states[2])


def test_micro_batching_does_not_change_the_step(tiny_model: Path) -> None:
    """The loss is the token mean over the whole step, whatever the micro-batches."""
    groups = random_groups(2)
    results = []
    for budget in (10_000, 1):  # one micro-batch per step, then one sequence per micro-batch
        # 1 is below what the settings accept (64): set on the trainer's own config to force it.
        settings = train(learning_rate=1e-2, steps_per_round=2).model_copy(
            update={"micro_batch_tokens": budget}
        )
        learner = LoraGRPOLearner(tiny_model, small_lora(), settings, "cpu")
        stats = learner.train_round(groups)
        results.append((lora_state(learner), stats))
    assert_same(results[0][0], results[1][0], atol=1e-5)
    assert results[0][1].loss == pytest.approx(results[1][1].loss, abs=1e-6)
    assert results[0][1].completion_tokens == results[1][1].completion_tokens


def test_kl_to_the_base_model_is_reported_and_starts_at_zero(tiny_model: Path) -> None:
    settings = train(learning_rate=1e-2, steps_per_round=1, loss=LossSettings(kl_beta=0.1))
    learner = LoraGRPOLearner(tiny_model, small_lora(), settings, "cpu")
    groups = random_groups(5)
    first = learner.train_round(groups)  # a fresh LoRA is the base model: no divergence yet
    assert first.kl == pytest.approx(0.0, abs=1e-7)
    second = learner.train_round(groups)
    assert second.kl is not None and second.kl > 0.0
    no_kl = LoraGRPOLearner(tiny_model, small_lora(), train(), "cpu")
    assert no_kl.train_round(groups).kl is None


def test_save_then_load_continues_exactly(tiny_model: Path, tmp_path: Path) -> None:
    shape = small_lora()
    settings = train(learning_rate=1e-2, steps_per_round=3, seed=1)
    first, second = random_groups(3), random_groups(4)
    store = AdapterStore(tmp_path / "adapters")

    straight = LoraGRPOLearner(tiny_model, shape, settings, "cpu")
    straight.train_round(first)
    straight.train_round(second)

    writer = LoraGRPOLearner(tiny_model, shape, settings, "cpu")
    writer.train_round(first)
    folder = writer.save_candidate(store, "support", 1, 0, {"note": "test"})

    reader = LoraGRPOLearner(tiny_model, shape, settings, "cpu")
    reader.train_round(second)  # state that the load must replace entirely
    reader.load_adapter(folder)
    assert_same(lora_state(reader), lora_state(writer))
    saved, loaded = writer.optimizer.state_dict(), reader.optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for key, state in saved["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(loaded["state"][key][name], value, rtol=0.0, atol=0.0)
    assert (reader.rounds, reader.optimizer_steps) == (1, 3)

    reader.train_round(second)
    assert_same(lora_state(reader), lora_state(straight), atol=1e-5)

    reader.load_adapter(None)  # v0: a fresh LoRA, whose B is zero, and a fresh optimizer
    assert all(
        float(p.detach().abs().max()) == 0
        for n, p in zip(reader.param_names, reader.params, strict=True)
        if "lora_B" in n
    )
    assert reader.optimizer.state_dict()["state"] == {} and reader.rounds == 0

    other_shape = LoraGRPOLearner(tiny_model, lora(rank=2, alpha=8), settings, "cpu")
    with pytest.raises(ValueError, match="rank"):
        other_shape.load_adapter(folder)


def test_saved_folder_is_a_vllm_loadable_adapter_of_the_real_model(
    tmp_path: Path, real_base_model: Path
) -> None:
    base = real_base_model
    learner = LoraGRPOLearner(base, lora(), train(steps_per_round=4), device="cpu")
    stats = learner.train_round([group([1, 504, 28, 9], [[30, 31, 2], [40, 2]], [1.0, 0.0])])
    assert stats.steps == 4 and stats.samples == 2  # fewer samples than steps: one a step
    store = AdapterStore(tmp_path / "adapters")
    folder = learner.save_candidate(store, "support", 3, 2, {"data": "test"})

    assert folder == tmp_path / "adapters" / "support@v3"
    files = {p.name for p in folder.iterdir()}
    assert files == {"adapter_config.json", "adapter_model.safetensors", OPTIMIZER_FILE, META_FILE}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert config["target_modules"] == LLAMA_PROJECTIONS
    defaults = LearnerSettings()
    assert config["r"] == defaults.lora.rank <= 32 and config["lora_alpha"] == defaults.lora.alpha
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert not config["use_dora"] and config["bias"] == "none" and not config["modules_to_save"]
    weights = load_file(folder / "adapter_model.safetensors")
    assert len(weights) == 30 * len(LLAMA_PROJECTIONS) * 2
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in weights)
    assert not any("lm_head" in k or "embed" in k for k in weights)
    meta = store.meta("support", 3)
    assert meta["parent_version"] == 2 and meta["data"] == "test"
    assert meta["optimizer_steps"] == 4 and meta["last_round"]["samples"] == 2
    assert meta["lora"]["target_modules"] == "all-linear"


def test_each_step_is_logged_and_reported_with_its_loss_reward_and_rate(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    groups = random_groups(6, n=3)
    learner = LoraGRPOLearner(tiny_model, small_lora(), train(steps_per_round=3), "cpu")
    steps: list[StepProgress] = []
    with caplog.at_level("INFO", logger="learner.trainer"):
        stats = learner.train_round(groups, steps.append)
    assert [(s.round, s.step, s.steps) for s in steps] == [(1, 1, 3), (1, 2, 3), (1, 3, 3)]
    # One group a step: its reward is that group's mean; the steps' losses make the round's.
    assert sorted(s.reward for s in steps) == pytest.approx(
        sorted(sum(g.rewards) / len(g.rewards) for g in groups)
    )
    tokens = [
        b.completion_tokens - a
        for a, b in zip([0] + [s.completion_tokens for s in steps[:-1]], steps, strict=True)
    ]
    assert steps[-1].completion_tokens == stats.completion_tokens
    weighted = sum(s.loss * n for s, n in zip(steps, tokens, strict=True)) / sum(tokens)
    assert weighted == pytest.approx(stats.loss, abs=1e-6)
    lines = [r.getMessage() for r in caplog.records if ": step " in r.getMessage()]
    assert lines == [s.line() for s in steps]
    assert re.fullmatch(
        r"round 1: step 3/3 loss -?\d+\.\d{4}, reward \d\.\d{3}, \d+\.\d tokens/s", lines[-1]
    )

"""More from each round: later passes over its groups (PPO epochs) that stop when the policy has
moved too far from the one that sampled, and bfloat16 arithmetic where the hardware has it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.batch import pack_groups, token_logprobs
from learner.loss import grpo_loss
from learner.trainer import (
    LoraGRPOLearner,
    epoch_stop,
    native_bf16_cpu,
    uses_bf16,
)
from ratchet.records import ScoredGroup
from ratchet.settings import LearnerSettings
from tests.unit.learner.test_trainer import (
    assert_same,
    group,
    lora_state,
    random_groups,
    sample_logprobs,
    small_lora,
    tiny_model,
    train,
)

__all__ = ["tiny_model"]  # the session fixture, shared with the trainer's tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, GOOD, BAD = [3, 14, 15, 9], [26, 53, 58, 9], [79, 32, 38, 46]


def on_policy_group(learner: LoraGRPOLearner) -> list[ScoredGroup]:
    """A good and a bad answer with the logprobs the learner's current policy gives them, as if
    it had sampled them."""
    draft = pack_groups([group(PROMPT, [GOOD, BAD], [1.0, 0.0])], "group")
    with torch.no_grad():
        lp = token_logprobs(learner.model, draft)
    logprobs = [sample_logprobs(lp, draft, 0, k).tolist() for k in range(2)]
    return [group(PROMPT, [GOOD, BAD], [1.0, 0.0], logprobs)]


def preference_gap(learner: LoraGRPOLearner, groups: list[ScoredGroup]) -> float:
    """log pi(good) - log pi(bad): what training on the group should raise."""
    batch = pack_groups(groups, "group")
    with torch.no_grad():
        lp = token_logprobs(learner.model, batch)
    good, bad = (float(sample_logprobs(lp, batch, 0, k).sum()) for k in range(2))
    return good - bad


def settings(**knobs: object) -> LearnerSettings:
    return train(**{"learning_rate": 2e-2, "steps_per_round": 2, "seed": 3, **knobs})


def test_epoch_stop_lets_the_first_epoch_run_and_stops_later_ones_on_kl_or_clipping() -> None:
    limits = settings(epoch_max_kl=0.02, epoch_max_clip_frac=0.2)
    assert epoch_stop(1, 5.0, 1.0, limits) is None  # the on-policy pass always runs whole
    assert epoch_stop(2, 0.01, 0.1, limits) is None
    assert epoch_stop(2, 0.03, 0.1, limits) == "kl 0.0300 > 0.02 in epoch 2"
    assert epoch_stop(3, 0.01, 0.25, limits) == "clip fraction 0.250 > 0.2 in epoch 3"


def test_approx_kl_is_zero_on_policy_and_k3_of_the_ratio_off_it() -> None:
    cfg = settings().loss
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.ones_like(logp, dtype=torch.bool)
    adv = torch.tensor([1.0])
    _, on = grpo_loss(logp, logp, adv, mask, cfg)
    assert on["approx_kl"].item() == 0.0
    _, off = grpo_loss(logp + 0.5, logp, adv, mask, cfg)  # ratio e^0.5 on every token
    assert off["approx_kl"].item() == pytest.approx(math.exp(0.5) - 1.0 - 0.5, rel=1e-6)


def test_later_epochs_train_the_same_groups_further(tiny_model: Path) -> None:
    one = LoraGRPOLearner(tiny_model, small_lora(), settings(), "cpu")
    groups = on_policy_group(one)
    before = preference_gap(one, groups)
    first = one.train_round(groups)
    assert (first.steps, first.epochs, first.stopped) == (2, 1, None)

    # No limit reached: three passes of two steps each, every step taken.
    three = LoraGRPOLearner(
        tiny_model,
        small_lora(),
        settings(epochs_per_round=3, epoch_max_kl=10.0, epoch_max_clip_frac=1.0),
        "cpu",
    )
    stats = three.train_round(groups)
    assert (stats.steps, stats.epochs, stats.stopped) == (6, 3, None)
    assert three.optimizer_steps == 6
    assert stats.approx_kl > first.approx_kl >= 0.0  # later passes run further from the sampler
    assert preference_gap(three, groups) > preference_gap(one, groups) > before


def test_a_later_epoch_past_the_kl_limit_ends_the_round_without_its_step(
    tiny_model: Path,
) -> None:
    one = LoraGRPOLearner(tiny_model, small_lora(), settings(), "cpu")
    groups = on_policy_group(one)
    one.train_round(groups)

    # The first pass moves the policy; the second's first step finds it past the limit.
    strict = settings(epochs_per_round=3, epoch_max_kl=1e-9)
    stopped = LoraGRPOLearner(tiny_model, small_lora(), strict, "cpu")
    stats = stopped.train_round(groups)
    assert (stats.steps, stats.epochs) == (2, 2)
    assert stats.stopped is not None and stats.stopped.startswith("kl ")
    assert stopped.optimizer_steps == 2
    assert_same(lora_state(stopped), lora_state(one))  # the step not taken changed nothing
    assert stats.completion_tokens == 2 * (len(GOOD) + len(BAD))  # nor counted

    # At this learning rate the second pass clips more than the default limit allows.
    clipping = LoraGRPOLearner(
        tiny_model, small_lora(), settings(epochs_per_round=3, epoch_max_kl=10.0), "cpu"
    )
    clipped = clipping.train_round(groups)
    assert (clipped.steps, clipped.epochs) == (2, 2)
    assert clipped.stopped is not None and clipped.stopped.startswith("clip fraction ")
    assert_same(lora_state(clipping), lora_state(one))


def test_bf16_on_a_cpu_keeps_float32_weights_and_the_round_s_loss(tiny_model: Path) -> None:
    """Loss parity: one round in float32 and in bfloat16 autocast from the same start."""
    groups = random_groups(4, n=4)
    results = {}
    for precision in ("fp32", "bf16"):
        learner = LoraGRPOLearner(
            tiny_model, small_lora(), settings(precision=precision, learning_rate=1e-2), "cpu"
        )
        start = lora_state(learner)
        stats = learner.train_round(groups)
        assert all(p.dtype == torch.float32 for p in learner.model.parameters())
        moved = zip(lora_state(learner), start, strict=True)
        delta = torch.cat([(after - before).flatten() for after, before in moved])
        results[precision] = (stats, delta, learner.autocast_dtype)
    (fp32, d32, cast32), (bf16, d16, cast16) = results["fp32"], results["bf16"]
    assert (cast32, cast16) == (None, torch.bfloat16)
    assert bf16.loss == pytest.approx(fp32.loss, abs=2e-2)
    assert bf16.ratio_mean == pytest.approx(fp32.ratio_mean, abs=2e-2)
    cosine = torch.nn.functional.cosine_similarity(d32, d16, dim=0)
    assert cosine > 0.95  # the update points the same way


def test_auto_precision_is_float32_on_a_cpu_whatever_it_computes(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert uses_bf16("bf16", cpu) and not uses_bf16("fp32", cpu)
    assert not uses_bf16("auto", cpu)  # AMX or not: the embedded vLLM samples in float32
    # Whether the CPU computes bfloat16 natively is still told (bench/learner_precision.py).
    with_bf16, without = tmp_path / "a", tmp_path / "b"
    with_bf16.write_text("flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    without.write_text("flags\t\t: fpu sse2 avx512f\n")
    assert native_bf16_cpu(with_bf16) and not native_bf16_cpu(without)
    assert not native_bf16_cpu(tmp_path / "missing")

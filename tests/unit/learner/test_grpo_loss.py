"""The GRPO loss (learner/loss.py): hand-derived cases, a per-token loop reference, and TRL's loss.

Everything runs in float64 so that equality can be asserted to 1e-12, gradients included
(torch.autograd.grad w.r.t. the current policy's logprobs).
"""

from __future__ import annotations

import ast
import functools
import math
import statistics
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from learner.loss import group_advantages, grpo_loss
from ratchet.settings import LossSettings

F64 = torch.float64


def close(actual: Tensor, expected: Tensor | float) -> None:
    expected = torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual.to(F64), expected, rtol=1e-12, atol=1e-12)


def grad_of(loss: Tensor, logprobs: Tensor) -> Tensor:
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def config_of(**knobs: Any) -> LossSettings:
    """The learner settings' loss section (learner.loss) with these knobs changed."""
    return LossSettings(**knobs)


def with_ratios(ratios: list[list[float]]) -> tuple[Tensor, Tensor]:
    """Current logprobs (with grad) and behaviour logprobs whose per-token ratios are `ratios`."""
    r = torch.tensor(ratios, dtype=F64)
    logprobs = torch.linspace(-2.5, -0.1, r.numel(), dtype=F64).reshape(r.shape)
    return logprobs.requires_grad_(), logprobs.detach() - torch.log(r)


# --- advantages ---------------------------------------------------------------------------------

# Two interleaved groups: id 5 holds rewards (1, 2, 3): mean 2, std 1; id 9 holds (0, 4, 8):
# mean 4, std sqrt((16 + 0 + 16) / 2) = 4. The batch (1, 0, 2, 4, 3, 8) has mean 3 and
# std sqrt((4 + 9 + 1 + 1 + 0 + 25) / 5) = sqrt(8).
REWARDS = torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0, 8.0], dtype=F64)
GROUPS = torch.tensor([5, 9, 5, 9, 5, 9])
CENTRED = [-1.0, -4.0, 0.0, 0.0, 1.0, 4.0]


@pytest.mark.parametrize(
    ("scale", "expected"),
    [
        ("none", CENTRED),
        ("group", [-1.0, -1.0, 0.0, 0.0, 1.0, 1.0]),
        ("batch", [c / math.sqrt(8.0) for c in CENTRED]),
    ],
)
def test_advantages_of_two_groups(scale: str, expected: list[float]) -> None:
    close(group_advantages(REWARDS, GROUPS, scale, eps=0.0), expected)  # type: ignore[arg-type]


def test_advantages_eps_one_group_and_degenerate_groups() -> None:
    close(group_advantages(REWARDS, GROUPS, "group", eps=1.0), [-0.5, -0.8, 0, 0, 0.5, 0.8])
    # No group ids: the batch is one group; mean 3, std sqrt(8).
    expected = [(r - 3.0) / math.sqrt(8.0) for r in REWARDS.tolist()]
    close(group_advantages(REWARDS, None, "group", eps=0.0), expected)
    # All-equal rewards and a group of one carry no signal: zero, not NaN.
    rewards = torch.tensor([2.0, 2.0, 2.0, 7.0], dtype=F64)
    for scale in ("group", "batch", "none"):
        close(group_advantages(rewards, torch.tensor([0, 0, 0, 1]), scale), [0.0] * 4)
    with pytest.raises(ValueError):
        group_advantages(REWARDS, GROUPS, "rank")  # type: ignore[arg-type]


# --- hand-derived loss cases ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ppo_clip", "cispo"])
def test_on_policy_gradient_is_minus_advantage_over_n(mode: str) -> None:
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -9.0]], dtype=F64).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([2.0, -1.0], dtype=F64)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages, mask, config_of(mode=mode))
    n = 5
    close(grad_of(loss, logprobs), [[-2 / n, -2 / n, -2 / n], [1 / n, 1 / n, 0.0]])
    if mode == "ppo_clip":  # -(1/N) sum r A with r = 1
        close(loss, -(3 * 2.0 + 2 * -1.0) / n)
    else:  # -(1/N) sum A logp
        close(loss, -(2.0 * (-0.5 - 1.0 - 2.0) - 1.0 * (-0.1 - 3.0)) / n)
    close(stats["ratio_mean"], 1.0)
    assert stats["num_tokens"].item() == n
    assert stats["clip_frac_low"].item() == stats["clip_frac_high"].item() == 0.0


def test_ppo_clip_zeroes_gradient_where_the_clip_is_active() -> None:
    # eps_low 0.2, eps_high 0.28: the trust region is [0.8, 1.28].
    logprobs, behaviour = with_ratios([[1.5, 1.1, 0.5], [0.5, 1.5, 1.0]])
    advantages = torch.tensor([2.0, -1.0], dtype=F64)
    loss, stats = grpo_loss(logprobs, behaviour, advantages, torch.ones(2, 3), config_of())
    n = 6
    # A > 0: r = 1.5 clipped at 1.28 (no grad); 1.1 inside; 0.5 below but min() keeps r A.
    # A < 0: r = 0.5 clipped at 0.8 (no grad); 1.5 above but min() keeps r A; 1.0 inside.
    objective = [1.28 * 2, 1.1 * 2, 0.5 * 2, 0.8 * -1, 1.5 * -1, 1.0 * -1]
    close(loss, -sum(objective) / n)
    close(grad_of(loss, logprobs), [[0.0, -1.1 * 2 / n, -0.5 * 2 / n], [0.0, 1.5 / n, 1.0 / n]])
    close(stats["clip_frac_high"], 1 / n)
    close(stats["clip_frac_low"], 1 / n)
    close(stats["ratio_max"], 1.5)
    close(stats["ratio_min"], 0.5)


def test_cispo_weight_is_clipped_and_carries_no_gradient() -> None:
    logprobs, behaviour = with_ratios([[0.1, 1.0, 3.0], [8.0, 0.5, 6.0]])
    advantages = torch.tensor([1.5, -0.5], dtype=F64)
    config = config_of(mode="cispo", cispo_max_weight=5.0)
    loss, stats = grpo_loss(logprobs, behaviour, advantages, torch.ones(2, 3), config)
    n = 6
    weights = torch.tensor([[0.1, 1.0, 3.0], [5.0, 0.5, 5.0]], dtype=F64)  # min(r, 5)
    weighted_advantage = weights * advantages[:, None]
    close(loss, -(weighted_advantage * logprobs.detach()).sum() / n)
    # Were the weight not stop-gradient, the gradient would be -w A (1 + logp) / N.
    close(grad_of(loss, logprobs), -weighted_advantage / n)
    close(stats["clip_frac_high"], 2 / n)
    close(stats["clip_frac_low"], 0.0)


@pytest.mark.parametrize("mode", ["ppo_clip", "cispo"])
def test_masked_tokens_contribute_nothing(mode: str) -> None:
    config = config_of(mode=mode, kl_beta=0.1)
    logprobs = torch.tensor([[-0.5, -1.0, -1.5], [-0.2, -0.7, -2.0]], dtype=F64)
    behaviour = logprobs + torch.tensor([[0.3, -0.4, 0.1], [-0.2, 0.5, 0.0]], dtype=F64)
    ref = logprobs + 0.25
    advantages = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    keep = mask.bool()

    def run(pad: Tensor, extra_rows: int = 0) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        rows = torch.full((extra_rows, 3), -1.0, dtype=F64)  # all-padding rows
        current = torch.cat([torch.where(keep, logprobs, pad), rows]).requires_grad_()
        loss, stats = grpo_loss(
            current,
            torch.cat([torch.where(keep, behaviour, pad.flip(1)), rows]),
            torch.cat([advantages, torch.full((extra_rows,), 3.0, dtype=F64)]),
            torch.cat([mask, torch.zeros(extra_rows, 3, dtype=mask.dtype)]),
            config,
            ref_logprobs=torch.cat([torch.where(keep, ref, pad), rows]),
        )
        return loss, grad_of(loss, current), stats

    # Padding may hold anything, -inf and NaN included.
    clean_loss, clean_grad, clean_stats = run(torch.zeros(2, 3, dtype=F64))
    garbage = torch.tensor([[0, 0, -math.inf], [0, math.nan, 1e4]], dtype=F64)
    loss, grad, stats = run(garbage, extra_rows=2)
    close(loss, clean_loss)
    close(grad[:2], clean_grad)
    assert (grad[:2][~keep] == 0).all() and (grad[2:] == 0).all()
    assert stats["num_tokens"].item() == clean_stats["num_tokens"].item() == 3
    for name in clean_stats:
        close(stats[name], clean_stats[name])
    # With no completion tokens at all the loss is 0 and so is its gradient.
    empty = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(empty, empty.detach(), advantages, torch.zeros(2, 3), config, empty)
    close(loss, 0.0)
    close(grad_of(loss, empty), torch.zeros(2, 3))
    assert math.isnan(stats["ratio_max"].item())


def test_kl_term_is_the_k3_estimator() -> None:
    beta = 0.1
    config = config_of(kl_beta=beta)
    logprobs = torch.full((1, 3), math.log(0.5), dtype=F64, requires_grad=True)
    # d = log pi_ref - log pi_theta = 0, ln 2, -ln 2; zero advantage leaves only the KL term.
    ref = torch.log(torch.tensor([[0.5, 1.0, 0.25]], dtype=F64))
    loss, stats = grpo_loss(
        logprobs, logprobs.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 3), config, ref
    )
    ln2 = math.log(2.0)
    k3 = [0.0, 2.0 - ln2 - 1.0, 0.5 + ln2 - 1.0]  # e^d - d - 1
    close(stats["kl"], sum(k3) / 3)
    close(loss, beta * sum(k3) / 3)
    close(stats["policy_loss"], 0.0)
    close(grad_of(loss, logprobs), [[beta * (1 - 1.0) / 3, beta * (1 - 2.0) / 3, beta * 0.5 / 3]])
    # Off by default: no reference logprobs needed, no kl stat.
    _, stats = grpo_loss(logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 3), config_of())
    assert "kl" not in stats
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 3), config)


# --- a fixed random batch against a per-token loop ------------------------------------------------


def random_batch() -> SimpleNamespace:
    """Two groups of three completions, lengths 7, 3, 5, 1, 6, 4, with ratios in about e^(+-1)."""
    gen = torch.Generator().manual_seed(1234)
    b, t = 6, 7
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    logprobs = -3.0 * torch.rand(b, t, generator=gen, dtype=F64) - 0.05
    behaviour = logprobs + 0.4 * torch.randn(b, t, generator=gen, dtype=F64)
    ref = logprobs + 0.3 * torch.randn(b, t, generator=gen, dtype=F64)
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.5, 1.0, 0.0], dtype=F64)
    return SimpleNamespace(
        logprobs=logprobs,
        behaviour=behaviour,
        ref=ref,
        mask=mask,
        rewards=rewards,
        contiguous_groups=torch.tensor([0, 0, 0, 1, 1, 1]),
        shuffled_groups=torch.tensor([4, 2, 2, 4, 2, 4]),
        group_size=3,
    )


def loop_advantages(rewards: list[float], groups: list[int], scale: str, eps: float) -> list[float]:
    members: dict[int, list[float]] = defaultdict(list)
    for reward, group in zip(rewards, groups, strict=True):
        members[group].append(reward)
    advantages = []
    for reward, group in zip(rewards, groups, strict=True):
        centred = reward - statistics.mean(members[group])
        if scale == "group":
            centred /= statistics.stdev(members[group]) + eps
        elif scale == "batch":
            centred /= statistics.stdev(rewards) + eps
        advantages.append(centred)
    return advantages


def loop_loss(
    logprobs: Tensor,
    behaviour: Tensor,
    advantages: list[float],
    mask: Tensor,
    config: LossSettings,
    ref: Tensor,
) -> Tensor:
    """The loss token by token, with the clip written as its piecewise cases."""
    terms = []
    for i in range(logprobs.shape[0]):
        a = advantages[i]
        for t in range(logprobs.shape[1]):
            if mask[i, t] == 0:
                continue
            lp = logprobs[i, t]
            ratio = torch.exp(lp - behaviour[i, t])
            r = ratio.item()
            if config.mode == "ppo_clip":
                if a >= 0 and r > 1 + config.epsilon_high:
                    objective = torch.tensor((1 + config.epsilon_high) * a, dtype=F64)
                elif a < 0 and r < 1 - config.epsilon_low:
                    objective = torch.tensor((1 - config.epsilon_low) * a, dtype=F64)
                else:
                    objective = ratio * a
            else:
                objective = min(r, config.cispo_max_weight) * a * lp
            term = -objective
            if config.kl_beta:
                d = ref[i, t] - lp
                term = term + config.kl_beta * (torch.exp(d) - d - 1)
            terms.append(term)
    return torch.stack(terms).sum() / len(terms)


@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("mode", ["ppo_clip", "cispo"])
def test_matches_a_per_token_loop(mode: str, scale: str, kl_beta: float) -> None:
    batch = random_batch()
    # A low CISPO cap, so that some weights of this batch are capped.
    config = config_of(scale_rewards=scale, mode=mode, cispo_max_weight=1.5, kl_beta=kl_beta)
    advantages = group_advantages(batch.rewards, batch.shuffled_groups, config.scale_rewards)
    expected_advantages = loop_advantages(
        batch.rewards.tolist(), batch.shuffled_groups.tolist(), scale, eps=1e-6
    )
    close(advantages, expected_advantages)

    logprobs = batch.logprobs.clone().requires_grad_()
    loss, stats = grpo_loss(logprobs, batch.behaviour, advantages, batch.mask, config, batch.ref)
    expected = loop_loss(
        logprobs, batch.behaviour, expected_advantages, batch.mask, config, batch.ref
    )
    close(loss, expected)
    close(grad_of(loss, logprobs), grad_of(expected, logprobs))
    # The batch exercises the clips.
    assert stats["clip_frac_high"] > 0
    assert (stats["clip_frac_low"] > 0) == (mode == "ppo_clip")


@pytest.mark.parametrize("mode", ["ppo_clip", "cispo"])
def test_per_token_advantages_are_the_same_loss(mode: str) -> None:
    """The learner packs a group's samples into one row, each token carrying its own sample's
    advantage: (B, T) advantages must give exactly the (B,) loss and gradient."""
    batch = random_batch()
    config = config_of(mode=mode, cispo_max_weight=1.5, kl_beta=0.05)
    advantages = group_advantages(batch.rewards, batch.contiguous_groups, config.scale_rewards)
    per_token = advantages[:, None] * batch.mask  # 0 off the completions, as the packer writes
    results = []
    for adv in (advantages, per_token):
        logprobs = batch.logprobs.clone().requires_grad_()
        loss, stats = grpo_loss(logprobs, batch.behaviour, adv, batch.mask, config, batch.ref)
        results.append((loss, grad_of(loss, logprobs), stats))
    close(results[0][0], results[1][0])
    close(results[0][1], results[1][1])
    assert results[0][2]["clip_frac_high"] == results[1][2]["clip_frac_high"]
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(batch.logprobs, batch.behaviour, per_token[:, :3], batch.mask, config, batch.ref)


# --- TRL -----------------------------------------------------------------------------------------
#
# TRL's loss is a method, GRPOTrainer._compute_loss(self, model, inputs), and importing its module
# needs pandas and datasets (absent here; trl is installed with --no-deps). So the test compiles
# TRL's own source of that method (and of the helpers it calls) from the installed package, and
# runs it with a stub trainer that hands it our logprobs: TRL's code, none of its trainer.


@functools.cache
def trl_functions() -> dict[str, object]:
    import trl

    trainer_dir = Path(trl.__file__).parent / "trainer"
    namespace: dict[str, object] = {"torch": torch}
    for file, cls, names in (
        ("utils.py", None, {"nanmin", "nanmax", "nanstd"}),
        ("grpo_trainer.py", "GRPOTrainer", {"_compute_loss"}),
    ):
        path = trainer_dir / file
        body = ast.parse(path.read_text()).body
        if cls is not None:
            body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
        functions = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {f.name for f in functions} == names, f"TRL {trl.__version__} moved {names}"
        for function in functions:
            function.decorator_list = []  # profiling only
        module = ast.Module(body=functions, type_ignores=[])
        exec(compile(module, str(path), "exec"), namespace)
    return namespace


class StubGRPOTrainer:
    """What _compute_loss reads of a GRPOTrainer: one process, no accumulation, no vLLM."""

    def __init__(self, loss_type: str, epsilon: float, epsilon_high: float, beta: float) -> None:
        self.loss_type, self.beta = loss_type, beta
        self.epsilon_low, self.epsilon_high = epsilon, epsilon_high
        self.importance_sampling_level = "token"
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self._entropy_bonus_enabled = False
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=1
        )
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(
            num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x
        )
        self._metrics: dict[str, defaultdict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }
        self.logprobs: Tensor | None = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, keep, **_):
        assert self.logprobs is not None and keep == self.logprobs.shape[1]
        return self.logprobs, torch.zeros_like(self.logprobs), None


# (our mode, TRL loss_type): ppo_clip is TRL's "dapo" (token mean over the accumulated batch) and
# "bnpo" (over the local batch), the same thing with one process and no accumulation.
TRL_CASES = [("ppo_clip", "dapo"), ("ppo_clip", "bnpo"), ("cispo", "cispo")]


@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
@pytest.mark.parametrize(("mode", "loss_type"), TRL_CASES)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_trls_grpo_loss(scale: str, mode: str, loss_type: str, kl_beta: float) -> None:
    batch = random_batch()
    config = config_of(scale_rewards=scale, mode=mode, cispo_max_weight=1.5, kl_beta=kl_beta)
    trl = trl_functions()

    # TRL's advantages are inline in _generate_and_score_completions ("sum_then_normalize", one
    # reward function, groups of num_generations consecutive samples, eps 1e-4); restated here
    # around TRL's nanstd.
    rewards, g = batch.rewards, batch.group_size
    group_mean = rewards.view(-1, g).mean(dim=1).repeat_interleave(g)
    if scale == "batch":
        std = trl["nanstd"](rewards).expand_as(rewards)
    else:
        std = trl["nanstd"](rewards.view(-1, g), dim=1).repeat_interleave(g)
    trl_advantages = rewards - group_mean
    if scale != "none":
        trl_advantages = trl_advantages / (std + 1e-4)
    advantages = group_advantages(rewards, batch.contiguous_groups, config.scale_rewards, eps=1e-4)
    # Not to 1e-12: TRL's nanstd computes Bessel's n / (n - 1) in float32 (int / int), so its
    # batch std (n = 6) is off by ~2e-8 relative. The losses below then both get our advantages.
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-7, atol=1e-7)

    # TRL's epsilon (its epsilon_low) and epsilon_high; for "cispo" its epsilon_high is the cap.
    high = config.cispo_max_weight if mode == "cispo" else config.epsilon_high
    stub = StubGRPOTrainer(loss_type, config.epsilon_low, high, kl_beta)
    trl_logprobs = batch.logprobs.clone().requires_grad_()
    stub.logprobs = trl_logprobs
    b, t = batch.logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": batch.mask,
        "advantages": advantages,
        "old_per_token_logps": batch.behaviour,
        "ref_per_token_logps": batch.ref,
        "num_items_in_batch": batch.mask.sum(),
    }
    trl_loss = trl["_compute_loss"](stub, None, inputs)

    logprobs = batch.logprobs.clone().requires_grad_()
    loss, stats = grpo_loss(logprobs, batch.behaviour, advantages, batch.mask, config, batch.ref)
    close(loss, trl_loss)
    close(grad_of(loss, logprobs), grad_of(trl_loss, trl_logprobs))
    metrics = stub._metrics["train"]
    if mode == "ppo_clip":
        close(stats["clip_frac_low"], metrics["clip_ratio/low_mean"][0])
        close(stats["clip_frac_high"], metrics["clip_ratio/high_mean"][0])
    if kl_beta:
        close(stats["kl"], metrics["kl"][0])

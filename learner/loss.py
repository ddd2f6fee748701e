"""The GRPO loss: group-relative advantages and a clipped token-level policy-gradient objective.

Pure tensor functions, no model and no trainer. The learner scores the sampled completions under
the current policy (the LoRA adapter on) and, when ``kl_beta > 0``, under the base model (adapter
off), and passes those per-token logprobs here together with the ones vLLM logged when it sampled
them (the behaviour policy).
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from ratchet.settings import LossSettings, ScaleRewards


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None,
    scale: ScaleRewards,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of one reward per sampled completion.

    Samples with the same ``group_ids`` value (any integers, in any order) answered the same
    prompt; ``group_ids=None`` makes the whole batch one group. With g(i) the group of sample i,
    n_g its size and R the rewards, shape (B,)::

        mean_g = (1 / n_g) sum_{j in g} R_j
        std(S) = sqrt( sum_{j in S} (R_j - mean_S)^2 / (|S| - 1) )   (Bessel, as torch.std and TRL;
                                                                    0 for a single sample)
        "group":  A_i = (R_i - mean_g(i)) / (std(g(i)) + eps)
        "batch":  A_i = (R_i - mean_g(i)) / (std(batch) + eps)       (std of the raw rewards)
        "none":   A_i =  R_i - mean_g(i)

    A group whose rewards are all equal gets zero advantages (no learning signal), whatever the
    scaling. Returns (B,) in the rewards' dtype promoted to at least float32, without grad.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if scale not in get_args(ScaleRewards):
        raise ValueError(f"scale must be one of {get_args(ScaleRewards)}")
    values = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if values.numel() == 0:
        return values.clone()
    if group_ids is None:
        inverse = torch.zeros(values.shape, dtype=torch.long, device=values.device)
    else:
        if group_ids.shape != rewards.shape:
            raise ValueError("group_ids must have the shape of rewards")
        _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = values.new_zeros(n_groups).index_add_(0, inverse, torch.ones_like(values))
    means = values.new_zeros(n_groups).index_add_(0, inverse, values) / counts
    centred = values - means[inverse]
    if scale == "none":
        return centred
    if scale == "group":
        sum_sq = values.new_zeros(n_groups).index_add_(0, inverse, centred**2)
        std = _bessel_std(sum_sq, counts)[inverse]
    else:
        sum_sq = ((values - values.mean()) ** 2).sum()
        std = _bessel_std(sum_sq, values.new_tensor(float(values.numel())))
    return centred / (std + eps)


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossSettings,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of a batch of B sampled completions padded to T tokens.

    Inputs: logprobs (B, T), log pi_theta(y_it | x_i, y_i<t) of the sampled tokens under the
    current policy, with grad; behaviour_logprobs (B, T), log pi_beh of the same tokens as vLLM
    logged them when it sampled (no grad); advantages (B,), one per completion (see
    :func:`group_advantages`), or (B, T), one per token (the learner packs a group's samples
    into one row, so each token carries its own sample's A_i); mask (B, T), 1 on completion
    tokens, 0 on padding (whatever the logprobs hold there, even -inf, is ignored); ref_logprobs
    (B, T), log pi_ref under the base model, needed only when ``config.kl_beta > 0``.

    With m_it the mask, N = sum_it m_it the number of completion tokens in the batch, A_i the
    advantage and sg() stop-gradient::

        r_it = exp(log pi_theta(y_it) - log pi_beh(y_it))             per-token importance ratio

        ppo_clip:  l_it = -min( r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i )
        cispo:     l_it = -sg( min(r_it, w_max) ) A_i log pi_theta(y_it)

        k3 KL to the base model (an unbiased, non-negative estimate of KL(pi_theta || pi_ref)
        on tokens sampled from pi_theta), with d_it = log pi_ref(y_it) - log pi_theta(y_it):
                   k_it = exp(d_it) - d_it - 1

        L = (1 / N) sum_i sum_t m_it ( l_it + beta k_it )

    The mean is token-level over the whole batch (DAPO; TRL's "dapo"/"bnpo"): every completion
    token weighs 1/N whatever its completion's length, where GRPO's original per-sequence mean
    (1/B) sum_i (1/|y_i|) sum_t would give a short completion's tokens more weight. N counts this
    call's tokens only; with no completion tokens the loss is 0.

    The gradient w.r.t. log pi_theta(y_it) of a completion token (d r / d log pi_theta = r):

        ppo_clip:  -r_it A_i / N, and 0 where the clip is active, i.e. r_it > 1 + eps_high with
                   A_i > 0, or r_it < 1 - eps_low with A_i < 0 (outside the trust region in the
                   direction the advantage pushes);
        cispo:     -min(r_it, w_max) A_i / N, never 0 unless A_i is (the weight is clipped, the
                   token is not dropped);
        KL:        + beta (1 - exp(d_it)) / N.

    On-policy (r = 1) both modes give -A_i / N: the plain policy gradient.

    Returns the scalar loss and detached stats: ``num_tokens`` (N), ``policy_loss`` (L without
    the KL), ``ratio_mean``/``ratio_min``/``ratio_max`` over completion tokens, ``clip_frac_low``
    and ``clip_frac_high`` (fraction of completion tokens whose ppo_clip gradient the low/high
    clip zeroed; for cispo: 0, and the fraction whose weight was capped at w_max),
    ``approx_kl`` (how far the policy has moved from the one that sampled: the token mean of the
    k3 estimate of KL(pi_beh || pi_theta) on tokens sampled from pi_beh, (r_it - 1) - log r_it,
    which is what the learner's later PPO epochs stop on), and ``kl`` (the mean k3 estimate to
    the base model, only when ``kl_beta > 0``).
    """
    _check_shapes(logprobs, behaviour_logprobs, advantages, mask, ref_logprobs, config)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    valid = mask.bool()
    logp = torch.where(valid, logprobs.to(dtype), 0.0)
    behaviour = torch.where(valid, behaviour_logprobs.detach().to(dtype), 0.0)
    adv = advantages.detach().to(dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = logp - behaviour
    ratio = torch.exp(log_ratio)
    per_token = _per_token_policy_loss(ratio, adv, logp, config)
    num_tokens = valid.sum()
    denominator = num_tokens.clamp(min=1).to(dtype)
    policy_loss = torch.where(valid, per_token, 0.0).sum() / denominator
    loss, kl = policy_loss, None
    if config.kl_beta > 0.0 and ref_logprobs is not None:  # _check_shapes: not None if beta > 0
        ref = torch.where(valid, ref_logprobs.detach().to(dtype), 0.0)
        kl = _k3(ref - logp)
        loss = policy_loss + config.kl_beta * torch.where(valid, kl, 0.0).sum() / denominator

    stats = _stats(ratio, log_ratio, adv, valid, num_tokens, policy_loss, kl, config)
    return loss, stats


def _per_token_policy_loss(
    ratio: Tensor, adv: Tensor, logp: Tensor, config: LossSettings
) -> Tensor:
    """l_it of :func:`grpo_loss`, unmasked: the clipped surrogate (``ppo_clip``) or the
    importance-weighted policy gradient with its weight capped and detached (``cispo``)."""
    if config.mode == "ppo_clip":
        clipped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
        return -torch.minimum(ratio * adv, clipped * adv)
    weight = ratio.clamp(max=config.cispo_max_weight).detach()
    return -weight * adv * logp


def _bessel_std(sum_sq: Tensor, count: Tensor) -> Tensor:
    """sqrt(sum_sq / (count - 1)), and 0 for a single sample (whose sum_sq is 0)."""
    return torch.sqrt(sum_sq / (count - 1).clamp(min=1))


def _k3(log_p_over_q: Tensor) -> Tensor:
    """Schulman's k3 estimator per sampled token, e^d - d - 1 >= 0, with d = log(p / q) on
    tokens sampled from q: of KL(q || p)."""
    return torch.exp(log_p_over_q) - log_p_over_q - 1.0


def _check_shapes(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    config: LossSettings,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    if behaviour_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError("behaviour_logprobs and mask must have the shape of logprobs (B, T)")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be (B,) = {tuple(logprobs.shape[:1])} or (B, T) = "
            f"{tuple(logprobs.shape)}"
        )
    if config.kl_beta > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs ref_logprobs")
        if ref_logprobs.shape != logprobs.shape:
            raise ValueError("ref_logprobs must have the shape of logprobs (B, T)")


@torch.no_grad()
def _stats(
    ratio: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    valid: Tensor,
    num_tokens: Tensor,
    policy_loss: Tensor,
    kl: Tensor | None,
    config: LossSettings,
) -> dict[str, Tensor]:
    denominator = num_tokens.clamp(min=1).to(ratio.dtype)

    def token_mean(x: Tensor) -> Tensor:
        return torch.where(valid, x.to(ratio.dtype), 0.0).sum() / denominator

    if config.mode == "ppo_clip":
        low = (ratio < 1.0 - config.epsilon_low) & (adv < 0)
        high = (ratio > 1.0 + config.epsilon_high) & (adv > 0)
    else:
        low = torch.zeros_like(valid)
        high = ratio > config.cispo_max_weight
    ratios = ratio[valid]
    nan = ratio.new_tensor(float("nan"))
    stats = {
        "num_tokens": num_tokens.detach(),
        "policy_loss": policy_loss.detach(),
        "ratio_mean": token_mean(ratio),
        "ratio_min": ratios.min() if ratios.numel() else nan,
        "ratio_max": ratios.max() if ratios.numel() else nan,
        "clip_frac_low": token_mean(low),
        "clip_frac_high": token_mean(high),
        "approx_kl": token_mean(_k3(log_ratio)),
    }
    if kl is not None:
        stats["kl"] = token_mean(kl)
    return stats

"""The ``learner`` section: when rounds run, how they train, and when learning pauses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from ratchet.settings.base import (
    _Section,
)
from ratchet.settings.served_check import ServedCheckSettings

ScaleRewards = Literal["group", "batch", "none"]
LossMode = Literal["ppo_clip", "cispo"]

# The flat keys of earlier releases and where each one now lives: an old ratchet.yaml is told
# the fix instead of "extra inputs are not permitted".
MOVED_KEYS = {
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "scale_rewards": "loss.scale_rewards",
    "loss_mode": "loss.mode",
    "epsilon_low": "loss.epsilon_low",
    "epsilon_high": "loss.epsilon_high",
    "cispo_max_weight": "loss.cispo_max_weight",
    "kl_beta": "loss.kl_beta",
}


class LoraSettings(_Section):
    """`learner.lora`: the adapter's shape. vLLM must be started with ``--max-lora-rank`` at
    least ``rank``."""

    # The embedded vLLM allows rank <= 32.
    rank: int = Field(default=8, ge=1, le=32, description="LoRA rank r of every wrapped module.")
    alpha: int = Field(default=16, ge=1, description="LoRA alpha; the update is scaled by alpha/r.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch while training."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear",
        description=(
            'Module names LoRA wraps; "all-linear": every linear projection of the transformer '
            "blocks (for Llama q/k/v/o_proj, gate/up/down_proj), never the LM head."
        ),
    )


class LossSettings(_Section):
    """`learner.loss`: the GRPO objective (learner/loss.py) and its advantage scaling."""

    scale_rewards: ScaleRewards = Field(
        default="group",
        description=(
            "What the group-centred rewards are divided by: the std of the sample's group "
            '("group", GRPO), of all rewards in the batch ("batch", Lite PPO), or nothing '
            '("none", Dr. GRPO).'
        ),
    )
    # Dr. GRPO recommends "none" (std scaling biases toward too easy and too hard prompts); "group"
    # is GRPO's own and what the defaults were chosen with.
    mode: LossMode = Field(
        default="ppo_clip",
        description=(
            "\"ppo_clip\": PPO's clipped surrogate with separate low and high epsilons (DAPO's "
            'clip-higher); "cispo": MiniMax-M1\'s clipped, stop-gradient importance weight times '
            "the logprob, which keeps a gradient on every token."
        ),
    )
    epsilon_low: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="ppo_clip: the ratio is clipped below at 1 - epsilon_low.",
    )
    # Above epsilon_low: DAPO's clip-higher.
    epsilon_high: float = Field(
        default=0.28,
        ge=0.0,
        description="ppo_clip: the ratio is clipped above at 1 + epsilon_high.",
    )
    # 1 + eps^IS_high in the MiniMax-M1 paper (which sets no lower bound, and neither do we),
    # eps_max in ScaleRL, TRL's epsilon_high when its loss_type="cispo".
    cispo_max_weight: float = Field(
        default=5.0, gt=0, description="cispo: the cap on the importance weight."
    )
    kl_beta: float = Field(
        default=0.0,
        ge=0.0,
        description=(
            "Weight of the k3 estimate of the KL to the base model; 0 turns it off (and then no "
            "reference logprobs are computed)."
        ),
    )


class LearnerSettings(_Section):
    """`ratchet learner`: when rounds run, how they train, and when learning pauses itself."""

    consumer_group: str = Field(
        default="ratchet-learner",
        description="Kafka consumer group of the learner replicas.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address of the learner's /metrics.",
    )
    metrics_port: int = Field(
        default=8403,
        ge=1,
        le=65535,
        description="Port of the learner's /metrics.",
    )
    batch_groups: int = Field(
        default=32,
        ge=1,
        description=(
            "A round runs when this many usable groups wait for an alias... The round's size and "
            "steps and the learning rate were chosen on every bundled task with "
            "bench/demo_learning.py: 8 steps of 4 groups at 2e-3 lifted them most without "
            "collapsing any (docs/results/settings-measurements.md)."
        ),
    )
    interval_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "...or when at least min_groups wait and this long has passed since the oldest of "
            "them arrived and since the alias's last round (or gate) ended. A judge pauses while "
            "the learner trains and gates, so the few groups in flight when a round began had "
            "waited through it: counted from their arrival alone, they started the next round on "
            "their own as soon as it ended (docs/results/settings-measurements.md)."
        ),
    )
    min_groups: int = Field(
        default=4,
        ge=1,
        description="The fewest groups a round runs on once interval_s has passed.",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description=(
            "Groups sampled by a version more than this many promotions behind the live one are "
            "dropped."
        ),
    )
    max_waiting_groups: int = Field(
        default=256,
        ge=1,
        description=(
            "Groups held in memory per alias while a round or a canary is under way; older ones "
            "drop."
        ),
    )
    steps_per_round: int = Field(
        default=8,
        ge=1,
        description="Optimizer steps per round (per epoch).",
    )
    learning_rate: float = Field(
        default=2e-3,
        gt=0,
        description="AdamW's learning rate for the LoRA weights.",
    )
    epochs_per_round: int = Field(
        default=1,
        ge=1,
        le=16,
        description=(
            "Passes over a round's groups (PPO epochs), each of steps_per_round steps. From the "
            "second on, a step whose policy has moved past epoch_max_kl (the token-mean KL from "
            "the sampling policy, k3) or clips more than epoch_max_clip_frac of its tokens is not "
            "taken and the round ends there: the importance ratio corrects a small move, not a "
            "large one."
        ),
    )
    epoch_max_kl: float = Field(
        default=0.02,
        gt=0,
        description=(
            "From the second epoch on: the largest KL from the sampling policy a step may "
            "have moved to."
        ),
    )
    epoch_max_clip_frac: float = Field(
        default=0.2,
        gt=0,
        le=1.0,
        description=(
            "From the second epoch on: the largest share of clipped tokens a step may have."
        ),
    )
    max_candidate_rounds: int = Field(
        default=4,
        ge=1,
        description=(
            "A candidate the gate rejected while it won more than the threshold of its pairs is "
            "where the next round starts (ratchet/carry.py), up to this many rounds of training "
            "beyond the live version; 1: every round starts from the live version. A round of a "
            "few dozen groups gains too little for any gate to prove, and the judge samples a "
            "carried round's groups from the candidate itself, so rounds build on one another as "
            "on-policy GRPO does (docs/results/settings-measurements.md). Beyond four, a lineage "
            "that never proves itself starts again from the live version."
        ),
    )
    trained_groups_max: int = Field(
        default=200_000,
        ge=1000,
        description=(
            "Most group ids an alias keeps as trained (ratchet:learner:<alias>:trained, about "
            "120 bytes each in Redis), so that a group read again from Kafka is not trained "
            "twice; past it the oldest go (as do those older than 30 days). Keep it above the "
            "groups ratchet.groups retains: a group re-read from past the bound trains again."
        ),
    )
    train_during_canary: bool = Field(
        default=True,
        description=(
            "While a candidate's canary waits for users' ratings, the next round trains on from "
            "it (the judge samples from it) and its candidate is gated once the canary ends; "
            "rolled back, that round is lost. Off: no round runs during a canary."
        ),
    )
    micro_batch_tokens: int = Field(
        default=1024,
        ge=64,
        description=(
            "Padded tokens per forward and backward; a longer row (one group) is a micro-batch "
            "alone. Small batches lose nothing on a CPU and peak far lower "
            "(docs/results/settings-measurements.md); a GPU may want more."
        ),
    )
    max_grad_norm: float = Field(
        default=1.0,
        ge=0,
        description="0 turns clipping off.",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0.0,
        description=(
            "AdamW's decoupled weight decay: pulls the LoRA weights toward zero, i.e. toward the "
            "base model. Off by default, as in TRL's GRPOConfig."
        ),
    )
    lora: LoraSettings = LoraSettings()
    loss: LossSettings = LossSettings()
    served_check: ServedCheckSettings = ServedCheckSettings()
    seed: int = Field(
        default=0,
        description="Seed of the LoRA initialisation and of each round's order of groups.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description='Where the learner trains: "auto" is cuda when a GPU is present, else cpu.',
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description=(
            'The forward and backward\'s arithmetic: "bf16" autocasts them to bfloat16 (weights, '
            'LoRA and AdamW stay float32 on a CPU); "auto" is bf16 on a GPU, float32 on a CPU: '
            "there the embedded vLLM samples in float32, and a bf16 learner's mismatched logprobs "
            "cost more learning than its 1.2-1.3x speed on AMX buys (learner/trainer.py "
            "uses_bf16)."
        ),
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        default="replicate",
        description=(
            'Under torchrun (learner.devices > 1 in the chart): "replicate", each rank holds the '
            "whole base (for a base that fits one device: one all-reduce of the LoRA gradient a "
            'step); "fsdp", the base, LoRA and optimizer state sharded over the ranks with FSDP2 '
            "(a base too large for one device; weights gathered layer by layer). "
            "learner/parallel.py."
        ),
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Torch's CPU threads for training. Empty: torch's default, every core. On a machine "
            "that also serves vLLM, fewer: torch's threads meet at a barrier after every op, so "
            "one thread starved by vLLM stalls them all (docs/results/settings-measurements.md). "
            "The embedded stack sets what vLLM leaves free."
        ),
    )
    base_model_path: str | None = Field(
        default=None,
        description=(
            "Where the learner's base weights are (the value vLLM was started with as --model, "
            "which is also what each adapter's base_model_name_or_path must say). Required by the "
            "learner, and by the judge for an alias that learns from ratings; `ratchet up` sets "
            "it to the embedded model."
        ),
    )
    gate_concurrency: int = Field(
        default=16,
        ge=1,
        le=256,
        description=(
            "Gate answers in flight at once. vLLM batches them: on the CPU build 16 is most of "
            "the gain (docs/results/settings-measurements.md); a GPU gains more."
        ),
    )
    gate_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="How long one gate answer from vLLM may take.",
    )
    heldout_pool: int = Field(
        default=1024,
        ge=1,
        description=(
            "Held-out prompts kept per alias for the gate; when full, the key holding the most "
            "loses its oldest, so a flood from one key cannot push the others' prompts out."
        ),
    )
    guard_rounds: int = Field(
        default=3,
        ge=2,
        description=(
            "Reward-hacking guard: pause an alias when, over the last guard_rounds rounds, the "
            "training reward rose every round while every gate rejected..."
        ),
    )
    collapse_share: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="...or when this share of a round's groups are near-identical answers...",
    )
    max_length_growth: float = Field(
        default=3.0,
        gt=1.0,
        description=(
            "...or the round's mean answer length grew this many times over the alias's first "
            "round."
        ),
    )
    canary_check_s: float = Field(
        default=2.0,
        gt=0,
        description="How often a running canary is checked.",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        ge=0.5,
        le=3600,
        description=(
            "Each alias's rounds and canary decisions are run by one learner replica at a time: "
            "the one holding the alias's Redis lease, renewed every third of this. A replica that "
            "dies frees its aliases after this long; one that stalls longer loses them (its "
            "writes are fenced)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [
                f"learner.{old} is now learner.{new}"
                for old, new in MOVED_KEYS.items()
                if old in data
            ]
            if moved:
                raise ValueError(
                    "; ".join(moved)
                    + ": nest them so in ratchet.yaml (variables: RATCHET_LEARNER__LORA__RANK, ...)"
                )
        return data

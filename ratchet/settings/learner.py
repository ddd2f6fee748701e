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

    consumer_group: str = "ratchet-learner"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=8403, ge=1, le=65535)
    # A round runs when this many usable groups wait for an alias...
    # The round's size and steps and the learning rate were chosen on every bundled task with
    # bench/demo_learning.py: three rounds, each on 32 groups sampled from the last candidate,
    # held-out greedy lift after each (README, "Defaults"). 8 steps of 4 groups at 2e-3 lifted
    # the three tasks by +0.12, +0.60 and +0.96 in all after rounds 1, 2 and 3; 32 steps of one
    # group at 1e-3 (the demo's earlier choice) by +0.18, +0.42, +0.79; 32 steps of one group at
    # 2e-3 collapsed sorting's first round and bullets' third into empty answers.
    batch_groups: int = Field(default=32, ge=1)
    # ...or when at least min_groups wait and this long has passed since the oldest of them
    # arrived and since the alias's last round (or gate) ended. A judge pauses while the learner
    # trains and gates, so the few groups in flight when a round began had waited through it:
    # counted from their arrival alone, they started the next round on their own as soon as it
    # ended (bullets, 2026-11-29: a round of 4 groups, then a 10-minute gate of a candidate no
    # different from the live one, with the judge paused).
    interval_s: float = Field(default=300.0, gt=0)
    min_groups: int = Field(default=4, ge=1)
    # Groups sampled by a version more than this many promotions behind the live one are dropped.
    max_staleness: int = Field(default=1, ge=0)
    # Groups held in memory per alias while a round or a canary is under way; older ones drop.
    max_waiting_groups: int = Field(default=256, ge=1)
    steps_per_round: int = Field(default=8, ge=1)
    learning_rate: float = Field(default=2e-3, gt=0)
    # Passes over a round's groups (PPO epochs), each of steps_per_round steps. From the second
    # on, a step whose policy has moved past epoch_max_kl (the token-mean KL from the sampling
    # policy, k3) or clips more than epoch_max_clip_frac of its tokens is not taken and the round
    # ends there: the importance ratio corrects a small move, not a large one.
    epochs_per_round: int = Field(default=1, ge=1, le=16)
    epoch_max_kl: float = Field(default=0.02, gt=0)
    epoch_max_clip_frac: float = Field(default=0.2, gt=0, le=1.0)
    # A candidate the gate rejected while it won more than the threshold of its pairs is where
    # the next round starts (ratchet/carry.py), up to this many rounds of training beyond the
    # live version; 1: every round starts from the live version. A round of a few dozen groups
    # gains too little for any gate to prove (five rounds in a row rejected at 0.53-0.62), and
    # the judge samples a carried round's groups from the candidate itself, so rounds build on
    # one another as on-policy GRPO does: bench/demo_learning.py, three rounds of 32 groups each
    # sampled from the last round's candidate, lifted every bundled task more each round (held-out
    # greedy, base -> rounds 1, 2, 3: bullets 0.20 -> 0.32, 0.40, 0.51; demo 0.48 -> 0.53, 0.64,
    # 0.75; sorting 0.42 -> 0.44, 0.48, 0.64). Beyond four, a lineage that never proves itself
    # starts again from the live version.
    max_candidate_rounds: int = Field(default=4, ge=1)
    # While a candidate's canary waits for users' ratings, the next round trains on from it
    # (the judge samples from it) and its candidate is gated once the canary ends; rolled back,
    # that round is lost. Off: no round runs during a canary.
    train_during_canary: bool = True
    # Padded tokens per forward and backward; a longer row (one group) is a micro-batch alone.
    # Measured on 2 cores, one step of 4 demo-shaped groups (a 250-token prompt and 6 answers of
    # 100): 1024 trains at 61 tok/s with a 4.4 GiB peak, 2048 at 55 with 6.8 GiB, 4096 at 52-56
    # with 9.6 GiB, the same loss to 1e-8. Small batches lose nothing on a CPU; a GPU may want more.
    micro_batch_tokens: int = Field(default=1024, ge=64)
    # 0 turns clipping off.
    max_grad_norm: float = Field(default=1.0, ge=0)
    # AdamW's decoupled weight decay: pulls the LoRA weights toward zero, i.e. toward the base
    # model. Off by default, as in TRL's GRPOConfig.
    weight_decay: float = Field(default=0.0, ge=0.0)
    lora: LoraSettings = LoraSettings()
    loss: LossSettings = LossSettings()
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # The forward and backward's arithmetic: "bf16" autocasts them to bfloat16 (weights, LoRA and
    # AdamW stay float32 on a CPU); "auto" is bf16 on a GPU, float32 on a CPU: there the embedded
    # vLLM samples in float32, and a bf16 learner's mismatched logprobs cost more learning than
    # its 1.2-1.3x speed on AMX buys (learner/trainer.py uses_bf16).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Under torchrun (learner.devices > 1 in the chart): "replicate", each rank holds the whole
    # base (for a base that fits one device: one all-reduce of the LoRA gradient a step);
    # "fsdp", the base, LoRA and optimizer state sharded over the ranks with FSDP2 (a base too
    # large for one device; weights gathered layer by layer). learner/parallel.py.
    sharding: Literal["replicate", "fsdp"] = "replicate"
    # Torch's CPU threads for training. Empty: torch's default, every core. On a machine that
    # also serves vLLM, fewer: torch's threads meet at a barrier after every op, so one thread
    # starved by vLLM stalls them all (measured: a round's step 50x slower than alone). The
    # embedded stack sets what vLLM leaves free.
    cpu_threads: int | None = Field(default=None, ge=1)
    # Where the learner's base weights are (the value vLLM was started with as --model, which is
    # also what each adapter's base_model_name_or_path must say). Required by the learner, and by
    # the judge for an alias that learns from ratings; `ratchet up` sets it to the embedded model.
    base_model_path: str | None = None
    # Gate answers in flight at once. vLLM batches them: on the CPU build, 48 greedy answers of 64
    # tokens take 43 s at 4, 27 s at 16, 24 s at 48 (measured); a GPU gains more.
    gate_concurrency: int = Field(default=16, ge=1, le=256)
    gate_timeout_s: float = Field(default=120.0, gt=0)
    # Held-out prompts kept per alias for the gate; when full, the key holding the most loses
    # its oldest, so a flood from one key cannot push the others' prompts out.
    heldout_pool: int = Field(default=1024, ge=1)
    # Reward-hacking guard: pause an alias when, over the last guard_rounds rounds, the training
    # reward rose every round while every gate rejected...
    guard_rounds: int = Field(default=3, ge=2)
    # ...or when this share of a round's groups are near-identical answers...
    collapse_share: float = Field(default=0.8, gt=0.0, le=1.0)
    # ...or the round's mean answer length grew this many times over the alias's first round.
    max_length_growth: float = Field(default=3.0, gt=1.0)
    canary_check_s: float = Field(default=2.0, gt=0)
    # Each alias's rounds and canary decisions are run by one learner replica at a time: the one
    # holding the alias's Redis lease, renewed every third of this. A replica that dies frees
    # its aliases after this long; one that stalls longer loses them (its writes are fenced).
    lease_ttl_s: float = Field(default=30.0, ge=0.5, le=3600)

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

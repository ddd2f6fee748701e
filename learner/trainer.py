"""GRPO on a LoRA adapter: the judged groups of a round in, the next adapter version out.

A round starts from the live version's adapter (learning accumulates across versions) or from a
fresh LoRA for v0, takes ``steps_per_round`` AdamW steps of the clipped GRPO loss of
``learner/loss.py`` on the round's groups, and writes the candidate to the adapter store with its
optimizer state, so the next round, in this process or after a restart, continues where it
stopped.

Data flow of a round:

* :func:`pack_groups` turns the groups into rows, one per group: the prompt once, then each
  sample's completion, with the behaviour logprobs vLLM logged when it sampled and each sample's
  group-relative advantage on its tokens (a token whose logged logprob is not finite stays as
  context but is not trained on). Groups whose rewards are all equal carry no signal (zero
  advantages) and are dropped before any compute is spent on them, as DAPO's dynamic sampling
  does.
* The kept groups are put in an order of their content (not of their arrival, which the judge's
  timing decides), then shuffled (seeded by ``seed``, the round number and the epoch) and dealt
  into ``steps_per_round`` mini-batches of whole groups (one PPO epoch; the stream wraps when a
  round has fewer groups than steps), so a step's advantages are centred within it. vLLM's
  logprobs are the old policy of every step's importance ratio, so no extra forward pass
  recomputes them.
* ``epochs_per_round`` > 1 passes over the same groups again, each pass reshuffled. From the
  second pass on, a step whose forward finds the policy too far from the one that sampled (its
  token-mean ``approx_kl`` above ``epoch_max_kl``, or more than ``epoch_max_clip_frac`` of its
  tokens clipped) is not taken and the round ends: :func:`epoch_stop` says why, and the round's
  stats keep it. The first pass always runs whole: it is the plain on-policy GRPO round.
* A step's rows are sorted by length and cut into micro-batches of at most
  ``micro_batch_tokens`` padded tokens; gradients accumulate, each micro-batch's loss weighted by
  its share of the step's completion tokens, so the step's loss is the token mean over the whole
  step (DAPO), whatever the micro-batching.
* :func:`token_logprobs` runs the model once per row under a mask that lets each completion see
  only the prompt and itself (learner/batch.py): each sample's tokens get the logprobs of their
  own sequence while the prompt is computed once, not K times, and only the positions that
  predict a completion token go through the LM head. With ``kl_beta > 0`` the reference logprobs
  are the same call with the adapter disabled (v0).
* A step whose gradient is not finite is skipped (and counted), so one bad record cannot poison
  the adapter or Adam's moments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import torch
from torch import Tensor, nn

from learner.batch import Batch, pack_groups, token_logprobs
from learner.loss import grpo_loss
from learner.parallel import (
    Ranks,
    all_reduce,
    all_reduce_grads,
    empty_base,
    gathered,
    is_sharded,
    like,
    scattered,
    shard,
    whole,
)
from ratchet.records import ScoredGroup
from ratchet.settings import LearnerSettings, LoraSettings
from ratchet.store import AdapterStore

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_STATE_FORMAT = 1

Precision = Literal["auto", "fp32", "bf16"]
Sharding = Literal["replicate", "fsdp"]


# What a round's training depends on, recorded in each adapter's metadata beside its LoRA shape.
TRAINING_FIELDS = frozenset(
    {
        "learning_rate",
        "steps_per_round",
        "micro_batch_tokens",
        "max_grad_norm",
        "weight_decay",
        "loss",
        "seed",
        "epochs_per_round",
        "epoch_max_kl",
        "epoch_max_clip_frac",
        "precision",
        "sharding",
    }
)


def saved_key(param_name: str, adapter: str = "default") -> str:
    """The key peft saves a LoRA parameter under: its name without the adapter's."""
    return param_name.replace(f".{adapter}", "")


def native_bf16_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX). Elsewhere torch
    emulates it, slower than float32."""
    try:
        flags = cpuinfo.read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def uses_bf16(precision: Precision, device: torch.device) -> bool:
    """What ``learner.precision`` means on this device: ``auto`` is bf16 on a GPU that computes
    it, float32 on a CPU even where it computes bfloat16 natively (AMX). There the embedded vLLM
    samples in float32, and a bf16 learner's logprobs differ from the sampler's by bf16's
    rounding: the importance ratios move, tokens are clipped that should not be, and the
    integration test's better round (float32: promoted) was rejected in bf16 on an AMX host,
    for 1.24-1.31x the speed (bench/learner_precision.py)."""
    if precision != "auto":
        return precision == "bf16"
    return device.type == "cuda" and bool(torch.cuda.is_bf16_supported())


def epoch_stop(
    epoch: int, approx_kl: float, clip_frac: float, train: LearnerSettings
) -> str | None:
    """Why a step of this 1-based epoch is not taken (the round ends there), or None. The
    first epoch always runs whole."""
    if epoch <= 1:
        return None
    if approx_kl > train.epoch_max_kl:
        return f"kl {approx_kl:.4f} > {train.epoch_max_kl:g} in epoch {epoch}"
    if clip_frac > train.epoch_max_clip_frac:
        return f"clip fraction {clip_frac:.3f} > {train.epoch_max_clip_frac:g} in epoch {epoch}"
    return None


@dataclass(frozen=True)
class RoundStats:
    round: int  # 1-based count of rounds this adapter lineage has trained
    steps: int
    groups: int
    groups_skipped: int  # groups with all-equal rewards: no signal, not trained on
    samples: int  # samples trained on (those of the kept groups)
    mean_reward: float
    loss: float  # token mean over the round of the full loss (policy + KL)
    policy_loss: float
    kl: float | None
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_frac_low: float
    clip_frac_high: float
    approx_kl: float  # token mean over the round of the KL from the sampling policy (k3)
    epochs: int  # passes over the groups begun (learner.epochs_per_round at most)
    stopped: str | None  # why a later epoch ended the round early; None: every step taken
    grad_norm: float  # mean over the steps taken, before clipping
    steps_skipped: int  # steps whose gradient was not finite: no update
    completion_tokens: int  # completion tokens trained on, summed over the steps
    total_tokens: int  # prompt + completion tokens forwarded, summed over the steps
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN (a round without steps) becomes None."""
        values = {**asdict(self), "tokens_per_second": self.tokens_per_second}
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


def resolve_target_modules(model: nn.Module, target: Sequence[str] | str) -> tuple[str, ...]:
    """Module names LoRA wraps; "all-linear" is every nn.Linear except the output layer."""
    output_layer = cast(Any, model).get_output_embeddings()
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output_layer
    }
    if target == "all-linear":
        return tuple(sorted(linear))
    names = (target,) if isinstance(target, str) else tuple(target)
    unknown = sorted(set(names) - linear)
    if unknown:
        raise ValueError(f"no linear module named {unknown}; the model has {sorted(linear)}")
    return tuple(sorted(set(names)))


class LoraGRPOLearner:
    """The learner's model: a frozen base, one trainable LoRA adapter and its AdamW state."""

    def __init__(
        self,
        base_model_path: Path,
        lora: LoraSettings,
        train: LearnerSettings,
        device: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.base_model_path = Path(base_model_path)
        # What adapters record as base_model_name_or_path (vLLM's --model value, verbatim).
        self.base_model_id = str(base_model_path)
        self.lora, self.train = lora, train
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        bf16 = uses_bf16(train.precision, self.device)
        # The frozen base's weights: bfloat16 on a GPU that computes in it; float32 on a CPU,
        # where autocast casts per op and keeps LoRA and AdamW in float32.
        gpu_bf16 = bf16 and self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if gpu_bf16 else torch.float32)
        low = (torch.bfloat16, torch.float16)
        self.autocast_dtype = torch.bfloat16 if bf16 else self.dtype if self.dtype in low else None
        self.ranks = Ranks.current()  # data parallel under torchrun (learner/parallel.py)
        # FSDP2 over the ranks, or each rank the whole model (learner/parallel.py)
        self.sharded = self.ranks.size > 1 and train.sharding == "fsdp"
        # SDPA takes the boolean shared-prompt mask of learner/batch.py as it is.
        load_options: dict[str, Any] = {"dtype": self.dtype, "attn_implementation": "sdpa"}
        if self.sharded and self.ranks.rank > 0:  # rank 0 sends it its shards
            base = empty_base(self.base_model_path, **load_options)
        else:
            base = AutoModelForCausalLM.from_pretrained(self.base_model_path, **load_options)
        self.target_modules = resolve_target_modules(base, lora.target_modules)
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):  # LoRA A's init is random: seeded, and local
            torch.manual_seed(train.seed)
            model = get_peft_model(base, config)
        if self.sharded:
            shard(model, getattr(base, "_no_split_modules", None) or [], self.device)
        else:
            model = model.to(self.device)
        self.model = model
        self.model.train()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        loose = [n for n, p in named if self.sharded and not is_sharded(p)]
        if loose:  # FSDP would not reduce their gradient
            raise ValueError(
                f"learner.sharding fsdp shards the decoder layers; LoRA on {loose[:3]} is "
                "outside them: leave those modules out of learner.lora.target_modules"
            )
        self._fresh = [p.detach().clone() for p in self.params]
        # Sharded: the whole adapter and optimizer state, gathered by every rank after a load
        # and after a round, for rank 0 to save.
        self._whole: tuple[dict[str, Tensor], dict[str, Any]] | None = None
        self.load_adapter(None)

    # --- state -------------------------------------------------------------------------------

    def load_adapter(self, folder: Path | None) -> None:
        """Start from a fresh LoRA (None: v0 -> v1) or from a stored version, with its optimizer
        state when the folder has one. The stored adapter's rank, alpha and target modules must
        match the settings: a different shape cannot continue it."""
        self._load_adapter(folder)
        if self.sharded:
            self._gather()

    def _load_adapter(self, folder: Path | None) -> None:
        self.rounds = self.optimizer_steps = self.groups_seen = self.tokens_seen = 0
        self.last_round: RoundStats | None = None
        self.optimizer = self._new_optimizer()
        if folder is None:
            with torch.no_grad():
                for param, fresh in zip(self.params, self._fresh, strict=True):
                    param.copy_(fresh)
            return
        from safetensors.torch import load_file

        folder = Path(folder)
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        stored = (config.get("r"), config.get("lora_alpha"), sorted(targets))
        wanted = (self.lora.rank, self.lora.alpha, sorted(self.target_modules))
        if stored != wanted:
            raise ValueError(
                f"{folder.name} has (rank, alpha, targets) {stored}, the settings "
                f"{wanted}; start a fresh adapter to change its shape"
            )
        weights = load_file(folder / ADAPTER_WEIGHTS, device=str(self.device))
        self._set_weights(folder, weights)
        path = folder / OPTIMIZER_FILE
        if not path.is_file():
            log.info("%s has no %s: fresh optimizer state", folder.name, OPTIMIZER_FILE)
            return
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state.get("format") != _STATE_FORMAT or state.get("param_names") != self.param_names:
            log.warning("%s: optimizer state does not fit this model; starting it fresh", path)
            return
        self.optimizer.load_state_dict(scattered(state["optimizer"], self.params))
        for group in self.optimizer.param_groups:  # the settings win over the stored values
            group.update(lr=self.train.learning_rate, weight_decay=self.train.weight_decay)
        self.rounds, self.optimizer_steps = int(state["rounds"]), int(state["optimizer_steps"])
        self.groups_seen, self.tokens_seen = int(state["groups_seen"]), int(state["tokens_seen"])

    def _set_weights(self, folder: Path, weights: dict[str, Tensor]) -> None:
        """The adapter's weights (keyed as peft saves them) into the model, each rank's shard
        of each where it is sharded (peft's loader copies whole tensors); ValueError if they do
        not fit it."""
        keys = [saved_key(name) for name in self.param_names]
        missing = [k for k in keys if k not in weights]
        unexpected = sorted(set(weights) - set(keys))
        if unexpected or missing:
            raise ValueError(
                f"{folder.name}: adapter weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        with torch.no_grad():
            for key, param in zip(keys, self.params, strict=True):
                param.copy_(like(weights[key].to(param.dtype), param))

    def _gather(self) -> None:
        """Every rank: the whole adapter and optimizer state, kept for :meth:`save_candidate`."""
        weights = {n: whole(p.detach()) for n, p in zip(self.param_names, self.params, strict=True)}
        self._whole = weights, gathered(self.optimizer.state_dict())

    def adapter_weights(self) -> dict[str, Tensor]:
        """The adapter's whole weights by parameter name (sharded: as of the last load or
        round)."""
        if self._whole is not None:
            return dict(self._whole[0])
        return {n: p.detach() for n, p in zip(self.param_names, self.params, strict=True)}

    def _new_optimizer(self) -> torch.optim.Optimizer:
        fused = self.device.type in ("cuda", "cpu")
        return torch.optim.AdamW(
            self.params,
            lr=self.train.learning_rate,
            weight_decay=self.train.weight_decay,
            fused=fused,
        )

    def save_candidate(
        self, store: AdapterStore, alias: str, version: int, parent: int, meta: dict[str, Any]
    ) -> Path:
        """Write the adapter and its optimizer state as ``<alias>@v<version>``, atomically."""

        def write(folder: Path) -> None:
            weights = self.adapter_weights()  # sharded: the whole tensors, not this rank's shard
            self.model.save_pretrained(str(folder), safe_serialization=True, state_dict=weights)
            (folder / "README.md").unlink(missing_ok=True)  # peft's model card stub
            config_path = folder / ADAPTER_CONFIG
            config = json.loads(config_path.read_text())
            config["target_modules"] = sorted(self.target_modules)  # peft writes a set's order
            config_path.write_text(json.dumps(config, indent=2))
            torch.save(self._optimizer_state(), folder / OPTIMIZER_FILE)

        full_meta: dict[str, Any] = {
            "parent_version": parent,
            "rounds": self.rounds,
            "optimizer_steps": self.optimizer_steps,
            "groups_seen": self.groups_seen,
            "completion_tokens_seen": self.tokens_seen,
            "lora": self.lora.model_dump(mode="json"),
            "train": self.train.model_dump(mode="json", include=set(TRAINING_FIELDS)),
            "last_round": self.last_round.as_dict() if self.last_round else None,
        }
        full_meta.update(meta)
        return store.write(alias, version, write, self.base_model_id, full_meta)

    def _optimizer_state(self) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "param_names": self.param_names,
            "optimizer": self._whole[1] if self._whole else self.optimizer.state_dict(),
            "rounds": self.rounds,
            "optimizer_steps": self.optimizer_steps,
            "groups_seen": self.groups_seen,
            "tokens_seen": self.tokens_seen,
        }

    # --- training ----------------------------------------------------------------------------

    def train_round(
        self, groups: list[ScoredGroup], on_step: StepCallback | None = None
    ) -> RoundStats:
        """``epochs_per_round`` passes of ``steps_per_round`` optimizer steps of GRPO on the
        groups; see the module docstring. After each step taken its line is logged and
        ``on_step`` (if given) called with it."""
        start = time.perf_counter()
        cfg = self.train.loss
        groups = sorted(groups, key=content_order)
        packed = pack_groups(groups, cfg.scale_rewards)
        informative = torch.tensor(
            [bool(g.rewards) and max(g.rewards) > min(g.rewards) for g in groups], dtype=torch.bool
        )
        kept = informative.nonzero().flatten()
        packed = packed.select(kept)  # rows are groups
        kept_groups = [groups[i] for i in kept.tolist()]
        lengths = packed.lengths  # on the CPU: planning never waits for the device
        batch = packed.to(self.device)
        self.rounds += 1
        epochs = [self._plan_steps(len(batch), e + 1) for e in range(self.train.epochs_per_round)]
        acc = _Accumulator(self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # LoRA dropout: seeded by the round
            torch.manual_seed(self.train.seed * 1_000_003 + self.rounds)
            taken, epochs_begun, stopped = self._run_epochs(
                batch, epochs, lengths, acc, kept_groups, start, on_step
            )
        self.optimizer_steps += taken - acc.skipped
        self.groups_seen += int(informative.sum())
        if self.ranks.size > 1:
            acc.reduce()
        stats = acc.finish(
            kl_on=cfg.kl_beta > 0.0,
            start=start,
            round=self.rounds,
            steps=taken,
            epochs=epochs_begun,
            stopped=stopped,
            groups=len(groups),
            groups_skipped=len(groups) - int(informative.sum()),
            samples=int(packed.samples.sum()),
            mean_reward=_mean_reward(groups),
        )
        self.tokens_seen += stats.completion_tokens
        self.last_round = stats
        if self.sharded:
            self._gather()
        return stats

    def _run_epochs(
        self,
        batch: Batch,
        epochs: list[list[Tensor]],
        lengths: Tensor,
        acc: _Accumulator,
        kept_groups: list[ScoredGroup],
        start: float,
        on_step: StepCallback | None,
    ) -> tuple[int, int, str | None]:
        """The planned steps, pass after pass, until they run out or a step is not taken
        (:func:`epoch_stop`): (steps taken, passes begun, why it stopped)."""
        planned = sum(len(steps) for steps in epochs)
        taken = tokens = epochs_begun = 0
        for epoch, steps in enumerate(epochs, 1):
            epochs_begun = epoch if steps else epochs_begun
            for step_rows in steps:
                step = self._step(batch, step_rows, lengths, acc, epoch)
                if step.stopped is not None:
                    log.info("round %d: stopped: %s", self.rounds, step.stopped)
                    return taken, epochs_begun, step.stopped
                taken += 1
                tokens += step.tokens
                progress = StepProgress(
                    round=self.rounds,
                    step=taken,
                    steps=planned,
                    loss=step.loss,
                    reward=_mean_reward([kept_groups[i] for i in step_rows.tolist()]),
                    completion_tokens=tokens,
                    seconds=time.perf_counter() - start,
                )
                log.info("%s", progress.line())
                if on_step is not None:
                    on_step(progress)
        return taken, epochs_begun, None

    def _step(
        self, batch: Batch, step_rows: Tensor, lengths: Tensor, acc: _Accumulator, epoch: int
    ) -> StepResult:
        """One optimizer step: micro-batches accumulate the gradient of the step's token mean.
        Not taken (``stopped`` says why) when :func:`epoch_stop` says the policy has moved too
        far from the sampler's; its micro-batches then count in no statistic."""
        cfg = self.train.loss
        count = batch.completion_mask[step_rows.to(self.device)].sum()
        step_tokens = count.clamp(min=1)
        zero = torch.zeros((), device=self.device, dtype=torch.float64)
        step_loss, step_kl, step_clip = zero.clone(), zero.clone(), zero.clone()
        micro_stats: list[tuple[Tensor, dict[str, Tensor], int]] = []
        micro_batches = self._micro_batches(step_rows, lengths)
        # FSDP averages the ranks' gradients: scaled by their number, the average is the sum.
        scale = self.ranks.size if self.sharded else 1
        for index in self._turns(len(micro_batches)):
            rows = micro_batches[0 if index is None else index]
            micro = batch.select(rows, int(lengths[rows].max()))
            with self._autocast():
                logprobs = token_logprobs(self.model, micro)
                ref = None
                if cfg.kl_beta > 0.0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref = token_logprobs(self.model, micro)
            loss, stats = grpo_loss(
                logprobs,
                micro.behaviour_logprobs,
                micro.advantages,
                micro.completion_mask,
                cfg,
                ref,
            )
            if index is None:
                torch.autograd.backward(loss * 0.0)
                continue
            share = stats["num_tokens"] / step_tokens
            torch.autograd.backward(loss * (share * scale))  # Tensor.backward is untyped
            step_loss += loss.detach().double() * share
            step_kl += stats["approx_kl"].double() * share
            step_clip += (stats["clip_frac_low"] + stats["clip_frac_high"]).double() * share
            micro_stats.append((loss.detach(), stats, int(lengths[rows].sum())))
        step_loss, step_kl, step_clip = self._reduce(step_loss, step_kl, step_clip)
        if epoch > 1:  # one sync a step, for the decision every rank must make alike
            approx_kl, clip_frac = torch.stack([step_kl, step_clip]).tolist()
            reason = epoch_stop(epoch, approx_kl, clip_frac, self.train)
            if reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(math.nan, 0, reason)
        for loss, stats, total_tokens in micro_stats:
            acc.add(loss, stats, total_tokens)
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm > 0 else math.inf
        norm = whole(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if torch.isfinite(norm):  # one device sync a step
            acc.grad_norms.append(norm)
            self.optimizer.step()
        else:  # a NaN or inf gradient would poison the adapter and Adam's moments
            acc.skipped += 1
            log.warning("round %d: skipped a step with a non-finite gradient", self.rounds)
        self.optimizer.zero_grad(set_to_none=True)
        # One more sync a step, for its log line; the step's work is done by now anyway.
        loss_value, tokens = torch.stack([step_loss, count.double()]).tolist()
        return StepResult(loss_value, int(tokens), None)

    def _turns(self, count: int) -> list[int | None]:
        """The indices of this rank's micro-batches of a step's ``count`` (learner/parallel.py);
        sharded, padded to the busiest rank's number with None: the first again, at weight zero,
        as FSDP's gathers need every rank."""
        turns: list[int | None] = [i for i in range(count) if self.ranks.mine(i)]
        if self.sharded:
            turns += [None] * (math.ceil(count / self.ranks.size) - len(turns))
        return turns

    def _reduce(self, *stats: Tensor) -> list[Tensor]:
        """After a step's micro-batches, on several ranks: the step's ``stats`` summed over
        them, and the gradient too where FSDP did not reduce it in the backward."""
        if self.sharded:
            return list(all_reduce(torch.stack(list(stats)), "sum").unbind())
        if self.ranks.size > 1:  # every rank now holds the step's whole gradient and stats
            return all_reduce_grads(self.params, *stats)
        return list(stats)

    def _plan_steps(self, n: int, epoch: int = 1) -> list[Tensor]:
        """steps_per_round mini-batches of rows (groups) for one epoch: seeded shuffles, dealt
        evenly, wrapping."""
        if n == 0:
            return []
        steps = self.train.steps_per_round
        seed = self.train.seed * 1_000_003 + self.rounds
        gen = torch.Generator().manual_seed(seed if epoch == 1 else seed * 8191 + epoch)
        if n >= steps:  # one epoch: sizes differ by at most one
            return list(torch.tensor_split(torch.randperm(n, generator=gen), steps))
        # fewer groups than steps: one group a step, from shuffles laid end to end
        stream = torch.cat([torch.randperm(n, generator=gen) for _ in range(math.ceil(steps / n))])
        return [stream[i : i + 1] for i in range(steps)]

    def _micro_batches(self, rows: Tensor, lengths: Tensor) -> list[Tensor]:
        """Rows sorted longest first, cut where rows x longest would pass micro_batch_tokens."""
        lens = lengths[rows].tolist()
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        out: list[list[int]] = []
        for i in order:
            if out and (len(out[-1]) + 1) * lens[out[-1][0]] <= self.train.micro_batch_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return [rows[torch.tensor(chunk)] for chunk in out]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def _mean_reward(groups: list[ScoredGroup]) -> float:
    rewards = [r for g in groups for r in g.rewards]
    return sum(rewards) / len(rewards) if rewards else math.nan


def content_order(group: ScoredGroup) -> tuple[list[int], list[list[int]]]:
    """A group's place in a round: by its prompt's tokens, then its samples'. The same groups
    then train the same candidate however the judge's timing ordered them."""
    return group.prompt_token_ids, [sample.token_ids for sample in group.samples]


class StepResult(NamedTuple):
    loss: float  # the step's token-mean loss (NaN: not taken)
    tokens: int  # its completion tokens (0: not taken)
    stopped: str | None  # why it was not taken (epoch_stop), and the round ends


@dataclass(frozen=True)
class StepProgress:
    """What one optimizer step of a round did, for its log line and the alias's progress."""

    round: int
    step: int  # 1-based
    steps: int
    loss: float  # token mean over the step's completion tokens (policy + KL)
    reward: float  # mean reward of the step's groups' samples
    completion_tokens: int  # trained on so far in the round
    seconds: float  # since the round started (packing included)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"round {self.round}: step {self.step}/{self.steps} loss {self.loss:.4f}, "
            f"reward {self.reward:.3f}, {self.tokens_per_second:.1f} tokens/s"
        )


StepCallback = Callable[[StepProgress], None]


class _Accumulator:
    """Token-weighted sums of the loss stats, read once at the end (one device sync a round)."""

    _KEYS = ("policy_loss", "kl", "ratio_mean", "clip_frac_low", "clip_frac_high", "approx_kl")

    def __init__(self, device: torch.device) -> None:
        def full(value: float) -> Tensor:
            return torch.full((), value, device=device, dtype=torch.float64)

        self.sums = {k: full(0.0) for k in ("tokens", "loss", *self._KEYS)}
        self.ratio_min, self.ratio_max = full(math.nan), full(math.nan)
        self.grad_norms: list[Tensor] = []
        self.total_tokens = 0
        self.skipped = 0

    def add(self, loss: Tensor, stats: dict[str, Tensor], total_tokens: int) -> None:
        n = stats["num_tokens"].double()
        self.sums["tokens"] += n
        self.sums["loss"] += loss.double() * n
        for key in self._KEYS:
            if key in stats:
                self.sums[key] += stats[key].double() * n
        # fmin/fmax skip NaN, which is what a micro-batch without completion tokens reports
        self.ratio_min = torch.fmin(self.ratio_min, stats["ratio_min"].double())
        self.ratio_max = torch.fmax(self.ratio_max, stats["ratio_max"].double())
        self.total_tokens += total_tokens

    def reduce(self) -> None:
        """The sums over every rank's micro-batches (data parallel: learner/parallel.py)."""
        sums = all_reduce(torch.stack(list(self.sums.values())), "sum")
        self.sums = dict(zip(self.sums, sums.unbind(), strict=True))
        self.ratio_min = all_reduce(self.ratio_min, "min")
        self.ratio_max = all_reduce(self.ratio_max, "max")
        total = torch.tensor(float(self.total_tokens), dtype=torch.float64)
        self.total_tokens = int(all_reduce(total.to(self.ratio_min.device), "sum").item())

    def finish(self, *, kl_on: bool, start: float, **fields: Any) -> RoundStats:
        norm = torch.stack(self.grad_norms).double().mean() if self.grad_norms else self.ratio_min
        values = torch.stack([*self.sums.values(), self.ratio_min, self.ratio_max, norm])
        *sums_list, ratio_min, ratio_max, grad_norm = values.tolist()
        sums = dict(zip(self.sums, sums_list, strict=True))
        n = sums["tokens"]
        mean = {k: sums[k] / n if n > 0 else math.nan for k in ("loss", *self._KEYS)}
        return RoundStats(
            **fields,
            loss=mean["loss"],
            policy_loss=mean["policy_loss"],
            kl=mean["kl"] if kl_on else None,
            ratio_mean=mean["ratio_mean"],
            ratio_min=ratio_min,
            ratio_max=ratio_max,
            clip_frac_low=mean["clip_frac_low"],
            clip_frac_high=mean["clip_frac_high"],
            approx_kl=mean["approx_kl"],
            grad_norm=grad_norm if self.grad_norms else math.nan,
            steps_skipped=self.skipped,
            completion_tokens=int(n),
            total_tokens=self.total_tokens,
            seconds=time.perf_counter() - start,
        )

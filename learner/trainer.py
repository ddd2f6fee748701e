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

Elsewhere: the adapter and optimizer state as files, loaded and written (learner/adapter_files.py);
what a round reports (learner/round_stats.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from learner.adapter_files import OPTIMIZER_FILE as OPTIMIZER_FILE
from learner.adapter_files import TRAINING_FIELDS as TRAINING_FIELDS
from learner.adapter_files import AdapterState
from learner.batch import Batch, pack_groups, token_logprobs
from learner.loss import grpo_loss
from learner.parallel import (
    Ranks,
    all_reduce,
    all_reduce_grads,
    empty_base,
    is_sharded,
    round_group,
    shard,
    whole,
)
from learner.rank_failure import Failures, injected_fault
from learner.round_stats import RoundStats as RoundStats
from learner.round_stats import RoundSums, StepResult
from learner.round_stats import StepCallback as StepCallback
from learner.round_stats import StepProgress as StepProgress
from ratchet.records import ScoredGroup
from ratchet.settings import LearnerSettings, LoraSettings

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16"]
Sharding = Literal["replicate", "fsdp"]


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


class LoraGRPOLearner(AdapterState):
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
        self._whole = None
        self._failures = Failures(self.ranks.size, round_group())
        self.load_adapter(None)

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
        acc = RoundSums(self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        devices = [self.device] if self.device.type == "cuda" else []
        # A step that fails on one rank ends the round on all of them (learner/rank_failure.py).
        self._failures = Failures(self.ranks.size, round_group())
        with torch.random.fork_rng(devices=devices):  # LoRA dropout: seeded by the round
            torch.manual_seed(self.train.seed * 1_000_003 + self.rounds)
            try:
                taken, epochs_begun, stopped = self._run_epochs(
                    batch, epochs, lengths, acc, kept_groups, start, on_step
                )
                self._failures.settle()
            except BaseException:
                self.optimizer.zero_grad(set_to_none=True)
                raise
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
        acc: RoundSums,
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
                if on_step is not None:  # rank 0's report: a failure is agreed on as a step's
                    self._failures.run(partial(on_step, progress))
        return taken, epochs_begun, None

    def _step(
        self, batch: Batch, step_rows: Tensor, lengths: Tensor, acc: RoundSums, epoch: int
    ) -> StepResult:
        """One optimizer step: micro-batches accumulate the gradient of the step's token mean.
        Not taken (``stopped`` says why) when :func:`epoch_stop` says the policy has moved too
        far from the sampler's; its micro-batches then count in no statistic."""
        count = batch.completion_mask[step_rows.to(self.device)].sum()
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss, kl, clip fraction
        micro_stats: list[tuple[Tensor, dict[str, Tensor], int]] = []
        micro_batches = self._micro_batches(step_rows, lengths)

        def compute() -> None:
            injected_fault(self.ranks.rank)  # a test hook (learner/rank_failure.py)
            self._accumulate(batch, micro_batches, lengths, count.clamp(min=1), sums, micro_stats)

        if self.sharded:  # FSDP gathers inside the forward: a failure there cannot be made even
            compute()
        else:  # local work: a rank that fails says so at the step's sum (learner/rank_failure.py)
            self._failures.run(compute)
        step_loss, step_kl, step_clip = sums.unbind()
        failed = torch.tensor(self._failures.flag, device=self.device, dtype=torch.float64)
        # The ranks that failed, summed with the step's numbers: no collective of its own.
        step_loss, step_kl, step_clip, failed = self._reduce(step_loss, step_kl, step_clip, failed)
        if epoch > 1:  # one sync a step, for the decision every rank must make alike
            approx_kl, clip_frac = torch.stack([step_kl, step_clip]).tolist()
            reason = epoch_stop(epoch, approx_kl, clip_frac, self.train)
            if reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(math.nan, 0, reason)
        for loss, stats, total_tokens in micro_stats:
            acc.add(loss, stats, total_tokens)
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm > 0 else math.inf
        norm = self._clip(max_norm)
        if torch.isfinite(norm):  # one device sync a step
            acc.grad_norms.append(norm)
            self._failures.run(self.optimizer.step)  # local: agreed on at the next sum
        else:  # a NaN or inf gradient would poison the adapter and Adam's moments
            acc.skipped += 1
            log.warning("round %d: skipped a step with a non-finite gradient", self.rounds)
        self.optimizer.zero_grad(set_to_none=True)
        # One more sync a step, for its log line; the step's work is done by now anyway. When a
        # rank failed every rank raises here alike (the step's update is thrown away with the
        # round: the next loads its adapter again).
        loss_value, tokens, failed_ranks = torch.stack([step_loss, count.double(), failed]).tolist()
        self._failures.check(failed_ranks)
        return StepResult(loss_value, int(tokens), None)

    def _accumulate(
        self,
        batch: Batch,
        micro_batches: list[Tensor],
        lengths: Tensor,
        step_tokens: Tensor,
        sums: Tensor,
        micro_stats: list[tuple[Tensor, dict[str, Tensor], int]],
    ) -> None:
        """This rank's micro-batches of a step, forward and backward: the gradient accumulated,
        ``sums`` (the step's loss, kl and clip fraction, token-weighted) added to in place."""
        cfg = self.train.loss
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
            clip = stats["clip_frac_low"] + stats["clip_frac_high"]
            sums += torch.stack([loss.detach(), stats["approx_kl"], clip]).double() * share
            micro_stats.append((loss.detach(), stats, int(lengths[rows].sum())))

    def _clip(self, max_norm: float) -> Tensor:
        """The gradient's norm, clipped to ``max_norm``. Sharded, a collective (the shards'
        norms summed); else local, and a failure there is agreed on at the next sum (NaN norm:
        no step taken)."""
        if self.sharded:
            return whole(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        norm = self._failures.run(lambda: torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        return torch.tensor(math.nan) if norm is None else norm

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

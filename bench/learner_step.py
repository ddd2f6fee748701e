"""Learner throughput: GRPO training tokens per second, ours against TRL and a bare loop.

Run it from the repository root (CPU, the embedded SmolLM2-135M-Instruct by default)::

    .venv/bin/python bench/learner_step.py [--rounds 3] [--groups 4] [--threads 0]

and on a GPU machine, with the model folder given (the script needs no vLLM, Kafka or Redis)::

    python bench/learner_step.py --device cuda --model-path /path/to/smollm2-135m-instruct

Method
------
One process, one model folder, one device and dtype (float32 on CPU, bfloat16 on CUDA), one
fixed synthetic round: ``--groups`` groups of ``--group-size`` samples, each a ``--prompt-len``
token prompt and a ``--completion-len`` token completion of random token ids (seeded), random
rewards in [0, 1], and behaviour logprobs computed once by the base model (so the first step is
on-policy, as with a fresh adapter). Three trainers, each with its own copy of the model and the
same LoRA (rank, alpha, dropout, all linear projections), the same AdamW (fused; learning rate,
weight decay and max grad norm) and no gradient checkpointing, train on that round; those knobs
are ``LearnerSettings``' defaults (ratchet/settings/learner.py) unless a flag sets them:

1. ours: ``LoraGRPOLearner.train_round(groups)`` from the ``ScoredGroup`` records, packing
   included: ``--steps`` optimizer steps, each on 1/steps of the groups, micro-batches of
   ``--micro-batch`` sequences' tokens (as a token budget), the DAPO token-mean clipped loss.
   It packs each group as one row with its prompt once (learner/batch.py), where TRL and bare
   forward the prompt again with each of the group's samples.
2. TRL: ``trl.GRPOTrainer`` (TRL 1.16) built with the same base model and ``peft_config``,
   ``loss_type="dapo"``, the settings' ``kl_beta``, ``epsilon_low`` and ``epsilon_high`` as its
   ``beta``, ``epsilon`` and ``epsilon_high``,
   ``per_device_train_batch_size`` = ``--micro-batch``, ``gradient_accumulation_steps`` so a step
   sees the same samples as ours, ``steps_per_generation`` = steps x accumulation, so one
   generation batch is one round. Generation is bypassed: ``_generate_and_score_completions``,
   the hook TRL's ``_prepare_inputs`` calls once per generation batch, is overridden to return
   the fixed round as TRL's own tensors (prompt ids and mask, completion ids and mask, the
   advantages of ``learner.loss.group_advantages``, ``old_per_token_logps`` = the behaviour
   logprobs, ``num_items_in_batch`` = completion tokens). Everything after it is TRL's own code:
   its shuffle and split of the generation batch, its training step (fused LM head, entropy,
   loss, metrics), the HF Trainer's accumulation, clipping, optimizer and scheduler step and
   logging (every round). TRL computes nothing here that it would not compute in a real run
   after generation; it is spared the rollout, the reward calls and, with vLLM or with several
   optimizer steps per generation, its extra forward pass for ``old_per_token_logps`` (ours
   uses vLLM's logprobs instead): TRL's number is an upper bound of its real throughput.
3. bare: the ceiling of a trainer that forwards each sample as its own sequence. The same LoRA
   model and micro-batches, a plain loop of backbone forward, LM head on the completion
   positions, mean cross-entropy of the completion tokens, backward, clip, AdamW step: no
   packing, no advantages, no ratios, no stats.

TRL's loop drives the run: at the end of each of its rounds, a ``TrainerCallback`` runs one
round of ours and one of bare (alternating which goes first), so slow drift of the machine lands
on all three alike. TRL's round time is its wall time between these callbacks (its data loading,
input preparation and logging included); the first ``--warmup`` rounds of each are left out.
Throughput = completion tokens trained / seconds, the work every trainer does alike (the
prompt + completion tokens per second printed beside it count the sequences as TRL and bare
forward them; ours forwards fewer: each prompt once per group). The headline
is each trainer's best measured round (interference only ever adds time; the median and worst
rounds are printed beside it). On CUDA
every clock read is preceded by ``torch.cuda.synchronize()``.

Memory (``--memory``)
--------------------
Peak resident memory of one round, chunked LM head (learner/batch.py: ``LOGPROB_CHUNK``
positions at a time, each chunk checkpointed) against the whole-micro-batch head it replaced
(every completion position's float32 logits and log-softmax kept for backward), at each round
size of ``--memory-groups`` (default 16 and 64 groups of ``--group-size`` x ``--completion-len``
tokens, 256 by default)::

    .venv/bin/python bench/learner_step.py --memory [--memory-groups 16,64]

Each (round size, head) pair runs in a fresh subprocess (``ru_maxrss`` is a high-water mark of
the whole process): it loads the model, builds the synthetic round (behaviour logprobs set to a
constant: the memory of a step does not depend on their values), records ``ru_maxrss``, trains
one round of ``--steps`` optimizer steps with ``LearnerSettings``' ``micro_batch_tokens`` and
records it again. Printed: the peaks, the training's share above the loaded model, and
chunked / unchunked.
Results go to ``--out`` as ``learner_memory.json``.

Results go to ``--out`` as ``learner_step.json`` and, when matplotlib is installed,
``learner_step.png``. On a shared CPU, the 1-minute load average before and after is recorded;
by default the CPU run uses as many threads as the load average leaves cores free (at least
one): OpenMP threads spinning against other busy processes are many times slower than fewer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from learner.batch import pack_groups, token_logprobs  # noqa: E402
from learner.loss import group_advantages  # noqa: E402
from learner.trainer import LoraGRPOLearner  # noqa: E402
from ratchet.records import Sample, ScoredGroup  # noqa: E402
from ratchet.settings import LearnerSettings, LoraSettings, LossSettings  # noqa: E402

console = Console(width=max(120, shutil.get_terminal_size((120, 40)).columns))
DEFAULTS = LearnerSettings()
METHODS = ("ours", "trl", "bare")


@dataclass
class Timings:
    rounds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})


def add_round_shape(parser: argparse.ArgumentParser) -> None:
    """The synthetic round's shape (:func:`synthetic_groups`) as the learner's comparison benches
    take it (bench/learner_precision.py, bench/learner_sharding.py), and ``--model-path``."""
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per learner")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per round")
    parser.add_argument("--seed", type=int, default=0)


def synthetic_groups(args: argparse.Namespace, vocab: int) -> list[ScoredGroup]:
    gen = torch.Generator().manual_seed(args.seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for i in range(args.groups):
        samples = [
            Sample(message={}, text="", token_ids=ids(args.completion_len), logprobs=[])
            for _ in range(args.group_size)
        ]
        groups.append(
            ScoredGroup(
                group_id=f"bench-{i}",
                alias="bench",
                version=0,
                response_model="bench",
                prompt_messages=[],
                prompt_token_ids=ids(args.prompt_len),
                samples=samples,
                rewards=torch.rand(args.group_size, generator=gen).tolist(),
                traffic_request_id=f"bench-{i}",
            )
        )
    return groups


def with_behaviour_logprobs(learner: LoraGRPOLearner, groups: list[ScoredGroup]) -> None:
    """The base model's logprobs of the completions (a fresh LoRA is the identity)."""
    for group in groups:
        for sample in group.samples:  # placeholders, so that pack_groups accepts the samples
            sample.logprobs = [0.0] * len(sample.token_ids)
        batch = pack_groups([group], learner.train.loss.scale_rewards).to(learner.device)
        with torch.no_grad(), learner._autocast():
            lp = token_logprobs(learner.model, batch).float().cpu()[0]
        segments = batch.segment_ids[0].cpu()
        for k, sample in enumerate(group.samples):
            sample.logprobs = lp[segments == k + 1].tolist()


def sequences(groups: list[ScoredGroup]) -> torch.Tensor:
    """(samples, prompt + completion) token ids, one row per sample, as TRL and bare see them."""
    return torch.tensor([g.prompt_token_ids + s.token_ids for g in groups for s in g.samples])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- bare ---------------------------------------------------------------------------------------


class BareLoop:
    """Forward + backward + AdamW on the same tokens, and nothing else."""

    def __init__(self, learner: LoraGRPOLearner, groups: list[ScoredGroup], args: Any) -> None:
        self.learner = learner
        self.ids = sequences(groups).to(learner.device)  # fixed lengths: no padding
        self.prompt_len = args.prompt_len
        self.steps, self.micro = args.steps, args.micro_batch
        causal_lm = learner.model.get_base_model()
        self.backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.head = causal_lm.get_output_embeddings()

    def round(self) -> None:
        n = self.ids.shape[0]
        order = torch.randperm(n, device=self.ids.device)
        learner, p = self.learner, self.prompt_len
        for step_rows in torch.tensor_split(order, self.steps):
            chunks = torch.split(step_rows, self.micro)
            for rows in chunks:
                ids = self.ids[rows]
                with learner._autocast():
                    hidden = self.backbone(input_ids=ids, use_cache=False).last_hidden_state
                    # 2-D into the head: a strided 3-D view would take a batched-matmul path
                    positions = hidden[:, p - 1 : -1].reshape(-1, hidden.shape[-1])
                    logits = self.head(positions).float()
                loss = F.cross_entropy(logits, ids[:, p:].flatten())
                (loss / len(chunks)).backward()
            torch.nn.utils.clip_grad_norm_(learner.params, learner.train.max_grad_norm or math.inf)
            learner.optimizer.step()
            learner.optimizer.zero_grad(set_to_none=True)


# ---- TRL ----------------------------------------------------------------------------------------


def trl_inputs(groups: list[ScoredGroup], loss: LossSettings, device: torch.device) -> dict:
    """The fixed round as the dict TRL's _generate_and_score_completions returns."""
    ids = sequences(groups)
    p = len(groups[0].prompt_token_ids)
    rewards = torch.tensor([r for g in groups for r in g.rewards])
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    completion_mask = torch.ones_like(ids[:, p:])
    out = {
        "prompt_ids": ids[:, :p],
        "prompt_mask": torch.ones_like(ids[:, :p]),
        "completion_ids": ids[:, p:],
        "completion_mask": completion_mask,
        "advantages": group_advantages(rewards, group_ids, loss.scale_rewards).float(),
        "old_per_token_logps": torch.tensor([s.logprobs for g in groups for s in g.samples]),
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in out.items()}


def build_trl(
    args: argparse.Namespace,
    model_path: Path,
    lora: LoraSettings,
    train: LearnerSettings,
    lora_targets: list[str],
    inputs: dict,
    callback: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    class FixedBatchGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs_: Any) -> dict:  # no rollout
            return dict(inputs)

    samples = args.groups * args.group_size
    per_step = samples // args.steps
    accumulation = per_step // args.micro_batch
    config = GRPOConfig(
        output_dir=str(args.out / ".trl-tmp"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * args.steps,
        num_generations=args.group_size,
        num_iterations=1,
        max_steps=(args.warmup + args.rounds) * args.steps,
        learning_rate=train.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        optim="adamw_torch_fused",
        loss_type="dapo",
        beta=train.loss.kl_beta,
        epsilon=train.loss.epsilon_low,
        epsilon_high=train.loss.epsilon_high,
        scale_rewards=train.loss.scale_rewards,
        max_completion_length=args.completion_len,
        gradient_checkpointing=False,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        use_cpu=device.type == "cpu",
        logging_steps=args.steps,
        report_to="none",
        save_strategy="no",
        seed=train.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    peft_config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(args.groups)]})
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return FixedBatchGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[callback],
    )


def make_callback(
    args: argparse.Namespace, others: dict[str, Any], timings: Timings, device: torch.device
) -> Any:
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        """Close TRL's round at its last step, run ours and bare, restart TRL's clock."""

        def __init__(self) -> None:
            self.clock = 0.0
            self.round = 0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            sync(device)
            self.clock = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            if state.global_step % args.steps:
                return
            sync(device)
            timings.rounds["trl"].append(time.perf_counter() - self.clock)
            order = ("ours", "bare") if self.round % 2 == 0 else ("bare", "ours")
            for name in order:
                start = time.perf_counter()
                others[name]()
                sync(device)
                timings.rounds[name].append(time.perf_counter() - start)
            self.round += 1
            label = " ".join(f"{m} {timings.rounds[m][-1]:.2f}s" for m in METHODS)
            console.print(f"round {self.round}/{args.warmup + args.rounds}: {label}")
            sync(device)
            self.clock = time.perf_counter()

    return Interleave()


# ---- reporting ----------------------------------------------------------------------------------


def summarise(args: argparse.Namespace, timings: Timings) -> dict[str, Any]:
    """Per trainer: the best measured round (interference on a shared machine only ever adds
    time, so the fastest round is the closest to the trainer's own cost, as timeit takes the
    minimum), the median round, and all measured rounds together. Ratios use the best rounds."""
    completion = args.groups * args.group_size * args.completion_len
    total = args.groups * args.group_size * (args.prompt_len + args.completion_len)
    out: dict[str, Any] = {}
    for m in METHODS:
        measured = timings.rounds[m][args.warmup :]
        out[m] = {
            "round_seconds": timings.rounds[m],
            "measured_seconds": measured,
            "completion_tokens_per_round": completion,
            "tokens_per_round": total,
            "completion_tokens_per_s": completion / min(measured),
            "tokens_per_s": total / min(measured),
            "completion_tokens_per_s_median": completion / statistics.median(measured),
            "completion_tokens_per_s_all_rounds": completion * len(measured) / sum(measured),
            "completion_tokens_per_s_worst": completion / max(measured),
        }
    for a, b in (("ours", "trl"), ("ours", "bare"), ("trl", "bare")):
        best = out[a]["completion_tokens_per_s"] / out[b]["completion_tokens_per_s"]
        median = out[a]["completion_tokens_per_s_median"] / out[b]["completion_tokens_per_s_median"]
        out[f"ratio_{a}_over_{b}"] = best
        out[f"ratio_{a}_over_{b}_median"] = median
    return out


def print_table(args: argparse.Namespace, summary: dict[str, Any], device: str) -> None:
    table = Table(
        title=f"GRPO learner step on {device}: {args.groups}x{args.group_size} samples, "
        f"{args.prompt_len}+{args.completion_len} tokens, {args.steps} steps/round, "
        f"{args.rounds} measured rounds"
    )
    columns = (
        "trainer",
        "completion tok/s (best)",
        "median",
        "worst",
        "all tok/s (best)",
        "s/round (best)",
        "ours ÷ this",
    )
    for col in columns:
        table.add_column(col, justify="right" if col != "trainer" else "left")
    names = {"ours": "ours (LoraGRPOLearner)", "trl": "TRL GRPOTrainer", "bare": "bare fwd+bwd"}
    ours = summary["ours"]["completion_tokens_per_s"]
    for m in METHODS:
        s = summary[m]
        table.add_row(
            names[m],
            f"{s['completion_tokens_per_s']:.1f}",
            f"{s['completion_tokens_per_s_median']:.1f}",
            f"{s['completion_tokens_per_s_worst']:.1f}",
            f"{s['tokens_per_s']:.1f}",
            f"{min(s['measured_seconds']):.2f}",
            f"{ours / s['completion_tokens_per_s']:.2f}x",
        )
    console.print(table)
    console.print(
        "best rounds: "
        f"ours / TRL = {summary['ratio_ours_over_trl']:.2f}   "
        f"ours / bare = {summary['ratio_ours_over_bare']:.2f}   "
        f"TRL / bare = {summary['ratio_trl_over_bare']:.2f}   "
        f"(median rounds: {summary['ratio_ours_over_trl_median']:.2f}, "
        f"{summary['ratio_ours_over_bare_median']:.2f}, "
        f"{summary['ratio_trl_over_bare_median']:.2f})"
    )


def write_plot(out: Path, args: argparse.Namespace, summary: dict[str, Any]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no PNG written")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    completion = summary["ours"]["completion_tokens_per_round"]
    for i, m in enumerate(METHODS):
        ax.bar(i, summary[m]["completion_tokens_per_s"], color=f"C{i}", alpha=0.7)  # best round
        rates = [completion / s for s in summary[m]["measured_seconds"]]
        ax.plot([i] * len(rates), rates, "k.", markersize=6)
    ax.set_xticks(range(len(METHODS)), ["ours", "TRL GRPOTrainer", "bare fwd+bwd"])
    ax.set_ylabel("completion tokens / s (bar: best round, dots: rounds)")
    ax.set_title(
        f"GRPO step, {args.model_name} on {args.device_name}\n"
        f"{args.groups}x{args.group_size} samples, {args.prompt_len}+{args.completion_len} "
        f"tokens, LoRA r={args.rank}; ours/TRL = {summary['ratio_ours_over_trl']:.2f}",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "learner_step.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def metadata(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    import peft
    import transformers
    import trl

    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl.__version__,
        "device": args.device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "load_avg_start": os.getloadavg()[0],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


# ---- memory -------------------------------------------------------------------------------------


def _whole_head_logprobs(
    head: Any,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """The head as it was before chunking: every completion position at once, kept for
    backward."""
    return -F.cross_entropy(head(hidden[rows, sources]).float(), targets, reduction="none")


def max_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_child(args: argparse.Namespace) -> int:
    """One round in this fresh process; prints its peaks as one JSON line."""
    import learner.batch as batch_module

    if args.memory_child == "unchunked":
        batch_module._chunked_head_logprobs = _whole_head_logprobs  # type: ignore[assignment]
    settings = LearnerSettings(seed=args.seed, steps_per_round=args.steps)
    learner = LoraGRPOLearner(args.model_path, settings.lora, settings, device="cpu")
    groups = synthetic_groups(args, learner.model.get_base_model().config.vocab_size)
    for group in groups:
        for sample in group.samples:
            sample.logprobs = [-2.0] * len(sample.token_ids)
    loaded = max_rss_mib()
    stats = learner.train_round(groups)
    result = {
        "head": args.memory_child,
        "groups": args.groups,
        "loaded_mib": loaded,
        "peak_mib": max_rss_mib(),
        "completion_tokens": stats.completion_tokens,
        "steps": stats.steps,
        "seconds": stats.seconds,
        "micro_batch_tokens": settings.micro_batch_tokens,
        "logprob_chunk": batch_module.LOGPROB_CHUNK,
    }
    print(json.dumps(result))
    return 0


def memory_bench(args: argparse.Namespace) -> int:
    """Each round size, unchunked then chunked head, each in a fresh subprocess."""
    import subprocess

    runs = []
    for groups in args.memory_groups:
        for head in ("unchunked", "chunked"):
            command = [
                sys.executable, __file__, "--memory-child", head, "--groups", str(groups),
                "--group-size", str(args.group_size), "--prompt-len", str(args.prompt_len),
                "--completion-len", str(args.completion_len), "--seed", str(args.seed),
                "--model-path", str(args.model_path), "--threads", str(args.threads),
                "--steps", str(args.steps),
            ]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                console.print(f"[red]{head} x {groups} groups failed:[/]\n{out.stderr[-3000:]}")
                return 1
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(run)
            console.print(
                f"{groups} groups, {head}: peak {run['peak_mib']:.0f} MiB "
                f"(model loaded {run['loaded_mib']:.0f} MiB), {run['seconds']:.0f} s"
            )
    table = Table(title="peak resident memory of one round (ru_maxrss, fresh process each)")
    for column in ("groups", "completion tokens", "unchunked MiB", "chunked MiB",
                   "training: unchunked", "training: chunked", "chunked / unchunked"):  # fmt: skip
        table.add_column(column, justify="right")
    summary = []
    for groups in args.memory_groups:
        old, new = (next(r for r in runs if r["groups"] == groups and r["head"] == h)
                    for h in ("unchunked", "chunked"))  # fmt: skip
        row = {
            "groups": groups,
            "unchunked_peak_mib": old["peak_mib"],
            "chunked_peak_mib": new["peak_mib"],
            "unchunked_training_mib": old["peak_mib"] - old["loaded_mib"],
            "chunked_training_mib": new["peak_mib"] - new["loaded_mib"],
            "ratio_chunked_over_unchunked": new["peak_mib"] / old["peak_mib"],
        }
        summary.append(row)
        table.add_row(
            str(groups), str(new["completion_tokens"]), f"{old['peak_mib']:.0f}",
            f"{new['peak_mib']:.0f}", f"{row['unchunked_training_mib']:.0f}",
            f"{row['chunked_training_mib']:.0f}", f"{row['ratio_chunked_over_unchunked']:.2f}",
        )  # fmt: skip
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "learner_memory.json"
    meta = {"load_avg": os.getloadavg()[0], "torch": torch.__version__, "cpus": os.cpu_count()}
    path.write_text(json.dumps({"meta": meta, "runs": runs, "summary": summary}, indent=2))
    console.print(f"wrote {path}")
    return 0


# ---- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="a safetensors model folder (default on CPU: the embedded SmolLM2)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--groups", type=int, default=None, help="default: 4 on CPU, 8 on CUDA")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 32 CPU, 64 CUDA")
    parser.add_argument("--completion-len", type=int, default=None, help="default: 32 CPU, 64 CUDA")
    parser.add_argument(
        "--steps", type=int, default=DEFAULTS.steps_per_round, help="optimizer steps per round"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (default: all of a step)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured rounds per trainer (3 CPU, 5 CUDA)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per trainer")
    parser.add_argument("--rank", type=int, default=DEFAULTS.lora.rank)
    parser.add_argument("--alpha", type=int, default=DEFAULTS.lora.alpha)
    parser.add_argument("--lr", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads (0: the cores the load average leaves)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--memory", action="store_true", help="peak memory of one round, chunked vs unchunked"
    )
    parser.add_argument(
        "--memory-groups",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[16, 64],
        help="round sizes of --memory, comma-separated",
    )
    parser.add_argument("--memory-child", choices=("chunked", "unchunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory or args.memory_child:  # one round as the learner runs it, on the CPU
        args.device = "cpu"
        args.prompt_len = args.prompt_len or 64
        args.completion_len = args.completion_len or 256
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    args.groups = args.groups or (8 if gpu else 4)
    args.rounds = args.rounds or (5 if gpu else 3)
    args.prompt_len = args.prompt_len or (64 if gpu else 32)
    args.completion_len = args.completion_len or (64 if gpu else 32)
    samples = args.groups * args.group_size
    if samples % args.steps:
        parser.error(f"--steps must divide the {samples} samples of a round")
    args.micro_batch = args.micro_batch or samples // args.steps
    if (samples // args.steps) % args.micro_batch:
        parser.error("--micro-batch must divide the samples of a step")
    if args.model_path is None:
        if gpu:
            parser.error("--model-path is required with --device cuda")
        from embedded.model import prepare_model
        from ratchet.settings import default_home

        args.model_path = prepare_model(default_home(), quiet=True)
    return args


def main() -> int:
    args = parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.device == "cpu":
        # OpenMP threads that spin against other busy processes are far slower than fewer.
        free = (os.cpu_count() or 1) - round(os.getloadavg()[0])
        torch.set_num_threads(args.threads or max(1, min(torch.get_num_threads(), free)))
    if args.memory_child:
        return memory_child(args)
    if args.memory:
        return memory_bench(args)
    device = torch.device(args.device)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    args.device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    )
    args.model_name = args.model_path.name
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args, device, dtype)
    console.print(f"[bold]learner step[/] {args.model_name} on {args.device_name}, {meta['dtype']}")

    samples = args.groups * args.group_size
    seq_len = args.prompt_len + args.completion_len
    settings = LearnerSettings(
        learning_rate=args.lr,
        steps_per_round=args.steps,
        micro_batch_tokens=args.micro_batch * seq_len,
        lora=LoraSettings(rank=args.rank, alpha=args.alpha),
        seed=args.seed,
    )
    lora, train = settings.lora, settings
    ours = LoraGRPOLearner(args.model_path, lora, train, device=args.device, dtype=dtype)
    bare_learner = LoraGRPOLearner(args.model_path, lora, train, device=args.device, dtype=dtype)
    vocab = ours.model.get_base_model().config.vocab_size
    groups = synthetic_groups(args, vocab)
    with_behaviour_logprobs(ours, groups)
    bare = BareLoop(bare_learner, groups, args)
    timings = Timings()
    others = {"ours": lambda: ours.train_round(groups), "bare": bare.round}
    callback = make_callback(args, others, timings, device)
    trainer = build_trl(
        args,
        args.model_path,
        lora,
        train,
        list(ours.target_modules),
        trl_inputs(groups, train.loss, device),
        callback,
        dtype,
        device,
    )
    console.print(
        f"{samples} samples x {seq_len} tokens a round, {args.steps} steps, micro-batch "
        f"{args.micro_batch} seqs (TRL: accumulation {trainer.args.gradient_accumulation_steps}, "
        f"steps_per_generation {trainer.args.steps_per_generation}); "
        f"{args.warmup} warm-up + {args.rounds} measured rounds each"
    )
    trainer.train()
    shutil.rmtree(args.out / ".trl-tmp", ignore_errors=True)

    meta["load_avg_end"] = os.getloadavg()[0]
    meta["ours_last_round"] = ours.last_round.as_dict() if ours.last_round else None
    summary = summarise(args, timings)
    print_table(args, summary, args.device_name)
    path = args.out / "learner_step.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2, default=str))
    console.print(f"wrote {path}")
    plot = write_plot(args.out, args, summary)
    if plot:
        console.print(f"wrote {plot}")
    if any(not math.isfinite(summary[m]["completion_tokens_per_s"]) for m in METHODS):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

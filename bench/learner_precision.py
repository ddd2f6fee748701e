"""The learner's round on each device and in each precision: its speed, and what it does to the
update.

Run it from the repository root (the embedded SmolLM2 on this CPU; on a GPU machine add ``cuda``
and give the model folder)::

    .venv/bin/python bench/learner_precision.py --rounds 3
    python bench/learner_precision.py --devices cpu,cuda --model-path DIR

One learner per (device, precision) of ``--devices`` x ``--precisions``: ``learner.precision``
``fp32``, or ``bf16`` (autocast; on a CPU the weights, LoRA and AdamW stay float32, on a GPU the
frozen base is bfloat16). All start from the same base and the same LoRA initialisation (seeded,
drawn on the CPU before the move to the device) and train the same synthetic round
(bench/learner_step.py's groups, the first learner's base logprobs as the behaviour policy):
one unmeasured round each, then ``--rounds`` measured ones in turns (A B C, C B A, ...) so that
drift in the machine's speed lands on all alike. Every round is a real round: round k of each
learner starts where its round k-1 left it, so their losses compare round by round.

The first learner (``cpu``/``fp32`` by default) is the reference. For every other learner:
completion tokens per second (median of its measured rounds) and x the reference's, each round's
loss, and how its adapter's update (trained weights minus the initial ones) compares with the
reference's after the first round and after the last: the cosine of the two directions and the
norm of their difference over the reference's norm. Also printed: whether this CPU computes
bfloat16 natively (where it does not, torch emulates it, far slower). Writes
``--out`` (JSON) and, with matplotlib, a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learner_step import (  # noqa: E402
    add_round_shape,
    synthetic_groups,
    with_behaviour_logprobs,
)
from learner.trainer import (  # noqa: E402
    LoraGRPOLearner,
    native_bf16_cpu,
)
from ratchet.settings import LearnerSettings  # noqa: E402

PRECISIONS = ("fp32", "bf16")


@dataclass
class Run:
    """One (device, precision) learner and what its rounds measured."""

    device: str
    precision: str
    learner: LoraGRPOLearner
    initial: torch.Tensor  # the LoRA weights before any round, flat, float32, on the CPU
    speed: list[float] = field(default_factory=list)  # measured rounds only
    losses: list[float] = field(default_factory=list)  # every round, the unmeasured first too
    updates: list[torch.Tensor] = field(default_factory=list)  # after round 1, after the last

    @property
    def name(self) -> str:
        return f"{self.device}/{self.precision}"


def adapter_weights(learner: LoraGRPOLearner) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().flatten() for p in learner.params])


def agreement(update: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(cosine of the two update directions, |update - reference| / |reference|): 1 and 0 for
    the same update; a cosine near 1 with a large relative difference is the same direction
    at another length."""
    update, reference = update.double(), reference.double()  # float32 sums drift by 1e-3
    norm, other = float(reference.norm()), float(update.norm())
    if norm == 0 or other == 0:  # no update to compare: no direction
        return float("nan"), float("nan")
    return float(update @ reference) / (other * norm), float((update - reference).norm()) / norm


def turns(count: int, rounds: int) -> list[int]:
    """Indices of the learners in the order their measured rounds run: forwards, then back."""
    order: list[int] = []
    for measured in range(rounds):
        forwards = list(range(count))
        order += forwards if measured % 2 == 0 else forwards[::-1]
    return order


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--devices",
        type=lambda text: text.split(","),
        default=["cpu"],
        help="comma-separated: cpu, cuda (the first device's first precision is the reference)",
    )
    parser.add_argument("--precisions", type=lambda text: text.split(","), default=list(PRECISIONS))
    add_round_shape(parser)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/learner_precision.json")
    args = parser.parse_args()
    for device in args.devices:
        if device not in ("cpu", "cuda"):
            parser.error(f"--devices: {device!r} is neither cpu nor cuda")
        if device == "cuda" and not torch.cuda.is_available():
            parser.error("--devices names cuda, and torch sees no GPU here")
    for precision in args.precisions:
        if precision not in PRECISIONS:
            parser.error(f"--precisions: {precision!r} is neither fp32 nor bf16")
    if args.model_path is None:
        from embedded.model import prepare_model
        from ratchet.settings import default_home

        args.model_path = prepare_model(default_home(), quiet=True)
    return args


def build_runs(args: argparse.Namespace) -> list[Run]:
    runs = []
    for device in args.devices:
        for precision in args.precisions:
            settings = LearnerSettings(
                precision=precision, steps_per_round=args.steps, seed=args.seed
            )
            learner = LoraGRPOLearner(args.model_path, settings.lora, settings, device)
            runs.append(Run(device, precision, learner, adapter_weights(learner)))
    return runs


def train(runs: list[Run], args: argparse.Namespace) -> None:
    vocab = runs[0].learner.model.get_base_model().config.vocab_size
    groups = synthetic_groups(args, vocab)
    with_behaviour_logprobs(runs[0].learner, groups)
    for run in runs:  # unmeasured: allocations, kernels picked; its update is compared
        run.losses.append(run.learner.train_round(groups).loss)
        run.updates.append(adapter_weights(run.learner) - run.initial)
    for index in turns(len(runs), args.rounds):
        stats = runs[index].learner.train_round(groups)
        runs[index].speed.append(stats.tokens_per_second)
        runs[index].losses.append(stats.loss)
    for run in runs:
        run.updates.append(adapter_weights(run.learner) - run.initial)


def summarise(runs: list[Run], args: argparse.Namespace) -> dict:
    reference = runs[0]
    base = statistics.median(reference.speed)
    rows = []
    for run in runs:
        first = agreement(run.updates[0], reference.updates[0])
        last = agreement(run.updates[-1], reference.updates[-1])
        rows.append(
            {
                "learner": run.name,
                "tokens_per_second": run.speed,
                "median_tokens_per_second": statistics.median(run.speed),
                "x_reference": statistics.median(run.speed) / base,
                "losses": run.losses,
                "update_cosine_round_1": first[0],
                "update_rel_diff_round_1": first[1],
                "update_cosine_last": last[0],
                "update_rel_diff_last": last[1],
            }
        )
    gpu = torch.cuda.get_device_name() if "cuda" in args.devices else None
    return {
        "reference": reference.name,
        "cpu_cores": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "native_bf16_cpu": native_bf16_cpu(),
        "gpu": gpu,
        "torch": torch.__version__,
        "round": {
            "groups": args.groups,
            "group_size": args.group_size,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "steps": args.steps,
            "measured_rounds": args.rounds,
        },
        "learners": rows,
    }


def print_table(result: dict, console: Console) -> None:
    shape = result["round"]
    table = Table(
        title=f"learner rounds of {shape['groups']}x{shape['group_size']} samples, "
        f"{shape['prompt_len']}+{shape['completion_len']} tokens, {shape['steps']} steps; "
        f"reference {result['reference']}"
    )
    for column in (
        "learner",
        "tokens/s (median)",
        "x ref",
        "round losses",
        "update cos / rel diff, round 1",
        "last round",
    ):
        table.add_column(column)
    for row in result["learners"]:
        table.add_row(
            row["learner"],
            f"{row['median_tokens_per_second']:.1f}",
            f"{row['x_reference']:.2f}",
            ", ".join(f"{v:.5f}" for v in row["losses"]),
            f"{row['update_cosine_round_1']:.5f} / {row['update_rel_diff_round_1']:.2e}",
            f"{row['update_cosine_last']:.5f} / {row['update_rel_diff_last']:.2e}",
        )
    console.print(table)
    console.print(
        f"CPU: {result['cpu_cores']} cores, {result['cpu_threads']} threads, native bfloat16 "
        f"{result['native_bf16_cpu']}; GPU: {result['gpu']}; torch {result['torch']}"
    )


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = result["learners"]
    fig, (speed, loss) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["learner"] for r in rows]
    speed.bar(names, [r["median_tokens_per_second"] for r in rows], color="tab:blue")
    speed.set_yscale("log")
    speed.set_ylabel("completion tokens / s (median round, log)")
    speed.set_title("speed")
    for row in rows:
        loss.plot(range(1, len(row["losses"]) + 1), row["losses"], marker="o", label=row["learner"])
    loss.set_xlabel("round (the first unmeasured)")
    loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole
    loss.set_ylabel("round loss")
    loss.set_title("the same round, round by round")
    loss.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    console = Console()
    runs = build_runs(args)
    train(runs, args)
    result = summarise(runs, args)
    print_table(result, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Does bfloat16 make the learner's rounds faster here, and what does it do to the loss?

Run it from the repository root (the embedded SmolLM2 on the CPU, or ``--device cuda
--model-path DIR`` on a GPU)::

    .venv/bin/python bench/learner_precision.py --rounds 3

Two learners from the same start, one with ``learner.precision: fp32`` and one with ``bf16``
(autocast; on a CPU the weights, LoRA and AdamW stay float32), train the same synthetic round
(bench/learner_step.py's groups, the base's own logprobs as the behaviour policy) in turns, A B
B A, after one unmeasured round each. Prints tokens per second of each with the ratio, the
round losses side by side, and whether this CPU computes bfloat16 natively (``auto`` picks
bf16 only where it does: elsewhere torch emulates it). Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learner_step import synthetic_groups, with_behaviour_logprobs  # noqa: E402
from learner.trainer import (  # noqa: E402
    LoraGRPOLearner,
    lora_settings,
    native_bf16_cpu,
    train_settings,
)
from ratchet.settings import LearnerSettings  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per precision")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/learner_precision.json")
    args = parser.parse_args()
    if args.model_path is None:
        from ratchet.dev.model import prepare_model
        from ratchet.settings import default_home

        args.model_path = prepare_model(default_home(), quiet=True)
    console = Console()
    learners = {}
    for precision in PRECISIONS:
        settings = LearnerSettings(precision=precision, steps_per_round=4, seed=args.seed)
        learners[precision] = LoraGRPOLearner(
            args.model_path, lora_settings(settings), train_settings(settings), args.device
        )
    vocab = learners["fp32"].model.get_base_model().config.vocab_size
    groups = synthetic_groups(args, vocab)
    with_behaviour_logprobs(learners["fp32"], groups)
    for learner in learners.values():
        learner.train_round(groups)  # unmeasured: allocations, kernels picked
    speed: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    losses: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    order: list[str] = []
    for measured in range(args.rounds):  # A B, B A, ...: drift in the machine's speed cancels
        order += PRECISIONS if measured % 2 == 0 else PRECISIONS[::-1]
    for precision in order:
        stats = learners[precision].train_round(groups)
        speed[precision].append(stats.tokens_per_second)
        losses[precision].append(stats.loss)
    table = Table(title=f"learner rounds, fp32 against bf16, on {args.device}")
    for column in ("precision", "tokens/s (median)", "x fp32", "round losses"):
        table.add_column(column)
    base = statistics.median(speed["fp32"])
    for precision in PRECISIONS:
        median = statistics.median(speed[precision])
        shown = ", ".join(f"{v:.4f}" for v in losses[precision])
        table.add_row(precision, f"{median:.1f}", f"{median / base:.2f}", shown)
    console.print(table)
    native = native_bf16_cpu() if args.device == "cpu" else None
    console.print(f"native bfloat16 on this CPU: {native}; threads {torch.get_num_threads()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": args.device,
        "cores": os.cpu_count(),
        "native_bf16_cpu": native,
        "tokens_per_second": speed,
        "losses": losses,
        "bf16_over_fp32": statistics.median(speed["bf16"]) / base,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

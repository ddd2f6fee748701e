"""The learner across ranks: each rank holding the whole base (``learner.sharding: replicate``)
or the decoder layers sharded by FSDP2 (``fsdp``): what a rank holds, how fast a round goes,
and that the rounds are one rank's.

Run it from the repository root (two gloo ranks on this CPU, the embedded SmolLM2; on a machine
with N GPUs, NCCL ranks)::

    .venv/bin/python bench/learner_sharding.py
    python bench/learner_sharding.py --ranks 4 --device cuda --model-path DIR

Three runs of the same synthetic round (bench/learner_step.py's groups, the base's logprobs as
the behaviour policy), each in fresh processes: one rank (the reference), ``--ranks`` ranks
replicating, ``--ranks`` ranks sharded. Each trains one unmeasured round, then ``--rounds``
measured ones. Reported per run: the bytes of weights each rank keeps on its device (its
shards where sharded, exact), its memory (the device's peak on a GPU; on a CPU the resident
set after the rounds, which the allocator may keep high), each rank's peak resident set once
its learner is built (rank 0 reads the checkpoint; a sharded follower should hold only its
shards), completion tokens per second (median,
x the reference's) and the largest difference of its rounds' losses from the reference's. On
one machine's CPU the ranks share its cores (each gets cores / ranks threads), so the speeds
say what gathering layer by layer costs, not what more devices buy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learner_step import (  # noqa: E402
    add_round_shape,
    synthetic_groups,
    with_behaviour_logprobs,
)
from embedded.processes import free_port  # noqa: E402
from learner.parallel import is_sharded  # noqa: E402
from learner.trainer import LoraGRPOLearner  # noqa: E402
from ratchet.settings import LearnerSettings  # noqa: E402

RUNS = (("reference", 1, "replicate"), ("replicate", None, "replicate"), ("fsdp", None, "fsdp"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="build each rank's learner and stop: what loading holds, for a base too large to "
        "train here in minutes",
    )
    add_round_shape(parser)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/learner_sharding.json")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks: at least 2 (one rank is the reference)")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--ranks {args.ranks} on cuda needs as many GPUs; torch sees fewer")
    if args.model_path is None:
        from embedded.model import prepare_model
        from ratchet.settings import default_home

        args.model_path = prepare_model(default_home(), quiet=True)
    return args


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights this rank keeps: its shard of a sharded tensor, else all of it."""
    total = 0
    for param in model.parameters():
        local: Any = param.to_local() if is_sharded(param) else param  # type: ignore[attr-defined]
        total += local.numel() * local.element_size()
    return total


def peak_resident_bytes() -> int:
    """This process's largest resident set so far (Linux counts ``ru_maxrss`` in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(rank: int, ranks: int, sharding: str, port: int, args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // ranks))
    if ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=ranks)
    try:
        settings = LearnerSettings(
            precision="fp32", steps_per_round=args.steps, seed=args.seed, sharding=sharding
        )
        learner = LoraGRPOLearner(args.model_path, settings.lora, settings, args.device)
        loaded_peak = peak_resident_bytes()
        if args.load_only:
            result = {"rank": rank, "sharded": learner.sharded, "loaded_peak_bytes": loaded_peak}
            result["held_bytes"] = held_bytes(learner.model)
            (args.work / f"{sharding}-{ranks}-rank{rank}.json").write_text(json.dumps(result))
            return
        groups = synthetic_groups(args, learner.model.get_base_model().config.vocab_size)
        with_behaviour_logprobs(learner, groups)
        losses = [learner.train_round(groups).loss]  # unmeasured
        speed = []
        for _ in range(args.rounds):
            stats = learner.train_round(groups)
            losses.append(stats.loss)
            speed.append(stats.tokens_per_second)
        memory = torch.cuda.max_memory_allocated() if args.device == "cuda" else resident_bytes()
        result = {
            "rank": rank,
            "sharded": learner.sharded,
            "held_bytes": held_bytes(learner.model),
            "memory_bytes": memory,
            "loaded_peak_bytes": loaded_peak,
            "losses": losses,
            "tokens_per_second": speed,
        }
        (args.work / f"{sharding}-{ranks}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        if ranks > 1:
            dist.destroy_process_group()


def run(name: str, ranks: int, sharding: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with Console().status(f"{name}: {ranks} rank(s), learner.sharding {sharding}"):
        mp.spawn(rank_main, args=(ranks, sharding, free_port(), args), nprocs=ranks, join=True)
    files = [args.work / f"{sharding}-{ranks}-rank{r}.json" for r in range(ranks)]
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    args = parse_args()
    console = Console()
    args.work = Path(tempfile.mkdtemp(prefix="ratchet-sharding-"))
    results = {name: run(name, ranks or args.ranks, mode, args) for name, ranks, mode in RUNS}
    if args.load_only:
        print_loading(results, args)
        return
    reference = results["reference"][0]
    base_speed = statistics.median(reference["tokens_per_second"])
    table = Table(title=f"One learner round over {args.ranks} {args.device} ranks, two ways")
    for column in ("run", "ranks", "weights held per rank (MB)", "memory per rank (MB)",
                   "peak loading, rank 0 / others (MB)", "tokens/s", "x one rank",
                   "max |loss - one rank's|"):  # fmt: skip
        table.add_column(column)
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for name, ranked in results.items():
        speed = statistics.median(ranked[0]["tokens_per_second"])
        drift = max(
            abs(a - b)
            for r in ranked
            for a, b in zip(r["losses"], reference["losses"], strict=True)
        )
        row = {
            "ranks": len(ranked),
            "sharded": ranked[0]["sharded"],
            "held_mb": max(r["held_bytes"] for r in ranked) / 2**20,
            "memory_mb": max(r["memory_bytes"] for r in ranked) / 2**20,
            "loaded_peak_mb": [r["loaded_peak_bytes"] / 2**20 for r in ranked],
            "tokens_per_second": speed,
            "x_reference": speed / base_speed,
            "max_loss_difference": drift,
            "losses": ranked[0]["losses"],
        }
        summary["runs"][name] = row
        table.add_row(
            name,
            str(row["ranks"]),
            f"{row['held_mb']:.0f}",
            f"{row['memory_mb']:.0f}",
            " / ".join(
                f"{mb:.0f}"
                for mb in (row["loaded_peak_mb"][0], max(row["loaded_peak_mb"][1:], default=None))
                if mb is not None
            ),
            f"{speed:.0f}",
            f"{row['x_reference']:.2f}",
            f"{drift:.1e}",
        )
    console.print(table)
    fsdp, replicate = summary["runs"]["fsdp"], summary["runs"]["replicate"]
    console.print(
        f"weights held per rank, fsdp / replicate: {fsdp['held_mb'] / replicate['held_mb']:.2f}; "
        f"tokens/s, fsdp / replicate: "
        f"{fsdp['tokens_per_second'] / replicate['tokens_per_second']:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    console.print(f"results: {args.out}")


def print_loading(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    table = Table(title=f"Loading {args.model_path.name} on {args.ranks} {args.device} ranks")
    for column in ("run", "ranks", "weights held per rank (MB)", "peak RSS loading, rank 0 (MB)",
                   "peak RSS loading, other ranks (MB)"):  # fmt: skip
        table.add_column(column)
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for name, ranked in results.items():
        peaks = [r["loaded_peak_bytes"] / 2**20 for r in ranked]
        held = max(r["held_bytes"] for r in ranked) / 2**20
        summary["runs"][name] = {"ranks": len(ranked), "held_mb": held, "loaded_peak_mb": peaks}
        others = f"{max(peaks[1:]):.0f}" if len(peaks) > 1 else "-"
        table.add_row(name, str(len(ranked)), f"{held:.0f}", f"{peaks[0]:.0f}", others)
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

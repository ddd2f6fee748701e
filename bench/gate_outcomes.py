"""How many held-out pairs does the gate need to pass a real gain, by the outcome it tests?

The gate counts a verifier alias's pairs as wins, losses and ties (learner/gate.py). The
alternative tried here is the paired score difference mapped onto [0, 1], ``(1 + c - b) / 2``,
which keeps the size of a graded verifier's differences. Measured on the demo task's real
candidate (lift +0.227 on 64 unseen prompts, 27% ties): both pass every gate, the ranking at a
median of 32 pairs and the difference at 58 (false passes 0.4% and 0.0% at alpha 0.05). The
difference halves the mean's distance from 0.5 (it is half the lift, where the ranking's is
half the share of wins less losses), and the sequential test's bets are capped at 1/2, so its
lower variance cannot make up for it. So the gate keeps the ranking.

Run it from the repository root on a task home that ``bench/loop_speed.py --home`` kept (its
store holds the candidates a run trained)::

    nice -n 19 .venv/bin/python bench/gate_outcomes.py --home /tmp/ls/demo --task demo --version 2

Method
------
1. pairs: vLLM (the embedded stack's part alone, on the home's adapter store) answers the task's
   last ``--prompts`` prompts (64: those loop_speed.py never sent) greedily, as the base model
   and as ``<task>@v<version>``; the task's verifier scores each answer (what the gate does, on
   prompts no round trained on);
2. each pair gives two outcomes in [0, 1]: the ranking outcome (1 better, 0 worse, 0.5 a tie:
   the gate's verifier outcome) and the score difference ``(1 + c - b) / 2``;
3. ``--runs`` gates per outcome, each on a stream of ``gate.max_pairs`` pairs drawn with
   replacement from the measured ones, decided by the gate's own sequential test
   (``learner.gate.decide``, the default GateConfig): the share that pass and the pairs each
   took;
4. the null: the same streams with each pair's two answers swapped at random (a candidate no
   better than the base, with the same spread of differences): the share that pass must stay
   within ``gate.alpha`` for both outcomes.

Prints a table with the ratio of the two; writes ``--out`` (JSON) and a plot beside it (the share
of gates passed by each pair count, per outcome).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.demo_learning import BASE, VLLM, evaluate
from embedded.model import prepare_model
from learner.gate_scoring import verifier_outcome
from learner.gate_verdict import decide
from ratchet.settings import GateConfig, default_home
from tasks import Task, get_task


def score_difference(candidate: float, base: float) -> float:
    return (1.0 + candidate - base) / 2.0


OUTCOMES = {"ranking": verifier_outcome, "score difference": score_difference}


def answer_pairs(
    vllm: VLLM, task: Task, version: int, prompts: list[dict[str, Any]], max_tokens: int
) -> tuple[list[float], list[float]]:
    """The verifier's scores of the base's and the candidate's greedy answers, per prompt."""
    scores = []
    for served in (BASE, f"{task.name}@v{version}"):
        result = vllm.run(
            lambda served=served: evaluate(  # type: ignore[misc]
                vllm.url, served, prompts, max_tokens, vllm.headers, task.reward(), None
            )
        )
        scores.append(result.scores)
    return scores[0], scores[1]


def gates(
    base: list[float], candidate: list[float], runs: int, gate: GateConfig, null: bool, seed: int
) -> dict[str, dict[str, Any]]:
    """Per outcome: the share of ``runs`` gates that pass, and the pairs each gate used."""
    rng = random.Random(seed)
    streams = []
    for _ in range(runs):
        picks = [rng.randrange(len(base)) for _ in range(gate.max_pairs)]
        swaps = [null and rng.random() < 0.5 for _ in picks]
        streams.append(
            [(base[i], candidate[i]) if s else (candidate[i], base[i]) for i, s in zip(
                picks, swaps, strict=True)]
        )  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for name, outcome in OUTCOMES.items():
        results = [decide([outcome(c, b) for c, b in stream], gate) for stream in streams]
        passed = [r.pairs for r in results if r.passed]
        out[name] = {
            "pass_rate": len(passed) / runs,
            "pairs_to_pass": sorted(passed),
            "median_pairs_to_pass": statistics.median(passed) if passed else None,
            "mean_pairs_used": statistics.fmean(r.pairs for r in results),
        }
    return out


def plot(results: dict[str, Any], max_pairs: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = results["runs"]
    for name, measured in results["real"].items():
        xs = list(range(max_pairs + 1))
        passed = measured["pairs_to_pass"]
        ax.plot(xs, [sum(p <= x for p in passed) / runs for x in xs], label=f"{name} (real gain)")
    for name, measured in results["null"].items():
        ax.axhline(measured["pass_rate"], linestyle=":", label=f"{name}: false passes")
    ax.axhline(results["alpha"], color="grey", linewidth=0.8)
    ax.set_xlabel("held-out pairs")
    ax.set_ylabel("share of gates passed")
    ax.set_title(f"{results['task']} v{results['version']}: lift {results['lift']:+.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="a loop_speed task home")
    parser.add_argument("--task", required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--prompts", type=int, default=64, help="the task's last N prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gate_outcomes.json"))
    args = parser.parse_args()
    console = Console()
    task = get_task(args.task)
    prompts = task.load_prompts()[-args.prompts :]
    model_path = prepare_model(default_home())
    vllm = VLLM(args.home, model_path, threads=2, dtype=None)
    with console.status("starting vLLM ..."):
        vllm.start()
    try:
        with console.status(f"answering {len(prompts)} prompts twice ..."):
            base, candidate = answer_pairs(vllm, task, args.version, prompts, args.max_tokens)
    finally:
        vllm.stop()
    gate = GateConfig()
    diffs = [c - b for c, b in zip(candidate, base, strict=True)]
    results: dict[str, Any] = {
        "task": task.name,
        "version": args.version,
        "prompts": len(prompts),
        "runs": args.runs,
        "alpha": gate.alpha,
        "base": statistics.fmean(base),
        "candidate": statistics.fmean(candidate),
        "lift": statistics.fmean(diffs),
        "ties": sum(abs(d) < 1e-9 for d in diffs) / len(diffs),
        "real": gates(base, candidate, args.runs, gate, null=False, seed=0),
        "null": gates(base, candidate, args.runs, gate, null=True, seed=1),
    }
    table = Table(title=(
        f"{task.name} v{args.version} on {len(prompts)} prompts: base {results['base']:.3f}, "
        f"candidate {results['candidate']:.3f}, ties {results['ties']:.0%}; {args.runs} gates "
        f"of at most {gate.max_pairs} pairs each"
    ))  # fmt: skip
    for column in ("outcome", "passes (real gain)", "median pairs to pass", "false passes"):
        table.add_column(column, justify="right")
    for name in OUTCOMES:
        real, null = results["real"][name], results["null"][name]
        median = real["median_pairs_to_pass"]
        table.add_row(
            name,
            f"{real['pass_rate']:.1%}",
            "-" if median is None else f"{median:.0f}",
            f"{null['pass_rate']:.1%} (alpha {gate.alpha})",
        )
    console.print(table)
    ranking, difference = results["real"]["ranking"], results["real"]["score difference"]
    if ranking["pass_rate"] > 0:
        console.print(
            f"score difference / ranking: {difference['pass_rate'] / ranking['pass_rate']:.2f}x "
            "the passes"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, gate.max_pairs, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""How often does the gate pass a candidate that truly wins a given share of its pairs?

Run it from the repository root (pure simulation, no services; under a minute)::

    .venv/bin/python bench/gate_power.py [--runs 2000] [--ties 0.25]

Method
------
A candidate's pairs are wins (1), losses (0) and ties (0.5), as the gate scores a verifier's or
a reward model's pairs (learner/gate.py). In each scenario a pair is a tie with probability
``--ties`` and otherwise a win with the probability that gives the scenario's win rate (the
mean outcome). ``--runs`` gates per scenario and per gate setting, each on its own seeded stream
of ``max_pairs`` pairs:

* gate: ``learner.gate.decide`` exactly as the learner runs it (``ratchet/sequential.py``: the
  any-time betting test at alpha / 2 and one look at ``max_pairs`` at alpha / 2), with the
  setting's threshold 0.5, alpha, min_pairs and max_pairs. Reported: the share of gates passed,
  and the mean pairs used.
* betting only: the same test without its final look, at the whole alpha (the gate before the
  final look was added).
* peer: one look after all ``max_pairs`` pairs, a one-sided z-test of the mean outcome above 0.5
  at the same alpha (normal approximation, the sample's own variance). It spends every pair.

Settings: the defaults (alpha 0.05, 32 to 128 pairs) and the ratings bar test's (alpha 0.2, 32
to 96). The row at win rate 0.5 is each test's false-pass rate (at most alpha). The ratio printed
is the gate's pass share over the betting test's alone: what the final look buys. Writes
``--out`` (JSON) and a plot of the three power curves beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.gate_verdict import decide
from ratchet.sequential import SequentialTest, one_look_bounds
from ratchet.settings import GateConfig

WIN_RATES = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75)
SETTINGS = {
    "defaults": GateConfig(),
    "ratings bar test": GateConfig(alpha=0.2, min_pairs=32, max_pairs=96),
}


def pairs(rng: random.Random, win_rate: float, ties: float, count: int) -> list[float]:
    """``count`` outcomes with mean ``win_rate``: ties at ``ties``, the rest wins or losses."""
    win = (win_rate - ties / 2) / (1 - ties)
    return [0.5 if rng.random() < ties else float(rng.random() < win) for _ in range(count)]


def fixed_passes(outcomes: list[float], alpha: float) -> bool:
    squares = sum(x * x for x in outcomes)
    lower, _ = one_look_bounds(sum(outcomes), squares, len(outcomes), alpha)
    return lower > 0.5


def betting_passes(outcomes: list[float], gate: GateConfig) -> bool:
    test = SequentialTest(gate.threshold, gate.alpha, gate.max_pairs, gate.min_pairs)
    for outcome in outcomes:
        if test.update(outcome) != "continue":
            break
    return test.decision == "pass"


def scenario(gate: GateConfig, win_rate: float, ties: float, runs: int) -> dict[str, float]:
    passed = fixed = used = betting = 0
    for run in range(runs):
        outcomes = pairs(random.Random(f"{win_rate}:{run}"), win_rate, ties, gate.max_pairs)
        result = decide(outcomes, gate)
        passed += result.passed
        used += result.pairs
        betting += betting_passes(outcomes, gate)
        fixed += fixed_passes(outcomes, gate.alpha)
    return {
        "win_rate": win_rate,
        "gate_pass": passed / runs,
        "gate_pairs": used / runs,
        "betting_pass": betting / runs,
        "fixed_pass": fixed / runs,
    }


def plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), sharey=True)
    for ax, (name, rows) in zip(axes, results.items(), strict=True):
        rates = [r["win_rate"] for r in rows]
        ax.plot(rates, [r["gate_pass"] for r in rows], "o-", label="gate (betting + last look)")
        ax.plot(rates, [r["betting_pass"] for r in rows], "^:", label="betting only (before)")
        ax.plot(rates, [r["fixed_pass"] for r in rows], "s--", label="one look at max_pairs")
        ax.set_title(name)
        ax.set_xlabel("true win rate of the candidate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of gates passed")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--ties", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gate_power.json"))
    args = parser.parse_args()
    console = Console()
    results: dict[str, list[dict[str, float]]] = {}
    for name, gate in SETTINGS.items():
        table = Table(
            title=f"{name}: alpha {gate.alpha}, {gate.min_pairs}-{gate.max_pairs} pairs, "
            f"{args.ties:.0%} ties, {args.runs} gates per row"
        )
        columns = ("win rate", "gate passes", "gate pairs", "betting only", "one look", "ratio")
        for column in columns:
            table.add_column(column, justify="right")
        rows = [scenario(gate, rate, args.ties, args.runs) for rate in WIN_RATES]
        for row in rows:
            ratio = row["gate_pass"] / row["betting_pass"] if row["betting_pass"] else None
            table.add_row(
                f"{row['win_rate']:.2f}",
                f"{row['gate_pass']:.3f}",
                f"{row['gate_pairs']:.0f}",
                f"{row['betting_pass']:.3f}",
                f"{row['fixed_pass']:.3f}",
                f"{ratio:.2f}x" if ratio is not None else "-",
            )
        console.print(table)
        results[name] = rows
    args.out.write_text(json.dumps({"ties": args.ties, "runs": args.runs, "results": results}))
    plot(results, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

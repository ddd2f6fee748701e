"""The sequential canary against a fixed-count canary: rating pairs to a decision, and errors.

Run it from the repository root (pure simulation, no services; about a minute)::

    .venv/bin/python bench/canary_decisions.py [--runs 1000] [--drop 0.1] [--alpha 0.05]

Method
------
Users rate answers thumbs up or down (1 or 0). In each scenario the active arm's answers are
liked with probability ``p_active`` and the canary's with ``p_canary``; ``--runs`` canaries are
simulated per scenario, each with its own seeded stream.

* sequential: ``learner/canary_clients.py`` exactly as the learner runs it (each rating from its
  own client, ``canary.client_ratings`` 1, so one unit each: the looks at 20, 40, 80, ...
  clients an arm, and the last look at 1024), ``canary.max_feedback_drop`` = ``--drop``,
  ``canary.alpha`` = ``--alpha``, the other settings their defaults. Reported: the share of
  canaries promoted, and the mean ratings an arm at the decision.
* fixed: the same pairs, decided once after ``n`` pairs by a one-sided z-test of non-inferiority
  at the same alpha (promote when the mean paired outcome's lower 1 - alpha bound, normal
  approximation, is above ``1/2 - drop/2``). ``n`` is the smallest of a grid whose promotion rate
  on the "equal" scenario matches the sequential test's own (so both have the same power where
  power is hardest to get); its false-promotion rate at the boundary (a canary exactly ``drop``
  worse) is printed beside the sequential one's.

The ratio printed is fixed n / sequential mean pairs, per scenario: how many times more ratings
the fixed-count canary needs for the same power.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.canary_clients import client_test
from learner.canary_ratings import Rating
from ratchet.settings import CanaryConfig

SCENARIOS = {  # name: (p_active, p_canary)
    "clearly better": (0.5, 0.7),
    "equal": (0.6, 0.6),
    "boundary (drop worse)": (0.6, None),  # p_canary = p_active - drop
    "clearly worse": (0.7, 0.4),
}
FIXED_GRID = (50, 100, 150, 200, 300, 400, 500, 600, 800, 1024)
Z = {0.05: 1.6449, 0.01: 2.3263, 0.1: 1.2816}


def paired_outcomes(active: list[float], canary: list[float]) -> list[float]:
    """``(1 + canary_i - active_i) / 2`` for each pair: the fixed-count test's outcomes."""
    return [(1.0 + c - a) / 2.0 for a, c in zip(active, canary, strict=False)]


def stream(rng: random.Random, p: float, n: int) -> list[float]:
    return [float(rng.random() < p) for _ in range(n)]


def fixed_promotes(outcomes: list[float], n: int, theta: float, z: float) -> bool:
    head = outcomes[:n]
    mean = statistics.fmean(head)
    sd = statistics.pstdev(head) or 1e-9
    return mean - z * sd / math.sqrt(n) > theta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--drop", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=0.05, choices=sorted(Z))
    args = parser.parse_args()
    config = CanaryConfig(max_feedback_drop=args.drop, alpha=args.alpha, client_ratings=1)
    theta = 0.5 - args.drop / 2
    n_max = config.max_rating_pairs
    results: dict[str, dict[str, float]] = {}
    pairs_by: dict[str, list[list[float]]] = {}
    for name, (p_active, p_canary) in SCENARIOS.items():
        p_canary = p_active - args.drop if p_canary is None else p_canary
        rng = random.Random(name)
        promoted, decided_at, all_pairs = 0, [], []
        for _ in range(args.runs):
            active, canary = stream(rng, p_active, n_max), stream(rng, p_canary, n_max)
            test = client_test(
                [Rating(f"a{i}", x) for i, x in enumerate(active)],
                [Rating(f"c{i}", x) for i, x in enumerate(canary)],
                config,
                ended=True,
            )
            promoted += test.decision == "pass"
            decided_at.append(test.n)
            all_pairs.append(paired_outcomes(active, canary))
        results[name] = {"promoted": promoted / args.runs, "pairs": statistics.fmean(decided_at)}
        pairs_by[name] = all_pairs
    z = Z[args.alpha]
    target = results["equal"]["promoted"]
    fixed_n = next(
        (
            n
            for n in FIXED_GRID
            if statistics.fmean(fixed_promotes(o, n, theta, z) for o in pairs_by["equal"]) >= target
        ),
        FIXED_GRID[-1],
    )
    table = Table(title=f"canary decisions, {args.runs} runs, drop {args.drop}, alpha {args.alpha}")
    for column in (
        "scenario",
        "seq promoted",
        "seq mean pairs",
        f"fixed n={fixed_n} promoted",
        "fixed n / seq pairs",
    ):
        table.add_column(column, justify="right")
    for name, result in results.items():
        fixed = statistics.fmean(fixed_promotes(o, fixed_n, theta, z) for o in pairs_by[name])
        table.add_row(
            name,
            f"{result['promoted']:.3f}",
            f"{result['pairs']:.0f}",
            f"{fixed:.3f}",
            f"{fixed_n / result['pairs']:.1f}x",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

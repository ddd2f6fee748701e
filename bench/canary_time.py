"""How long a canary takes to decide on a quiet alias, and how often it promotes a worse one.

Run it from the repository root (pure simulation, no services; about a minute)::

    .venv/bin/python bench/canary_time.py [--rate 20] [--rated 0.8] [--runs 300]
        [--set canary.feedback_wait_s=600 ...]

``bench/canary_decisions.py`` counts rating *pairs* to a decision; what a user waits for is
*minutes*, and those depend on the traffic: how many answers a minute the alias serves, the
share the canary gets (``learner/canary_weight.py``), how many answers users rate and how late,
and the canary's waits (``min_requests``, ``feedback_wait_s``). This bench plays that in time,
with the learner's own pieces:

* answers arrive at ``--rate`` a minute (20: what the embedded stack serves on this 2-core
  machine beside a learner), each on the canary arm with the probability
  :func:`canary_weight` gives for that rate;
* a share ``--rated`` of answers is rated (users who never rate), ``--lag`` seconds later on
  average (exponential); a rating is a thumbs up with the arm's probability of a good answer,
  flipped with probability ``--noise`` (users disagree); with ``--scale``, a rating in [0, 1]:
  the arm's mean plus a normal spread ``--noise`` (0.25 by default), clipped;
* every ``--tick`` seconds ``canary_verdict`` decides as the learner's canary watcher does, on
  the arms' counts and the ratings so far: with ``--clients 0`` (the default) every answer is
  the dev stack's anonymous client's (each rating a unit, no cap); with ``--clients N`` each
  answer goes to one of N clients at random (API keys, or a vouching app's users), and the
  verdict counts them by client (``learner/canary_clients.py``);
* ``--code PATH`` runs the verdict of another checkout (``git worktree add /tmp/before
  <commit>``), imported from it as bench/canary_attack.py does: before and after on one traffic.

Scenarios: the canary better by ``--gain`` (the lift issue 35's promotion carried), equal,
worse by ``canary.max_feedback_drop`` (the boundary: a promotion there is a false one), and
clearly worse. Each configuration (the shipped defaults, then each ``--set`` group) is reported
as the share promoted, the minutes to a decision (median and 90th percentile), the share
decided before ``feedback_wait_s`` ran out and the share decided when it did, and the mean
ratings in when it was decided. A table, and with ``--plot`` the minutes to a decision by
scenario and configuration.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.canary_attack import Code, Event

MAX_MINUTES = 120.0  # a canary undecided by then counts as undecided


@dataclass(frozen=True)
class Traffic:
    rate_per_min: float
    rated: float
    lag_s: float
    noise: float  # thumbs: the share flipped; scale: the spread of one answer's rating
    tick_s: float
    scale: bool = False  # ratings in [0, 1] around the arm's mean, not thumbs
    clients: int = 0  # 0: every answer the anonymous client's; else one of this many at random


@dataclass(frozen=True)
class Outcome:
    verdict: str  # promote, rollback, undecided
    minutes: float
    by_test: bool  # decided before the wait ran out
    by_look: bool = False  # when the wait ran out
    ratings: int = 0  # ratings in when it was decided


def scenarios(base: float, gain: float, drop: float) -> dict[str, tuple[float, float]]:
    """name: (the active arm's chance of a good answer, the canary's)."""
    return {
        f"better by {gain:g}": (base, base + gain),
        "equal": (base, base),
        f"worse by {drop:g} (boundary)": (base, base - drop),
        "clearly worse": (base, base - 0.25),
    }


def rating(rng: random.Random, p_good: float, noise: float, scale: bool = False) -> float:
    """Thumbs: up with the arm's chance of a good answer, flipped with chance ``noise``. On a
    scale: the arm's mean plus a normal spread ``noise`` (answers differ, users disagree),
    clipped to [0, 1]."""
    if scale:
        return min(1.0, max(0.0, rng.gauss(p_good, noise)))
    good = rng.random() < p_good
    return float(good != (rng.random() < noise))


def play(
    rng: random.Random,
    code: Code,
    config: Any,
    traffic: Traffic,
    p_active: float,
    p_canary: float,
) -> Outcome:
    """One canary from its start until it is decided, in ticks of ``traffic.tick_s``."""
    weight = code.weight.canary_weight(config, traffic.rate_per_min / 60.0)
    requests: Counter[tuple[str, str]] = Counter()
    due: list[tuple[float, str, str, float]] = []  # (arrival, client, arm, score), unordered
    events: list[Event] = []
    t, next_answer = 0.0, rng.expovariate(traffic.rate_per_min / 60.0)
    while t < MAX_MINUTES * 60:
        t += traffic.tick_s
        while next_answer <= t:  # the answers of this tick, and their ratings to come
            arm = "canary" if rng.random() < weight else "active"
            client = f"c{rng.randrange(traffic.clients)}" if traffic.clients else code.anonymous
            requests[client, arm] += 1
            if rng.random() < traffic.rated:
                p = p_canary if arm == "canary" else p_active
                arrives = next_answer + rng.expovariate(1.0 / traffic.lag_s)
                score = rating(rng, p, traffic.noise, traffic.scale)
                due.append((arrives, client, arm, score))
            next_answer += rng.expovariate(traffic.rate_per_min / 60.0)
        arrived = sorted(d for d in due if d[0] <= t)
        due = [d for d in due if d[0] > t]
        events.extend((client, arm, score) for _, client, arm, score in arrived)
        verdict = code.verdict(config, events, requests, t)
        if verdict != "wait":
            early = t < config.feedback_wait_s
            return Outcome(verdict, t / 60.0, early, not early, len(events))
    return Outcome("undecided", MAX_MINUTES, False, ratings=len(events))


def parse_set(items: list[str], code: Code) -> dict[str, Any]:
    """``canary.<field>=<value>`` items as CanaryConfig updates (values read as JSON)."""
    update: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if section != "canary" or name not in code.settings.CanaryConfig.model_fields:
            raise SystemExit(f"--set {item!r}: expected canary.<field>=<value>")
        update[name] = json.loads(value)
    return update


def summarise(outcomes: list[Outcome]) -> dict[str, float]:
    minutes = sorted(o.minutes for o in outcomes)
    return {
        "promoted": sum(o.verdict == "promote" for o in outcomes) / len(outcomes),
        "undecided": sum(o.verdict == "undecided" for o in outcomes) / len(outcomes),
        "median_minutes": statistics.median(minutes),
        "p90_minutes": minutes[int(0.9 * (len(minutes) - 1))],
        "by_test": sum(o.by_test for o in outcomes) / len(outcomes),
        "by_look": sum(o.by_look for o in outcomes) / len(outcomes),
        "ratings": statistics.fmean(o.ratings for o in outcomes),
    }


def run(
    code: Code, configs: dict[str, Any], traffic: Traffic, args: argparse.Namespace
) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, config in configs.items():
        results[name] = {}
        cases = scenarios(args.base, args.gain, config.max_feedback_drop)
        for scenario, (p_active, p_canary) in cases.items():
            rng = random.Random(f"{scenario}/{args.seed}")  # the same users for every config
            outcomes = [
                play(rng, code, config, traffic, p_active, p_canary)
                for _ in track(range(args.runs), description=f"{name}: {scenario}", transient=True)
            ]
            results[name][scenario] = summarise(outcomes)
    return results


def print_table(
    console: Console, results: dict[str, dict[str, dict[str, float]]], traffic: Traffic
) -> None:
    table = Table(
        title=f"canary decisions in time: {traffic.rate_per_min:g} answers/min, "
        f"{traffic.rated:.0%} rated ~{traffic.lag_s:g} s late, "
        + (
            f"on a scale, spread {traffic.noise:g}"
            if traffic.scale
            else f"{traffic.noise:.0%} flipped"
        )
    )
    columns = (
        "configuration",
        "scenario",
        "promoted",
        "median min",
        "p90 min",
        "by test",
        "by look",
        "ratings",
    )
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("configuration", "scenario") else "right"
        )
    for name, by_scenario in results.items():
        for scenario, s in by_scenario.items():
            table.add_row(
                name,
                scenario,
                f"{s['promoted']:.3f}",
                f"{s['median_minutes']:.1f}",
                f"{s['p90_minutes']:.1f}",
                f"{s['by_test']:.2f}",
                f"{s.get('by_look', 0.0):.2f}",
                f"{s.get('ratings', 0.0):.0f}",
            )
    console.print(table)


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    scenario_names = list(next(iter(results.values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(scenario_names))]
        medians = [results[name][s]["median_minutes"] for s in scenario_names]
        p90 = [
            results[name][s]["p90_minutes"] - m
            for s, m in zip(scenario_names, medians, strict=True)
        ]
        axes[0].bar(xs, medians, width, yerr=[[0] * len(p90), p90], capsize=3, label=name)
        axes[1].bar(xs, [results[name][s]["promoted"] for s in scenario_names], width, label=name)
    labels = ("minutes to a decision (median, bar to p90)", "share promoted")
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scenario_names))])
        ax.set_xticklabels(scenario_names, rotation=15, fontsize=8)
        ax.set_ylabel(label)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="answers a minute")
    parser.add_argument("--rated", type=float, default=0.8, help="share of answers rated")
    parser.add_argument("--lag", type=float, default=30.0, help="mean seconds to a rating")
    parser.add_argument(
        "--noise",
        type=float,
        default=None,
        help="thumbs: share flipped (0.1); --scale: the normal spread of a rating (0.25)",
    )
    parser.add_argument("--scale", action="store_true", help="ratings in [0, 1], not thumbs")
    parser.add_argument("--tick", type=float, default=10.0, help="seconds between verdicts")
    parser.add_argument("--base", type=float, default=0.59, help="active arm's good share")
    parser.add_argument("--gain", type=float, default=0.1, help="the better canary's gain")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        nargs="+",
        default=[],
        metavar="canary.FIELD=VALUE",
        help="a configuration to compare with the shipped defaults (repeat for several)",
    )
    parser.add_argument("--clients", type=int, default=0, help="0: the anonymous client")
    parser.add_argument("--code", type=Path, default=None, help="checkout whose verdict to run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/canary_time.json"))
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    noise = args.noise if args.noise is not None else (0.25 if args.scale else 0.1)
    traffic = Traffic(args.rate, args.rated, args.lag, noise, args.tick, args.scale, args.clients)
    code = Code(args.code)
    configs = {"shipped defaults": code.config()}
    for items in args.set:
        configs[" ".join(items)] = code.config(**parse_set(items, code))
    console = Console(width=max(Console().width, 110))  # the configurations' names, unwrapped
    results = run(code, configs, traffic, args)
    print_table(console, results, traffic)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"traffic": vars(traffic), "results": results}, indent=2))
    console.print(f"figures: {args.out}")
    if args.plot:
        png = args.out.with_suffix(".png")
        plot(results, png)
        console.print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

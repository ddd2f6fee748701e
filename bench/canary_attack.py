"""Attacks on the canary's verdict: can a few keys that know the arms veto or push a canary?

Run it from the repository root (pure simulation, no services; minutes)::

    .venv/bin/python bench/canary_attack.py [--runs 1000] [--raters 60] [--ratings 10]
        [--code /tmp/before]

It plays canaries on the project's own verdict code, imported, not copied: with ``--code PATH``
the code of another checkout (``git worktree add /tmp/before <commit>``: the verdict before the
test over clients, ``canary_verdict`` over ``rating_test``), else this one's
(``learner/canary.py`` over ``learner/canary_clients.py``).

The honest population: ``--raters`` clients (API keys, or a vouching app's users), each rating
``--ratings`` answers, each answer served by the canary with probability ``--weight`` (a quiet
alias's canary takes up to ``canary.max_weight``, 0.5); a rating is a thumbs up with the arm's
chance of a good answer (``--base`` for the active arm; the candidate equal, better by 0.05, or
worse by ``canary.max_feedback_drop``, 0.1). Attacker keys know the arms (greedy decoding or
logprobs tell them apart): each rates ``--attack-ratings`` answers of each arm, the canary 0 and
the active arm 1 where the candidate is equal or better (a veto), the reverse where it is worse
(a push). All ratings arrive in random order spread over ``canary.feedback_wait_s``; the verdict
is asked every ``--check-every`` ratings and once more when the wait has run out, as the
learner's watcher asks it (each rating one request of its client on its arm).

The volume attacker: one key sends ``--volume`` one-token requests in the canary's first seconds
(500: enough to push every gated candidate through before), while ``--raters`` honest clients
have each been served one answer and no rating has arrived yet; the verdict is asked at 5, 60 and
300 s and just before the wait runs out. Printed: how often that promotes (it must never).

Printed per scenario and number of attacker keys (0, 1, 2, 5): the share promoted and rolled
back over ``--runs`` seeded runs, and the mean ratings and seconds to the decision.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
ATTACKERS = (0, 1, 2, 5)
VOLUME_AGES = (5.0, 60.0, 300.0)

ARMS = ("active", "canary")
Event = tuple[str, str, float]  # (client, arm, score)
Verdict = Callable[[list[Event], Counter[tuple[str, str]], float], str]


@dataclass(frozen=True)
class Population:
    raters: int
    ratings: int
    weight: float
    base: float
    attack_ratings: int
    check_every: int


class Code:
    """The verdict of the checkout at ``code`` (this one's by default), imported from it: its
    ``CanaryConfig`` and ``canary_verdict``, before the test over clients (``rating_test`` over
    rating pairs) or after it (``counted`` requests and ``client_evidence``)."""

    def __init__(self, code: Path | None) -> None:
        self.name = str(code or "this checkout")
        sys.path.insert(0, str(code or ROOT))
        self.canary = importlib.import_module("learner.canary")
        self.state = importlib.import_module("ratchet.canary_state")
        self.settings = importlib.import_module("ratchet.settings")
        self.ratings = importlib.import_module("learner.canary_ratings")
        self.weight = importlib.import_module("learner.canary_weight")
        self.by_clients = hasattr(self.canary, "counted")
        self.anonymous = importlib.import_module("ratchet.records").ANONYMOUS_CLIENT

    def config(self, **updates: Any) -> Any:
        return self.settings.CanaryConfig(**updates)

    def verdict(
        self,
        config: Any,
        events: list[Event],
        requests: Counter[tuple[str, str]],
        age_s: float,
    ) -> str:
        """The verdict on the ratings (in arrival order) and requests so far, at ``age_s``."""
        rating = self.ratings.Rating
        # Each rating's place in the order of both arms (``Rating.seq``, where the code keeps it).
        ordered = "seq" in getattr(rating, "__dataclass_fields__", {})
        arms = [
            [
                rating(c, s, i) if ordered else rating(c, s)
                for i, (c, a, s) in enumerate(events)
                if a == arm
            ]
            for arm in ARMS
        ]
        stats = {
            arm: self.state.ArmStats(
                sum(n for (_, a), n in requests.items() if a == arm),
                0,
                len(arms[i]),
                sum(r.score for r in arms[i]),
            )
            for i, arm in enumerate(ARMS)
        }
        if self.by_clients:
            counted = {
                arm: self.canary.counted(
                    stats[arm], {c: (n, 0) for (c, a), n in requests.items() if a == arm}, config
                )
                for arm in ARMS
            }
            evidence = self.canary.client_evidence(arms[0], arms[1], config)
            verdict = self.canary.canary_verdict(
                counted["active"], counted["canary"], config, age_s, evidence
            )
        else:
            share = self.settings.FeedbackConfig().max_share
            test = self.ratings.rating_test(arms[0], arms[1], config, share)
            verdict = self.canary.canary_verdict(
                stats["active"], stats["canary"], config, age_s, test
            )
        return str(verdict[0])


def honest_events(rng: random.Random, pop: Population, p_canary: float) -> list[Event]:
    events: list[Event] = []
    for rater in range(pop.raters):
        for _ in range(pop.ratings):
            arm = "canary" if rng.random() < pop.weight else "active"
            p = p_canary if arm == "canary" else pop.base
            events.append((f"honest-{rater}", arm, float(rng.random() < p)))
    return events


def attack_events(attackers: int, pop: Population, push: bool) -> list[Event]:
    """Each attacker's ratings: the canary 0 and the active arm 1 (a veto), or the reverse."""
    canary, active = (1.0, 0.0) if push else (0.0, 1.0)
    return [
        (f"attacker-{a}", arm, score)
        for a in range(attackers)
        for _ in range(pop.attack_ratings)
        for arm, score in (("canary", canary), ("active", active))
    ]


@dataclass(frozen=True)
class Outcome:
    verdict: str  # promote, rollback, undecided
    ratings: int  # ratings in when it was decided
    seconds: float


def play(
    rng: random.Random,
    pop: Population,
    verdict: Verdict,
    wait_s: float,
    p_canary: float,
    attackers: int,
    push: bool,
) -> Outcome:
    """One canary: the ratings arrive in random order over 90% of the wait, the verdict is asked
    every ``check_every`` ratings and when the wait has run out."""
    events = honest_events(rng, pop, p_canary) + attack_events(attackers, pop, push)
    rng.shuffle(events)
    requests: Counter[tuple[str, str]] = Counter()
    total = len(events)
    for i, (client, arm, _) in enumerate(events, 1):
        requests[client, arm] += 1
        if i % pop.check_every and i < total:
            continue
        age = 0.9 * wait_s * i / total
        decided = verdict(events[:i], requests, age)
        if decided != "wait":
            return Outcome(decided, i, age)
    decided = verdict(events, requests, wait_s)
    return Outcome(decided if decided != "wait" else "undecided", total, wait_s)


def volume_promotes(pop: Population, verdict: Verdict, wait_s: float, volume: int) -> bool:
    """The volume attacker's requests and one answer to each honest client, no rating yet."""
    requests: Counter[tuple[str, str]] = Counter()
    canary = round(volume * pop.weight)
    requests["volume", "canary"] += canary
    requests["volume", "active"] += volume - canary
    for rater in range(pop.raters):
        requests[f"honest-{rater}", "canary" if rater % 2 else "active"] += 1
    ages = (*VOLUME_AGES, wait_s - 1.0)
    return any(verdict([], requests, age) == "promote" for age in ages)


def scenarios(drop: float) -> dict[str, tuple[float, bool]]:
    """name: (the candidate's gain over the active arm, whether attackers push it)."""
    return {
        "equal": (0.0, False),
        "better by 0.05": (0.05, False),
        f"worse by {drop:g}": (-drop, True),
    }


def summarise(outcomes: list[Outcome]) -> dict[str, float]:
    decided = [o for o in outcomes if o.verdict != "undecided"] or outcomes
    return {
        "promoted": sum(o.verdict == "promote" for o in outcomes) / len(outcomes),
        "rolled_back": sum(o.verdict == "rollback" for o in outcomes) / len(outcomes),
        "ratings": statistics.fmean(o.ratings for o in decided),
        "seconds": statistics.fmean(o.seconds for o in decided),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--raters", type=int, default=60)
    parser.add_argument("--ratings", type=int, default=10, help="ratings per honest rater")
    parser.add_argument("--weight", type=float, default=0.5, help="the canary's share")
    parser.add_argument("--base", type=float, default=0.7, help="active arm's good share")
    parser.add_argument("--attack-ratings", type=int, default=15, help="per arm, per attacker")
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--volume", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code", type=Path, default=None, help="checkout whose verdict to run")
    parser.add_argument("--scenario", default="", help="only the scenarios named so (a prefix)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=VALUE", help="CanaryConfig fields (JSON)"
    )
    args = parser.parse_args()
    updates = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    code = Code(args.code)
    config = code.config(**updates)

    def verdict(events: list[Event], requests: Counter[tuple[str, str]], age_s: float) -> str:
        return code.verdict(config, events, requests, age_s)

    pop = Population(
        args.raters, args.ratings, args.weight, args.base, args.attack_ratings, args.check_every
    )
    results: dict[str, Any] = {}
    for name, (gain, push) in scenarios(config.max_feedback_drop).items():
        if args.scenario and not name.startswith(args.scenario):
            continue
        for attackers in ATTACKERS:
            rng = random.Random(f"{name}/{attackers}/{args.seed}")
            outcomes = [
                play(rng, pop, verdict, config.feedback_wait_s, args.base + gain, attackers, push)
                for _ in range(args.runs)
            ]
            results[f"{name}, {attackers} attackers"] = summarise(outcomes)
    volume = volume_promotes(pop, verdict, config.feedback_wait_s, args.volume)
    table = Table(
        title=f"canary attacks on {code.name}: {args.raters} raters x {args.ratings} ratings, "
        f"weight {args.weight}, {args.runs} runs; attackers rate {args.attack_ratings} a arm"
    )
    for column in ("scenario", "promoted", "rolled back", "ratings", "seconds"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for name, s in results.items():
        table.add_row(
            name,
            f"{s['promoted']:.3f}",
            f"{s['rolled_back']:.3f}",
            f"{s['ratings']:.0f}",
            f"{s['seconds']:.0f}",
        )
    console = Console(width=120)
    console.print(table)
    console.print(f"volume attacker ({args.volume} requests, no rating yet) promotes: {volume}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"code": code.name, "args": {k: str(v) for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({**payload, "results": results, "volume": volume}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

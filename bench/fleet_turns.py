"""How often a conversation's next turn reaches a replica that already served it: the proxy's
choice of replica (ratchet/fleet.py) simulated, without vLLM, for one busy version.

Conversations arrive at ``--rates`` per second (Poisson), each of ``--turns`` turns; a turn is
answered in 1.5-3.5 s (uniform) and the user's next turn comes ``--think`` s later (uniform in
0.5-1.5 times it; 0: at once, a closed loop). Each turn goes to the replica the proxy's
:class:`Router` picks, keyed by the version alone, or by the version and the conversation with
the version's width held for ``--hold`` s. Reported: the share of later turns that reached a
replica the conversation had used (the ones whose prefix can be in that replica's cache).

    .venv/bin/python bench/fleet_turns.py
    .venv/bin/python bench/fleet_turns.py --think 0 --hold 0,60
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratchet.fleet import Router

VERSION = "support@v7"


def revisit_share(
    replicas: list[str],
    rate: float,
    think_s: float,
    hold_s: float | None,
    seed: int,
    conversations: int = 200,
    turns: int = 3,
) -> float:
    """The share of later turns sent to a replica their conversation had used; ``hold_s`` None:
    keyed by the version alone."""
    rng = random.Random(seed)
    router = Router(hold_s=hold_s or 0.0)  # the proxy's: it counts the version's requests
    outstanding: Counter[str] = Counter()
    used: dict[int, set[str]] = {}
    revisits = later = 0
    # (time, kind, conversation, turn, replica): "ask" a turn, or its answer is "done"
    events: list[tuple[float, str, int, int, str]] = []
    now = 0.0
    for conversation in range(conversations):
        now += rng.expovariate(rate)
        heapq.heappush(events, (now, "ask", conversation, 0, ""))
    while events:
        now, kind, conversation, turn, replica = heapq.heappop(events)
        if kind == "done":
            outstanding[replica] -= 1
            router.released(VERSION)
            if turn + 1 < turns:
                pause = think_s * rng.uniform(0.5, 1.5)
                heapq.heappush(events, (now + pause, "ask", conversation, turn + 1, ""))
            continue
        key = None if hold_s is None else str(conversation)
        replica = router.choose(VERSION, replicas, outstanding, key, now)
        if turn:
            later += 1
            revisits += replica in used[conversation]
        used.setdefault(conversation, set()).add(replica)
        outstanding[replica] += 1
        router.taken(VERSION)
        heapq.heappush(events, (now + rng.uniform(1.5, 3.5), "done", conversation, turn, replica))
    return revisits / later if later else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rates", default="0.5,1,2,4", help="conversations a second")
    parser.add_argument("--think", type=float, default=10.0, help="seconds between turns")
    parser.add_argument("--hold", default="60", help="Spread hold_s values to try")
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    replicas = [f"http://10.0.0.{i + 1}:8000" for i in range(args.replicas)]
    holds = [float(h) for h in args.hold.split(",")]
    table = Table(title=f"Later turns back on a replica they used ({args.replicas} replicas)")
    table.add_column("conversations / s")
    table.add_column("by version")
    for hold in holds:
        table.add_column(f"by conversation, width held {hold:g} s")
    for rate in (float(r) for r in args.rates.split(",")):

        def mean(hold: float | None, rate: float = rate) -> float:
            shares = [revisit_share(replicas, rate, args.think, hold, s) for s in range(args.seeds)]
            return sum(shares) / len(shares)

        table.add_row(f"{rate:g}", f"{mean(None):.3f}", *(f"{mean(h):.3f}" for h in holds))
    Console().print(table)


if __name__ == "__main__":
    main()

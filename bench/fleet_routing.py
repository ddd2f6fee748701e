"""Two embedded vLLM replicas behind the proxy: Ratchet's routing against round-robin, in one run.

Two mixes of traffic, each through three proxies in front of the same two replicas:
``proxy.balance: affinity`` (consistent hashing with bounded loads by served name, and by
conversation once a version spreads: ratchet/fleet.py), ``version`` (by served name alone) and
``round_robin``, in the order A B C C B A.

- ``many``: ``--aliases`` aliases, each serving its own adapter (``alias@v1``, random LoRA
  weights), ``--conversations`` multi-turn conversations of ``--turns`` turns (each turn's
  prompt is the conversation so far, so a turn can reuse the previous turn's prefix cache),
  ``--concurrency`` at a time. Each replica has fewer LoRA slots (``--max-loras``) than there
  are aliases, so where a version's requests land decides how often adapters are moved into
  slots.
- ``hot``: one alias, busy enough (``--hot-concurrency`` conversations at a time) that its
  version needs both replicas; each conversation opens with its own long system message, so
  whether its later turns find their prefix cached depends on the replica they reach. Its users
  read each answer before the next turn (``--think-s``, each pause uniform in 0.5-1.5 times it),
  so a turn arrives when the loads have moved on. (Without pauses, a closed loop of clients, a
  turn is sent the moment its last one frees a place on its replica, and bounded loads alone put
  it back there: by served name alone kept as many turns as by conversation then.)

Reported per policy: p50 and p99 latency, adapter loads into the replicas' slots (counted in
their logs by the ratchet_cpu_lora plugin), and the prefix-cache hit rate (vLLM's
``prefix_cache_hits`` over ``prefix_cache_queries``). Then, under Ratchet's routing, one replica
is killed mid-run: the requests that failed, against those that were in flight on it.

- ``faults`` (bench/fleet_faults.py): the first replica, a hung one (its ``/health`` answers,
  its engine wedges: a stream after two events) and one that goes dark ``--dark-after-s`` into
  each round (a blackhole), behind a proxy with outlier ejection, connect retries, the
  first-byte deadline and the deadline between a stream's events and one without, A B B A,
  ``--stream-share`` of the conversations streamed; reported per arm: p50 and p99 of the
  answered requests (and of the streamed ones), the failed ones, and the proxy's fault counters
  for the two faulty replicas.

    .venv/bin/python bench/fleet_routing.py          # about 18 minutes on 2 cores
    .venv/bin/python bench/fleet_routing.py --mixes faults   # about 8 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet_faults import (
    FaultyReplicas,
    ask,
    fault_proxies,
    pct,
    print_faults,
    run_faults,
)
from embedded.adapters import write_random_adapters
from embedded.model import prepare_model
from embedded.processes import Part, Stack, free_port
from embedded.stack import (
    create_topics,
    kafka_part,
    proxy_part,
    redis_part,
    vllm_part,
)
from embedded.vllm_cpu_lora import SLOT_LOAD
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings, default_home, load_settings
from ratchet.store import AdapterStore

BASE_MODEL = "smollm2-135m-instruct"
console = Console()
TOPICS = ["the weather", "a recipe", "a train timetable", "a birthday", "a garden", "a song"]
BALANCES = ("affinity", "version", "round_robin")
WORDS = [
    "ticket",
    "refund",
    "delay",
    "platform",
    "carriage",
    "seat",
    "reservation",
    "connection",
    "timetable",
    "station",
    "luggage",
    "bicycle",
    "discount",
    "season",
    "pass",
    "conductor",
    "weather",
    "signal",
    "works",
    "replacement",
    "bus",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aliases", type=int, default=6)
    parser.add_argument("--max-loras", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=24, help="per round of a policy")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hot-concurrency", type=int, default=12)
    parser.add_argument("--think-s", type=float, default=4.0, help="hot: a user's pause")
    parser.add_argument(
        "--mixes", default="many,hot,faults", help="comma-separated: many, hot, faults"
    )
    parser.add_argument("--fault-timeout-s", type=float, default=20.0, help="faults: both arms")
    parser.add_argument("--first-byte-s", type=float, default=5.0, help="faults: ejection arm")
    parser.add_argument("--dark-after-s", type=float, default=10.0, help="faults: each round")
    parser.add_argument("--stream-gap-s", type=float, default=5.0, help="faults: ejection arm")
    parser.add_argument("--stream-share", type=float, default=0.5, help="faults: streamed")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fleet_routing"))
    return parser.parse_args()


# ---- the stack ---------------------------------------------------------------------------------


def replica_part(settings: RatchetSettings, model: Path, name: str, max_loras: int) -> Part:
    part = vllm_part(settings, model, BASE_MODEL)
    part.name = name
    part.command += ["--max-loras", str(max_loras)]  # the last flag wins
    part.infrastructure = False
    return part


def proxy_config(home: Path, base: dict[str, Any], balance: str) -> tuple[Path, RatchetSettings]:
    config = {**base, "proxy": {"port": free_port(), "balance": balance, "expose_arm": True}}
    path = home / f"proxy-{balance}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, load_settings(path)


def start_stack(args: argparse.Namespace, home: Path, stack: Stack) -> dict[str, Any]:
    """Broker, Redis, two vLLM replicas on one store of adapters, and a proxy per policy."""
    model = prepare_model(default_home(), quiet=True)
    aliases = [f"fleet{i}" for i in range(args.aliases)]
    replicas = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    base: dict[str, Any] = {
        "home": str(home),
        "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "vllm_url": replicas[0],
        "vllm_endpoints": replicas,
        "aliases": {alias: {"base_model": BASE_MODEL} for alias in aliases},
    }
    settings = RatchetSettings(**base)
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    with console.status("writing the aliases' adapters"):
        for alias in aliases:
            write_random_adapters(model, store, alias, [1])
    (home / "redis").mkdir(exist_ok=True)
    stack.parts += [
        kafka_part(settings.kafka_bootstrap_servers),
        redis_part(settings.redis_url, home / "redis"),
    ]
    for i, url in enumerate(replicas):
        one = settings.model_copy(update={"vllm_url": url})
        stack.parts.append(replica_part(one, model, f"vllm-{i}", args.max_loras))
    faulty = None
    if "faults" in args.mixes.split(","):
        faulty = FaultyReplicas(replicas[0])
        faulty.start()
        parts, fault_urls = fault_proxies(home, base, faulty, args)
        stack.parts += parts
    proxies = {}
    for balance in BALANCES:
        path, proxy_settings = proxy_config(home, base, balance)
        part = proxy_part(proxy_settings, path)
        part.name = f"proxy-{balance}"
        stack.parts.append(part)
        proxies[balance] = f"http://127.0.0.1:{proxy_settings.proxy.port}"
    with console.status("starting Kafka, Redis, two vLLM replicas and three proxies (minutes)"):
        stack.start()
    create_topics(settings)
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    for alias in aliases:
        writer.write(AliasRoute(alias=alias, base_model=BASE_MODEL, active=1))
    fleet = {"aliases": aliases, "replicas": replicas, "proxies": proxies, "settings": settings}
    if faulty is not None:
        fleet |= {"faulty": faulty, "fault_proxies": fault_urls}
    return fleet


# ---- traffic and what vLLM says ----------------------------------------------------------------


Talk = tuple[str, str | None, str]  # (alias, its own system message or None, the opening)


def conversations(aliases: list[str], n: int, seed: int, mix: str) -> list[Talk]:
    """``many``: short conversations spread over the aliases; ``hot``: all to the first alias,
    each opening with a system message of its own (a case file of ~150 words)."""
    rng = random.Random(seed)
    talks: list[Talk] = []
    for i in range(n):
        opening = f"Tell me about {rng.choice(TOPICS)}, briefly. (#{seed}-{i})"
        if mix == "hot":
            case = " ".join(rng.choice(WORDS) for _ in range(150))
            talks.append((aliases[0], f"Case {seed}-{i}: {case}", opening))
        else:
            talks.append((rng.choice(aliases), None, opening))
    return talks


async def converse(
    client: httpx.AsyncClient,
    proxy: str,
    talk: Talk,
    turns: int,
    max_tokens: int,
    think_s: float = 0.0,
    stream: bool = False,
) -> tuple[list[float], int]:
    """One conversation: each turn sends the conversation so far, ``think_s`` (on average)
    after the last answer, streamed or not; a stream's latency is to its end. (latencies,
    failures)"""
    alias, system, opening = talk
    pauses = random.Random(opening)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": opening})
    latencies, failures = [], 0
    for turn in range(turns):
        if turn and think_s:
            await asyncio.sleep(think_s * pauses.uniform(0.5, 1.5))  # the user reads the answer
        started = time.perf_counter()
        body = {"model": alias, "messages": messages, "max_tokens": max_tokens}
        answer = await ask(client, proxy, body, stream)
        if answer is None:
            failures += 1
            continue
        latencies.append(time.perf_counter() - started)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And then? ({turn + 1})"},
        ]
    return latencies, failures


async def run_traffic(
    proxy: str,
    talks: list[Talk],
    args: argparse.Namespace,
    concurrency: int,
    think_s: float = 0.0,
    stream: bool = False,
) -> tuple[list[float], int]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(talk: Talk) -> tuple[list[float], int]:
            async with limit:
                return await converse(
                    client, proxy, talk, args.turns, args.max_tokens, think_s, stream
                )

        results = await asyncio.gather(*(one(talk) for talk in talks))
    return [x for lat, _ in results for x in lat], sum(f for _, f in results)


def vllm_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for name in ("prefix_cache_hits", "prefix_cache_queries"):
        match = re.search(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def slot_loads(stack: Stack, names: list[str]) -> int:
    total = 0
    for name in names:
        log = stack.part(name).log_path
        if log is not None and log.exists():
            total += log.read_text(errors="replace").count(SLOT_LOAD)
    return total


def measure(
    stack: Stack,
    fleet: dict[str, Any],
    balance: str,
    talks: list[Talk],
    args: Any,
    concurrency: int,
    think_s: float = 0.0,
) -> dict[str, Any]:
    names = [f"vllm-{i}" for i in range(2)]
    loads_before = slot_loads(stack, names)
    before = [vllm_counters(u) for u in fleet["replicas"]]
    proxy = fleet["proxies"][balance]
    latencies, failures = asyncio.run(run_traffic(proxy, talks, args, concurrency, think_s))
    after = [vllm_counters(u) for u in fleet["replicas"]]
    hits = sum(
        a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a["prefix_cache_queries"] - b["prefix_cache_queries"]
        for a, b in zip(after, before, strict=True)
    )
    return {
        "latencies": latencies,
        "failures": failures,
        "slot_loads": slot_loads(stack, names) - loads_before,
        "prefix_hits": hits,
        "prefix_queries": queries,
    }


def kill_mid_run(stack: Stack, fleet: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Traffic through Ratchet's routing; one replica killed halfway: failed requests against
    those in flight on it at the kill (the proxy's own count)."""
    talks = conversations(fleet["aliases"], args.conversations, seed=99, mix="many")
    proxy = fleet["proxies"]["affinity"]
    victim = stack.part("vllm-1")
    in_flight: dict[str, float] = {}

    def kill_later() -> None:
        time.sleep(3.0)
        metrics = httpx.get(f"{proxy}/metrics", timeout=10).text
        url = fleet["replicas"][1]
        match = re.search(
            rf'^ratchet_proxy_endpoint_outstanding{{endpoint="{re.escape(url)}"}} ([0-9.]+)$',
            metrics,
            re.M,
        )
        in_flight["at_kill"] = float(match.group(1)) if match else 0.0
        assert victim.process is not None
        os.killpg(victim.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_later)
    killer.start()
    latencies, failures = asyncio.run(run_traffic(proxy, talks, args, args.concurrency))
    killer.join()
    return {
        "failures": failures,
        "in_flight_at_kill": in_flight.get("at_kill"),
        "ok": len(latencies),
    }


def run_mix(
    stack: Stack, fleet: dict[str, Any], mix: str, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Each policy twice, A B C C B A, on the same conversations per position."""
    concurrency = args.hot_concurrency if mix == "hot" else args.concurrency
    think_s = args.think_s if mix == "hot" else 0.0
    results: dict[str, list[dict[str, Any]]] = {balance: [] for balance in BALANCES}
    order = [*BALANCES, *reversed(BALANCES)]
    for i, balance in enumerate(order):
        talks = conversations(fleet["aliases"], args.conversations, seed=100 * i, mix=mix)
        with console.status(f"{mix}: round {i + 1}/{len(order)}: {balance}"):
            result = measure(stack, fleet, balance, talks, args, concurrency, think_s)
            results[balance].append(result)
    return results


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [x for r in rounds for x in r["latencies"]]
    hits = sum(r["prefix_hits"] for r in rounds)
    queries = sum(r["prefix_queries"] for r in rounds)
    return {
        "requests": len(latencies),
        "failed": sum(r["failures"] for r in rounds),
        "p50_ms": pct(latencies, 0.5),
        "p99_ms": pct(latencies, 0.99),
        "slot_loads": sum(r["slot_loads"] for r in rounds),
        "prefix_hit_rate": hits / queries if queries else None,
    }


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mixes = [m for m in args.mixes.split(",") if m]
    home = Path(tempfile.mkdtemp(prefix="ratchet-fleet-"))
    stack = Stack([], home / "state")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    faults: dict[str, Any] | None = None
    killed: dict[str, Any] | None = None
    fleet: dict[str, Any] = {}
    try:
        fleet = start_stack(args, home, stack)
        # Warm-up: every adapter once through each proxy.
        warm: list[Talk] = [(alias, None, "Hello.") for alias in fleet["aliases"]]
        for balance in BALANCES:
            asyncio.run(run_traffic(fleet["proxies"][balance], warm, args, args.concurrency))
        for mix in mixes:
            if mix != "faults":
                results[mix] = run_mix(stack, fleet, mix, args)
        if "faults" in mixes:

            def talks_for(seed: int) -> list[Talk]:
                return conversations(fleet["aliases"], args.conversations, seed, mix="many")

            def traffic(proxy: str, talks: list[Talk], at_once: int, stream: bool) -> Any:
                return asyncio.run(run_traffic(proxy, talks, args, at_once, stream=stream))

            faults = run_faults(fleet, args, talks_for, traffic)
        if results:
            killed = kill_mid_run(stack, fleet, args)
    finally:
        stack.stop()
        if "faulty" in fleet:
            fleet["faulty"].stop()
    table = Table(title="Two vLLM replicas, the same traffic, three ways to route it")
    for column in ("traffic", "routing", "requests", "failed", "p50 ms", "p99 ms",
                   "adapter slot loads", "prefix-cache hit rate"):  # fmt: skip
        table.add_column(column)
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for mix, by_balance in results.items():
        summary[mix] = {}
        for balance, rounds in by_balance.items():
            row = summary[mix][balance] = summarise(rounds)
            rate = row["prefix_hit_rate"]
            table.add_row(
                mix,
                balance,
                str(row["requests"]),
                str(row["failed"]),
                f"{row['p50_ms']:.0f}",
                f"{row['p99_ms']:.0f}",
                str(row["slot_loads"]),
                "-" if rate is None else f"{rate:.3f}",
            )
    if results:
        console.print(table)
    if killed is not None:
        summary["replica_killed"] = killed
        console.print(
            f"one replica killed mid-run (Ratchet's routing): {killed['failures']} requests "
            f"failed, {killed['in_flight_at_kill']} were in flight on it at the kill, "
            f"{killed['ok']} answered"
        )
    if faults is not None:
        summary["faults"] = faults
        print_faults(faults, args)
    for mix in results:
        affinity, rr = summary[mix]["affinity"], summary[mix]["round_robin"]
        ratios = [f"p50 {affinity['p50_ms'] / rr['p50_ms']:.2f}"]
        if rr["slot_loads"]:
            ratios.append(f"adapter slot loads {affinity['slot_loads'] / rr['slot_loads']:.2f}")
        console.print(f"{mix}: affinity / round-robin: " + ", ".join(ratios))
    (args.out / "fleet_routing.json").write_text(json.dumps(summary, indent=2))
    console.print(f"results: {args.out / 'fleet_routing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

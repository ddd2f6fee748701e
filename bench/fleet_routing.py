"""Two embedded vLLM replicas behind the proxy: Ratchet's routing against round-robin, in one run.

Traffic: ``--aliases`` aliases, each serving its own adapter (``alias@v1``, random LoRA weights),
``--conversations`` multi-turn conversations of ``--turns`` turns (each turn's prompt is the
conversation so far, so a turn can reuse the previous turn's prefix cache), ``--concurrency`` at
a time, the same traffic through two proxies in front of the same two replicas: one with
``proxy.balance: affinity`` (consistent hashing with bounded loads by served name,
ratchet/fleet.py), one with ``round_robin``, alternating A B B A. Each replica has fewer LoRA
slots (``--max-loras``) than there are aliases, so where a version's requests land decides how
often adapters are moved into slots.

Reported per policy: p50 and p99 latency, adapter loads into the replicas' slots (counted in
their logs by the ratchet_cpu_lora plugin), and the prefix-cache hit rate (vLLM's
``prefix_cache_hits`` over ``prefix_cache_queries``). Then, under Ratchet's routing, one replica
is killed mid-run: the requests that failed, against those that were in flight on it.

    .venv/bin/python bench/fleet_routing.py          # about 10 minutes on 2 cores
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

from ratchet.dev.adapters import write_random_adapters
from ratchet.dev.model import prepare_model
from ratchet.dev.processes import Part, Stack, free_port
from ratchet.dev.stack import (
    create_topics,
    kafka_part,
    proxy_part,
    redis_part,
    vllm_part,
)
from ratchet.dev.vllm_cpu_lora import SLOT_LOAD
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings, default_home, load_settings
from ratchet.store import AdapterStore

BASE_MODEL = "smollm2-135m-instruct"
console = Console()
TOPICS = ["the weather", "a recipe", "a train timetable", "a birthday", "a garden", "a song"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aliases", type=int, default=6)
    parser.add_argument("--max-loras", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=24, help="per round of a policy")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench-results/fleet_routing"))
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
    proxies = {}
    for balance in ("affinity", "round_robin"):
        path, proxy_settings = proxy_config(home, base, balance)
        part = proxy_part(proxy_settings, path)
        part.name = f"proxy-{balance}"
        stack.parts.append(part)
        proxies[balance] = f"http://127.0.0.1:{proxy_settings.proxy.port}"
    with console.status("starting Kafka, Redis, two vLLM replicas and two proxies (minutes)"):
        stack.start()
    create_topics(settings)
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    for alias in aliases:
        writer.write(AliasRoute(alias=alias, base_model=BASE_MODEL, active=1))
    return {"aliases": aliases, "replicas": replicas, "proxies": proxies, "settings": settings}


# ---- traffic and what vLLM says ----------------------------------------------------------------


def conversations(aliases: list[str], n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [
        (rng.choice(aliases), f"Tell me about {rng.choice(TOPICS)}, briefly. (#{seed}-{i})")
        for i in range(n)
    ]


async def converse(
    client: httpx.AsyncClient, proxy: str, alias: str, opening: str, turns: int, max_tokens: int
) -> tuple[list[float], int]:
    """One conversation: each turn sends the conversation so far. (latencies, failures)"""
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    latencies, failures = [], 0
    for turn in range(turns):
        started = time.perf_counter()
        try:
            response = await client.post(
                f"{proxy}/v1/chat/completions",
                json={"model": alias, "messages": messages, "max_tokens": max_tokens},
            )
        except httpx.HTTPError:
            failures += 1
            continue
        if response.status_code != 200:
            failures += 1
            continue
        latencies.append(time.perf_counter() - started)
        answer = response.json()["choices"][0]["message"].get("content") or ""
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And then? ({turn + 1})"},
        ]
    return latencies, failures


async def run_traffic(
    proxy: str, talks: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[list[float], int]:
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(alias: str, opening: str) -> tuple[list[float], int]:
            async with limit:
                return await converse(client, proxy, alias, opening, args.turns, args.max_tokens)

        results = await asyncio.gather(*(one(a, o) for a, o in talks))
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
    stack: Stack, fleet: dict[str, Any], balance: str, talks: list[tuple[str, str]], args: Any
) -> dict[str, Any]:
    names = [f"vllm-{i}" for i in range(2)]
    loads_before = slot_loads(stack, names)
    before = [vllm_counters(u) for u in fleet["replicas"]]
    latencies, failures = asyncio.run(run_traffic(fleet["proxies"][balance], talks, args))
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
    talks = conversations(fleet["aliases"], args.conversations, seed=99)
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
    latencies, failures = asyncio.run(run_traffic(proxy, talks, args))
    killer.join()
    return {
        "failures": failures,
        "in_flight_at_kill": in_flight.get("at_kill"),
        "ok": len(latencies),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="ratchet-fleet-"))
    stack = Stack([], home / "state")
    try:
        fleet = start_stack(args, home, stack)
        # Warm-up: every adapter once through each proxy.
        warm = [(alias, "Hello.") for alias in fleet["aliases"]]
        for balance in ("affinity", "round_robin"):
            asyncio.run(run_traffic(fleet["proxies"][balance], warm, args))
        results: dict[str, list[dict[str, Any]]] = {"affinity": [], "round_robin": []}
        for i, balance in enumerate(("affinity", "round_robin", "round_robin", "affinity")):
            talks = conversations(fleet["aliases"], args.conversations, seed=i)
            with console.status(f"round {i + 1}/4: {balance}"):
                results[balance].append(measure(stack, fleet, balance, talks, args))
        killed = kill_mid_run(stack, fleet, args)
    finally:
        stack.stop()
    table = Table(title="Two vLLM replicas, one traffic, two ways to route it")
    for column in ("routing", "requests", "failed", "p50 ms", "p99 ms", "adapter slot loads",
                   "prefix-cache hit rate"):  # fmt: skip
        table.add_column(column)
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for balance, rounds in results.items():
        latencies = [x for r in rounds for x in r["latencies"]]
        hits = sum(r["prefix_hits"] for r in rounds)
        queries = sum(r["prefix_queries"] for r in rounds)
        row = {
            "requests": len(latencies),
            "failed": sum(r["failures"] for r in rounds),
            "p50_ms": pct(latencies, 0.5),
            "p99_ms": pct(latencies, 0.99),
            "slot_loads": sum(r["slot_loads"] for r in rounds),
            "prefix_hit_rate": hits / queries if queries else None,
        }
        summary[balance] = row
        table.add_row(
            balance,
            str(row["requests"]),
            str(row["failed"]),
            f"{row['p50_ms']:.0f}",
            f"{row['p99_ms']:.0f}",
            str(row["slot_loads"]),
            "-" if row["prefix_hit_rate"] is None else f"{row['prefix_hit_rate']:.3f}",
        )
    console.print(table)
    summary["replica_killed"] = killed
    console.print(
        f"one replica killed mid-run (Ratchet's routing): {killed['failures']} requests failed, "
        f"{killed['in_flight_at_kill']} were in flight on it at the kill, {killed['ok']} answered"
    )
    affinity, rr = summary["affinity"], summary["round_robin"]
    if rr["slot_loads"]:
        ratio = affinity["slot_loads"] / rr["slot_loads"]
        console.print(f"adapter slot loads, affinity / round-robin: {ratio:.2f}")
    console.print(f"p50 latency, affinity / round-robin: {affinity['p50_ms'] / rr['p50_ms']:.2f}")
    (args.out / "fleet_routing.json").write_text(json.dumps(summary, indent=2))
    console.print(f"results: {args.out / 'fleet_routing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

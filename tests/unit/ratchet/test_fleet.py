"""Consistent hashing with bounded loads (ratchet/fleet.py): affinity, the load bound, and how
little moves when a replica leaves."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from ratchet.fleet import capacity, choose, expand

REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
VERSIONS = [f"support@v{i}" for i in range(1, 61)]


def test_a_version_goes_to_one_replica_while_the_loads_are_even() -> None:
    idle: dict[str, int] = {}
    for version in VERSIONS:
        assert len({choose(version, REPLICAS, idle) for _ in range(5)}) == 1
    spread = Counter(choose(v, REPLICAS, idle) for v in VERSIONS)
    assert set(spread) == set(REPLICAS) and min(spread.values()) >= 10  # keys split evenly


def test_a_hot_version_spreads_and_no_replica_passes_the_bound() -> None:
    outstanding: Counter[str] = Counter()
    for _ in range(30):  # 30 requests of one version in flight at once
        endpoint = choose("support@v7", REPLICAS, outstanding)
        assert outstanding[endpoint] < capacity(outstanding, REPLICAS, 1.25)
        outstanding[endpoint] += 1
    assert set(outstanding) == set(REPLICAS)
    assert max(outstanding.values()) <= 1.25 * 30 / 3 + 1


def test_a_replica_that_leaves_moves_only_its_own_versions() -> None:
    idle: dict[str, int] = {}
    before = {v: choose(v, REPLICAS, idle) for v in VERSIONS}
    after = {v: choose(v, REPLICAS[:2], idle) for v in VERSIONS}
    moved = [v for v in VERSIONS if before[v] != after[v]]
    assert moved and all(before[v] == REPLICAS[2] for v in moved)
    assert choose("x", REPLICAS[:1], {REPLICAS[0]: 99}) == REPLICAS[0]  # one: no choice


async def test_a_name_stands_for_every_address_it_resolves_to(monkeypatch: Any) -> None:
    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        assert (host, port) == ("vllm-headless", 8000)
        found = ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7"]
        return [(2, 1, 6, "", (a, port)) for a in found]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    assert await expand("http://vllm-headless:8000/") == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    ]  # IPv4 where there is any, each address once
    # An address, or https (whose certificate names the host), stands for itself.
    assert await expand("http://10.1.2.3:8000/v1") == ["http://10.1.2.3:8000/v1"]
    assert await expand("https://vllm.example.com") == ["https://vllm.example.com"]

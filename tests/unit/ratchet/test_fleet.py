"""Consistent hashing with bounded loads (ratchet/fleet.py): affinity, the load bound, and how
little moves when a replica leaves."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from ratchet.fleet import Spread, capacity, choose, conversation_key, expand, needed_width

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


# --- a conversation's replica -------------------------------------------------------------------

CONVERSATIONS = [f"conversation-{i}" for i in range(60)]


def turns(opening: str, n: int, system: str | None = None) -> list[dict[str, Any]]:
    """The bodies of a chat's first ``n`` turns: each repeats the ones before."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": opening})
    bodies = []
    for turn in range(n):
        bodies.append({"model": "support", "messages": list(messages)})
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"and then? {turn}"},
        ]
    return bodies


def test_a_conversations_turns_share_a_key_and_other_conversations_do_not() -> None:
    for system in (None, "Be brief."):
        keys = {conversation_key(body) for body in turns("Tell me about Oslo.", 4, system)}
        assert len(keys) == 1 and None not in keys
    assert conversation_key(turns("Oslo?", 1)[0]) != conversation_key(turns("Bergen?", 1)[0])
    # The same messages with their fields in another order are the same conversation.
    reordered = {"messages": [{"content": "Oslo?", "role": "user"}]}
    assert conversation_key(reordered) == conversation_key(turns("Oslo?", 1)[0])
    # The client's prompt_cache_key, where given, is the key (OpenAI's parameter for it).
    keyed = [{**body, "prompt_cache_key": "ticket-7"} for body in turns("Oslo?", 1) + turns("x", 1)]
    assert conversation_key(keyed[0]) == conversation_key(keyed[1])
    assert conversation_key(keyed[0]) != conversation_key(turns("Oslo?", 1)[0])
    # A completion's prompt: its head, so prompts that open alike go together.
    preamble = "You are a support agent for a train company. " * 20
    assert conversation_key({"prompt": preamble + "Q1"}) == conversation_key(
        {"prompt": preamble + "Q1 A1 Q2"}
    )
    assert conversation_key({"prompt": [1, 2, 3]}) is None
    assert conversation_key({"model": "x"}) is None


def test_while_a_version_fits_one_replica_its_conversations_share_it() -> None:
    idle: dict[str, int] = {}
    home = choose("support@v7", REPLICAS, idle)
    assert needed_width(0, idle, REPLICAS) == 1
    for conversation in CONVERSATIONS:
        assert choose("support@v7", REPLICAS, idle, 1.25, conversation, width=1) == home


def test_a_spread_version_keeps_each_conversation_on_one_replica() -> None:
    # 12 of the version's requests in flight, 4 on each replica: it needs all three now.
    outstanding = dict.fromkeys(REPLICAS, 4)
    assert needed_width(12, outstanding, REPLICAS) == 3
    picks = {
        c: choose("support@v7", REPLICAS, outstanding, 1.25, c, width=3) for c in CONVERSATIONS
    }
    spread = Counter(picks.values())
    assert set(spread) == set(REPLICAS) and min(spread.values()) >= 10  # conversations split
    # The next turn, with the loads moved a little: every conversation back on its replica.
    moved = {REPLICAS[0]: 3, REPLICAS[1]: 5, REPLICAS[2]: 4}
    for c in CONVERSATIONS:
        assert choose("support@v7", REPLICAS, moved, 1.25, c, width=3) == picks[c]
    # Keyed by the version alone, the same requests all went to its first replica.
    assert len({choose("support@v7", REPLICAS, outstanding) for _ in CONVERSATIONS}) == 1


def test_a_version_that_needs_one_more_replica_moves_only_the_conversations_it_takes() -> None:
    # 12 in flight, 4 on each replica: the bound is 6, so 7 of the version's need two replicas
    # and 13 need three.
    outstanding = dict.fromkeys(REPLICAS, 4)
    assert (needed_width(6, outstanding, REPLICAS), needed_width(12, outstanding, REPLICAS)) == (
        2,
        3,
    )

    def placed(width: int) -> dict[str, str]:
        return {
            c: choose("support@v7", REPLICAS, outstanding, 1.25, c, width) for c in CONVERSATIONS
        }

    two, three = placed(2), placed(3)
    assert len(set(two.values())) == 2 and len(set(three.values())) == 3
    joined = (set(three.values()) - set(two.values())).pop()
    moved = [c for c in CONVERSATIONS if two[c] != three[c]]
    assert moved and all(three[c] == joined for c in moved)  # rendezvous: only to the new one


def test_conversations_never_pass_the_bound() -> None:
    outstanding: Counter[str] = Counter()
    for in_flight in range(30):  # 30 requests of one version, from three conversations, at once
        conversation = CONVERSATIONS[in_flight % 3]
        width = needed_width(in_flight, outstanding, REPLICAS)
        endpoint = choose("support@v7", REPLICAS, outstanding, 1.25, conversation, width)
        assert outstanding[endpoint] < capacity(outstanding, REPLICAS, 1.25)
        outstanding[endpoint] += 1
    assert max(outstanding.values()) <= 1.25 * 30 / 3 + 1


def test_a_versions_width_is_held_while_its_traffic_ebbs() -> None:
    """A width that followed each moment's load would move conversations back and forth."""
    spread = Spread(hold_s=60.0)
    assert spread.width("v7", 1, now=0.0) == 1
    assert spread.width("v7", 3, now=1.0) == 3  # busy: three replicas
    assert spread.width("v7", 1, now=30.0) == 3  # a lull: its conversations stay where they are
    assert spread.width("v7", 3, now=50.0) == 3  # needed again: held from here
    assert spread.width("v7", 2, now=109.0) == 3
    assert spread.width("v7", 2, now=111.0) == 2  # a minute since three were needed
    assert spread.width("v7", 1, now=200.0) == 1
    assert spread.width("v8", 1, now=200.0) == 1 and not spread._held  # quiet keys: no entry

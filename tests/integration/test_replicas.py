"""Two replicas of everything on the session stack: two proxies, two judges and two learners (each
replica its own config, ports and state, as two pods would be), three aliases, then one replica
of each SIGKILLed while its learner is mid-round.

What must hold (ARCHITECTURE.md's scale-out rules, helm/ratchet/README.md):
- every exchange answered through either proxy is on ``ratchet.traffic`` once;
- the judges (one consumer group) share ``ratchet.traffic``'s partitions, and no traffic record
  is judged twice, not even the batch the killed judge had not committed;
- the learners never run rounds of one alias at once (the alias's lease), never settle a version
  twice, never write the same version, never train a group into two settled rounds;
- after the kill the survivors do the work: the surviving learner takes the killed one's alias
  over once its lease expires and settles a round, the surviving judge keeps making groups, the
  surviving proxy keeps answering.

Rounds are tiny (1 step, 2 groups of 2 answers of 8 tokens, a gate of 2 pairs) and the verifier
is a hash of the answer's text (tests/integration/replica_reward.py): every group has a spread,
and versions that answer alike tie in the gate, which passes at threshold 0 (promoted at once).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from embedded.processes import Part, Stack, wait_until
from embedded.stack import judge_part, learner_part, proxy_part
from judge.service import is_heldout
from learner.leases import lease_key
from ratchet.bus import make_consumer
from ratchet.records import (
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    TRAFFIC_TOPIC,
    HeldoutPrompt,
    ScoredGroup,
    TrafficRecord,
    decode,
    prompt_hash,
)
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings, load_settings
from ratchet.store import AdapterStore
from tasks.demo import load_prompts
from tests.integration.conftest import BASE_MODEL, Embedded, free_port

pytestmark = pytest.mark.integration

# Keyed by alias, these land on partitions 2, 1 and 0 of ratchet.groups' three: each learner
# gets at least one of them.
ALIASES = ("rep-a", "rep-b", "rep-c")
LEASE_TTL_S = 4.0
HELDOUT_FRACTION = 0.25
OUTCOMES = {"promote", "reject", "canary"}
SETTLED = re.compile(r"(rep-[abc]): v(\d+) (promoted|canary|rejected) \(")


def replica_config(env: Embedded, home: Path) -> Path:
    """One replica's ratchet.yaml: the session stack's Kafka, Redis, vLLM and adapter store, its
    own ports and state; consumer groups shared with the other replica."""
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)
    # A killed member's partitions move on after this (the least Ratchet allows).
    config["kafka"] = {"session_timeout_ms": 3000}
    config["proxy"] = {**config["proxy"], "port": free_port()}
    config["judge"] = {
        "consumer_group": "judge-replicas",
        "metrics_port": free_port(),
        "poll_records": 4,
        "concurrency": 2,
    }
    config["learner"] = {
        "consumer_group": "learner-replicas",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        "device": "cpu",
        "batch_groups": 2,
        "min_groups": 1,
        "interval_s": 1,
        "steps_per_round": 1,
        # Barely moves the weights: the gate's greedy answers stay alike, a tie, which passes.
        "learning_rate": 1e-6,
        "lora": {"rank": 4, "alpha": 8},
        "max_staleness": 10,
        "lease_ttl_s": LEASE_TTL_S,
        "canary_check_s": 0.5,
    }
    alias = {
        "base_model": BASE_MODEL,
        "reward": {
            "kind": "verifier",
            "verifier": "tests.integration.replica_reward:text_hash_reward",
        },
        "learning": {"group_size": 2, "heldout_fraction": HELDOUT_FRACTION, "dedup_window_s": 0},
        "sampling": {"max_tokens": 8},
        "gate": {
            "min_pairs": 2,
            "max_pairs": 2,
            "max_tokens": 8,
            "threshold": 0.0,
        },
        "canary": {"weight": 0.0},
    }
    config["aliases"] = dict.fromkeys(ALIASES, alias)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "ratchet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Replicas:
    """proxy-1, judge-1, learner-1, proxy-2, ...: one Stack (one log) per process."""

    stacks: dict[str, Stack] = field(default_factory=dict)
    settings: dict[str, RatchetSettings] = field(default_factory=dict)

    def add(self, part: Part, settings: RatchetSettings, state: Path) -> None:
        self.stacks[part.name] = Stack([part], state)
        self.settings[part.name] = settings

    def part(self, name: str) -> Part:
        return self.stacks[name].part(name)

    def pid(self, name: str) -> int | None:
        process = self.part(name).process
        return process.pid if process is not None else None

    def start(self) -> None:
        with ThreadPoolExecutor(len(self.stacks)) as pool:
            for future in [pool.submit(stack.start) for stack in self.stacks.values()]:
                future.result()

    def stop(self) -> None:
        with ThreadPoolExecutor(len(self.stacks)) as pool:
            list(pool.map(lambda stack: stack.stop(), self.stacks.values()))

    def kill(self, name: str) -> None:
        process = self.part(name).process
        assert process is not None and process.poll() is None, f"{name} is not running"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        self.part(name).process = None

    def log(self, name: str) -> str:
        path = self.part(name).log_path
        return path.read_text(errors="replace") if path and path.exists() else ""

    def metric(self, name: str, sample: str, **labels: str) -> float:
        s = self.settings[name]
        port = s.judge.metrics_port if name.startswith("judge") else s.learner.metrics_port
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return sum(
            x.value
            for family in text_string_to_metric_families(text)
            for x in family.samples
            if x.name == sample and labels.items() <= x.labels.items()
        )

    def proxy_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.settings[name].proxy.port}"


@pytest.fixture
def replicas(embedded: Embedded, tmp_path: Path) -> Iterator[Replicas]:
    for alias in ALIASES:
        embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    group = Replicas()
    for i in (1, 2):
        home = tmp_path / f"replica{i}"
        config = replica_config(embedded, home)
        settings = load_settings(config)
        for make in (proxy_part, judge_part, learner_part):
            part = make(settings, config)
            part.name = f"{part.name}-{i}"
            if part.name.startswith("learner"):
                part.env = {"OMP_NUM_THREADS": "1"}  # two trainers beside vLLM on two cores
            group.add(part, settings, home / "state")
    try:
        group.start()
        yield group
    finally:
        group.stop()


def prompts_by_alias(secret: bytes) -> dict[str, tuple[list[Any], list[Any]]]:
    """Per alias (held-out prompts, training prompts): distinct demo prompts, two the judge will
    hold out for the gate and six it will turn into groups."""
    pool = iter(load_prompts()[344:])  # prompts no other integration test sends
    chosen: dict[str, tuple[list[Any], list[Any]]] = {}
    for alias in ALIASES:
        held: list[Any] = []
        train: list[Any] = []
        while len(held) < 2 or len(train) < 6:
            messages = next(pool)["messages"]
            side = held if is_heldout(secret, prompt_hash(messages), HELDOUT_FRACTION) else train
            if len(side) < (2 if side is held else 6):
                side.append(messages)
        chosen[alias] = (held, train)
    return chosen


class Traffic:
    """Requests through the proxies, each with its own x-request-id; what answered each one."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.answered: dict[str, str] = {}  # request id -> the proxy that answered it
        self.failed: list[str] = []
        self.count = itertools.count()
        self.client = httpx.Client(timeout=120)

    def ask(self, proxy: str, alias: str, messages: list[Any]) -> int:
        rid = f"replicas-{proxy}-{next(self.count)}"
        try:
            reply = self.client.post(
                f"{self.replicas.proxy_url(proxy)}/v1/chat/completions",
                headers={"x-request-id": rid},
                json={"model": alias, "messages": messages, "max_tokens": 8},
            )
            status = reply.status_code
        except httpx.TransportError:
            status = 0
        if status == 200:
            self.answered[rid] = proxy
        else:
            self.failed.append(f"{proxy} {status}")
        return status

    def stream(self, proxies: Callable[[], list[str]], work: list[tuple[str, Any]]) -> Any:
        """Keep asking, round-robin over the live `proxies()` and `work`, until stopped."""
        stop = threading.Event()

        def run() -> None:
            for i, (alias, messages) in enumerate(itertools.cycle(work)):
                if stop.is_set():
                    return
                live = proxies()
                self.ask(live[i % len(live)], alias, messages)

        thread = threading.Thread(target=run, name="traffic", daemon=True)
        thread.start()
        return stop, thread


def read_topic(settings: RatchetSettings, topic: str, done: Callable[[list[Any]], bool]) -> Any:
    """Every record of `topic` from its start, re-read until `done(records)` (or 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        consumer = make_consumer(
            settings.kafka_bootstrap_servers,
            settings.kafka,
            [topic],
            None,
            consumer_timeout_ms=1500,
        )
        try:
            records = [r for m in consumer if (r := decode(m.topic, m.value)) is not None]
        finally:
            consumer.close()
        if done(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def history(writer: RegistryWriter, alias: str) -> list[dict[str, Any]]:
    """The alias's lifecycle events, oldest first."""
    return list(reversed(writer.history(alias, 1000)))


def open_candidate(events: list[dict[str, Any]]) -> int | None:
    """The version of a round under way: a candidate with no outcome yet."""
    for event in reversed(events):
        if event["kind"] in OUTCOMES:
            return None
        if event["kind"] == "candidate":
            return int(event["version"])
    return None


def settled(events: list[dict[str, Any]]) -> list[int]:
    return [int(e["version"]) for e in events if e["kind"] in OUTCOMES]


@pytest.mark.timeout(600)
def test_two_replicas_of_everything_share_the_work_and_survive_losing_one(
    embedded: Embedded, replicas: Replicas
) -> None:
    started = time.monotonic()
    env = embedded
    writer = env.registry
    store = AdapterStore(env.settings.store_dir)  # type: ignore[arg-type]
    client = redis.Redis.from_url(env.settings.redis_url)
    prompts = prompts_by_alias(env.secret)
    traffic = Traffic(replicas)

    # 1. Held-out prompts first (the gate needs two per alias), then training prompts, through
    # either proxy in turn.
    proxies = itertools.cycle(("proxy-1", "proxy-2"))
    for alias, (held, train) in prompts.items():
        for messages in held + train[:3]:
            assert traffic.ask(next(proxies), alias, messages) == 200
    first_wave = dict(traffic.answered)
    wait_until(
        lambda: all(settled(history(writer, a)) for a in ALIASES),
        300,
        "a settled round for every alias",
        interval_s=0.5,
    )
    first_rounds = {
        name: len(SETTLED.findall(replicas.log(name))) for name in ("learner-1", "learner-2")
    }
    print(f"\nfirst rounds settled after {time.monotonic() - started:.0f}s: {first_rounds}")
    assert all(first_rounds.values()), f"both learners must take part: {first_rounds}"

    # 2. Steady traffic through both proxies; the moment a learner is mid-round (its candidate
    # written, the gate under way, holding the alias's lease), SIGKILL its replica's proxy, judge
    # and learner together, as a lost node would.
    alive = {"proxy-1", "proxy-2"}
    work = [(a, m) for a, (_, train) in prompts.items() for m in train[3:]]
    stop, thread = traffic.stream(lambda: sorted(alive), work)
    holders = {replicas.pid(f"learner-{i}"): i for i in (1, 2)}
    caught: dict[str, Any] = {}

    def mid_round() -> bool:
        for alias in ALIASES:
            token = client.get(lease_key(alias))
            if token is None:
                continue
            index = holders.get(int(token.decode().split(":")[-2]))
            version = open_candidate(history(writer, alias))
            if index is not None and version is not None:
                caught.update(alias=alias, index=index, version=version)
                return True
        return False

    try:
        wait_until(mid_round, 240, "a learner mid-round", interval_s=0.02)
        lost = caught["index"]
        survivor = 3 - lost
        judged_by_lost = replicas.metric(f"judge-{lost}", "ratchet_judge_groups_total")
        rounds_by_lost = len(SETTLED.findall(replicas.log(f"learner-{lost}")))
        for kind in ("learner", "judge", "proxy"):
            replicas.kill(f"{kind}-{lost}")
        alive.discard(f"proxy-{lost}")
        killed_at = time.monotonic()
        alias, orphan = caught["alias"], caught["version"]
        print(f"killed replica {lost} while learner-{lost} gated {alias}@v{orphan}")

        # The survivor takes the alias over once the lease expires, and settles a round of it.
        wait_until(
            lambda: any(v > orphan for v in settled(history(writer, alias))),
            180,
            f"learner-{survivor} to settle a round of {alias} after the kill",
            interval_s=0.2,
        )
        takeover_s = time.monotonic() - killed_at
        # The surviving judge keeps making groups of the traffic the surviving proxy answers.
        judged = replicas.metric(f"judge-{survivor}", "ratchet_judge_groups_total")
        wait_until(
            lambda: (
                replicas.metric(f"judge-{survivor}", "ratchet_judge_groups_total") >= judged + 3
            ),
            120,
            f"judge-{survivor} to keep judging",
            interval_s=0.5,
        )
        answered_after = sum(p == f"proxy-{survivor}" for p in traffic.answered.copy().values())
    finally:
        stop.set()
        thread.join(150)

    assert not [f for f in traffic.failed if f.startswith(f"proxy-{survivor}")], traffic.failed

    # 3. Logged once: every exchange of the first wave and every one the survivor answered.
    must_log = {
        rid
        for rid, proxy in traffic.answered.items()
        if rid in first_wave or proxy == f"proxy-{survivor}"
    }

    def ours(records: list[Any]) -> list[TrafficRecord]:
        return [
            r
            for r in records
            if isinstance(r, TrafficRecord) and (r.client_request_id or "").startswith("replicas-")
        ]

    logged = ours(
        read_topic(
            env.settings,
            TRAFFIC_TOPIC,
            lambda rs: must_log <= {r.client_request_id for r in ours(rs)},
        )
    )
    copies = Counter(r.client_request_id for r in logged)
    assert must_log <= set(copies), sorted(must_log - set(copies))[:5]
    duplicated_records = {rid: n for rid, n in copies.items() if n > 1}
    assert not duplicated_records, duplicated_records
    assert len({r.request_id for r in logged}) == len(logged)
    per_proxy = Counter(traffic.answered[r.client_request_id] for r in logged)  # type: ignore[index]

    # 4. Judged once: no traffic record gave two groups (or a group and a held-out prompt).
    outputs = [
        r
        for topic in (GROUPS_TOPIC, HELDOUT_TOPIC)
        for r in read_topic(env.settings, topic, lambda _: True)
        if isinstance(r, ScoredGroup | HeldoutPrompt) and r.alias in ALIASES
    ]
    judged_copies = Counter(r.traffic_request_id for r in outputs)
    duplicated_judging = {rid: n for rid, n in judged_copies.items() if n > 1}
    assert not duplicated_judging, duplicated_judging
    judged_by_survivor = replicas.metric(f"judge-{survivor}", "ratchet_judge_groups_total")
    # Records of the killed judge's uncommitted batch that it had finished: skipped, not redone.
    skipped = replicas.metric(
        f"judge-{survivor}", "ratchet_judge_skipped_total", reason="already_judged"
    )
    assert judged_by_lost > 0 and judged_by_survivor > 0, (judged_by_lost, judged_by_survivor)

    # 5. The learners: per alias, rounds never interleave (each gate and outcome belongs to the
    # newest candidate), no version is written or settled twice, every candidate is in the
    # store, and no group is in two settled rounds.
    for name in ALIASES:
        events = history(writer, name)
        candidates = [int(e["version"]) for e in events if e["kind"] == "candidate"]
        assert len(candidates) == len(set(candidates)), (name, candidates)
        assert all(store.exists(name, v) for v in candidates), (name, candidates)
        newest = None
        for event in events:
            if event["kind"] == "candidate":
                newest = event["version"]
            elif event["kind"] in OUTCOMES | {"gate"} and event["actor"] == "learner":
                assert event["version"] == newest, (
                    name,
                    [(e["kind"], e["version"]) for e in events],
                )
        outcomes = settled(events)
        assert len(outcomes) == len(set(outcomes)), (name, outcomes)
        promoted = [int(e["version"]) for e in events if e["kind"] == "promote"]
        assert len(promoted) == len(set(promoted)), (name, promoted)
        trained = Counter(g for v in outcomes for g in store.meta(name, v).get("group_ids", []))
        assert not [g for g, n in trained.items() if n > 1], (name, trained)

    rounds = {
        f"learner-{lost}": rounds_by_lost,
        f"learner-{survivor}": len(SETTLED.findall(replicas.log(f"learner-{survivor}"))),
    }
    promotions = {a: sum(e["kind"] == "promote" for e in history(writer, a)) for a in ALIASES}
    print(
        "\nreplicas: records logged per proxy "
        f"{dict(sorted(per_proxy.items()))}; groups judged per judge "
        f"{{'judge-{lost}': {judged_by_lost:.0f} (until killed), "
        f"'judge-{survivor}': {judged_by_survivor:.0f}}}; rounds settled per learner {rounds}; "
        f"promotions per alias {promotions}; duplicates: records {len(duplicated_records)}, "
        f"judged {len(duplicated_judging)}, versions 0; records judge-{survivor} skipped as "
        f"already judged {skipped:.0f}; {alias} settled by learner-{survivor} "
        f"{takeover_s:.1f}s after the kill (lease TTL {LEASE_TTL_S:g}s, plus the group's "
        f"rebalance and its other aliases' rounds); proxy-{survivor} answered "
        f"{answered_after}; wall {time.monotonic() - started:.0f}s"
    )
    assert rounds[f"learner-{survivor}"] > 0
    assert answered_after > 0

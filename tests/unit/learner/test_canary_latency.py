"""The canary's latency test over clients: measured by the real counter into a real Redis and
decided by the real watcher through the real Lifecycle (records handed to ``count()`` as the
consumer would); its looks made once, at the error test's levels."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from learner.canary import CanaryWatcher, canary_verdict
from learner.canary_clients import client_evidence
from learner.canary_latency import (
    LatencyEvidence,
    LatencyLook,
    due_looks,
    latency_rollback,
    read_client_latency,
    recorded_looks,
    request_latency,
)
from learner.metrics import LearnerMetrics
from ratchet.canary_state import ArmStats, canary_key, read_client_counts, reset_counts
from ratchet.lifecycle import Lifecycle
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord
from ratchet.registry import RegistryWriter
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings
from ratchet.store import AdapterStore

ALIAS = "support"
CONFIG = CanaryConfig(
    min_requests=40,
    client_request_share=0.1,
    min_clients=20,
    max_latency_increase=0.25,
    min_duration_s=30.0,
    feedback_wait_s=60.0,
)


def record(
    arm: str,
    key: str,
    ms_a_token: float,
    tokens: int = 100,
    status: int = 200,
    code: str | None = None,
    stream: bool = False,
) -> TrafficRecord:
    error = None if code is None else {"message": "m", "type": "t", "param": None, "code": code}
    version = 2 if arm == "canary" else 1
    return TrafficRecord.model_validate(
        {
            "request_id": "r",
            "endpoint": "chat.completions",
            "alias": ALIAS,
            "gen_ai.request.model": ALIAS,
            "gen_ai.response.model": f"{ALIAS}@v{version}",
            "version": version,
            "canary_arm": arm,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
            "gen_ai.usage.output_tokens": tokens,
            "status": status,
            "error": error,
            "latency_ms": ms_a_token * tokens,
            "ttft_ms": ms_a_token if stream else None,
            "api_key_hash": key,
            "stream": stream,
        }
    )


def message(traffic: TrafficRecord) -> Any:
    return SimpleNamespace(topic=TRAFFIC_TOPIC, value=traffic.to_json())


def test_only_successful_answers_are_measured_per_token_and_streams_by_first_token() -> None:
    assert request_latency(record("active", "k", 20.0, tokens=50)) == pytest.approx(20.0)
    # A stream's total time runs at the client's reading pace: its first chunk is measured.
    assert request_latency(record("active", "k", 300.0, stream=True)) == 300.0
    assert request_latency(record("active", "k", 20.0, status=400)) is None
    assert request_latency(record("active", "k", 20.0, status=502, code="upstream_error")) is None
    assert request_latency(record("active", "k", 20.0, status=504, code="upstream_timeout")) is None


# --- the watcher, in a real Redis -------------------------------------------------------------


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    return RatchetSettings(
        redis_url=redis_url, home=tmp_path, aliases={ALIAS: AliasConfig(canary=CONFIG)}
    )


@pytest.fixture
def lifecycle(settings: RatchetSettings) -> Lifecycle:
    """v1 active, v2 its canary, the counts reset as the learner starts one."""
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)

    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text('{"r": 8}')

    for version in (1, 2):
        store.write(ALIAS, version, write_adapter, "/models/base", {"parent_version": version - 1})
    life = Lifecycle(RegistryWriter(settings.redis_url, settings.aliases), store, sink=None)
    life.promote(ALIAS, 1)
    life.start_canary(ALIAS, 2, 0.1, {}, also=lambda pipe: reset_counts(pipe, ALIAS, 2))
    return life


def watcher_for(settings: RatchetSettings, lifecycle: Lifecycle) -> CanaryWatcher:
    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event())
    watcher.routes = lifecycle.writer.read_all().routes
    return watcher


def served(rng: random.Random, slowdown: float, clients: int = 40) -> list[Any]:
    """Each client's few requests on each arm: its own pace (clients differ by their hardware
    share and prompts), jittered per request, the canary ``slowdown`` times slower."""
    messages = []
    for i in range(clients):
        pace = rng.uniform(15.0, 30.0)
        for arm, factor in (("active", 1.0), ("canary", slowdown)):
            for _ in range(3):
                ms = pace * factor * rng.uniform(0.8, 1.2)
                messages.append(message(record(arm, f"{arm}-key{i}", ms, rng.randint(20, 400))))
    return messages


def age_canary(lifecycle: Lifecycle, seconds: float) -> None:
    key = canary_key(ALIAS)
    started = float(lifecycle.writer.redis.hget(key, "started"))  # type: ignore[arg-type]
    lifecycle.writer.redis.hset(key, "started", started - seconds)


def test_a_canary_twice_as_slow_is_rolled_back_for_its_latency(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    watcher = watcher_for(settings, lifecycle)
    watcher.count(served(random.Random(1), slowdown=2.0))
    client = lifecycle.writer.redis
    measured = read_client_latency(client, ALIAS, "canary")
    assert len(measured) == 40 and all(n == 3 for _, n in measured.values())
    # The latency fields do not disturb the requests' and failures' counts.
    assert read_client_counts(client, ALIAS, "canary")["canary-key0"] == (3, 0)
    watcher.check()
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and (route.active, route.canary) == (1, None)
    event = lifecycle.writer.history(ALIAS)[0]
    assert event["kind"] == "rollback" and event["detail"]["reason"].startswith("latency:")
    assert client.hget(canary_key(ALIAS), "latency_look:v2:0") is not None


def test_an_equal_canary_is_not_rolled_back_and_promotes_unrated_after_its_time(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    watcher = watcher_for(settings, lifecycle)
    watcher.count(served(random.Random(2), slowdown=1.0))
    watcher.check()
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary == 2  # waits for its ratings
    age_canary(lifecycle, 61.0)
    watcher.check()
    event = lifecycle.writer.history(ALIAS)[0]
    assert event["kind"] == "promote" and event["detail"]["reason"].startswith("unrated")


def test_one_client_sending_huge_requests_to_the_canary_does_not_roll_it_back(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Among 40 honest clients a key, on the canary only, sends requests whose long prompts
    take seconds a token: trimmed, it is one unit at the end, not a slow canary."""
    watcher = watcher_for(settings, lifecycle)
    messages = served(random.Random(3), slowdown=1.0)
    messages += [message(record("canary", "huge", 5_000.0, tokens=2)) for _ in range(200)]
    watcher.count(messages)
    watcher.check()
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary == 2
    latency = LatencyEvidence.of(
        *(read_client_latency(lifecycle.writer.redis, ALIAS, arm) for arm in ("active", "canary"))
    )
    # Its 200 requests are one unit of the canary's 41, trimmed from the top.
    assert len(latency.canary) == 41 and max(latency.canary) == pytest.approx(5_000.0)
    canary, active, _ = latency.slower(1.25, CONFIG.client_trim, CONFIG.alpha)
    assert canary < 1.1 * active
    assert latency_rollback(latency, CONFIG, point=False) is None


def test_a_look_is_made_once_and_belongs_to_its_canary(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    even = LatencyEvidence(tuple([20.0 + i % 5 for i in range(20)]), tuple([20.0] * 20))
    first = recorded_looks(client, ALIAS, 2, even, CONFIG)
    assert [look.index for look in first] == [0] and first[0].lower < 0
    # Slower clients arrive before 40 an arm: the first look stands, no test until then.
    slow = LatencyEvidence(even.active + (20.0,) * 10, (60.0,) * 30)
    assert latency_rollback(slow, CONFIG, point=False) is not None
    assert recorded_looks(client, ALIAS, 2, slow, CONFIG) == first
    assert latency_rollback(slow, CONFIG, False, first) is None
    assert recorded_looks(client, ALIAS, 3, slow, CONFIG)[0].lower > 0  # v3's own look


def test_fixed_looks_hold_alpha_over_many_checks_where_a_test_at_each_check_does_not() -> None:
    """Equal arms and a margin next to none, clients arriving a few per check: a bound tested at
    every check rolls back far more than alpha of these canaries; the looks, each made once,
    stay within alpha."""
    config = CanaryConfig(min_clients=20, max_latency_increase=1e-9, alpha=0.05)
    rng = random.Random(11)
    runs, per_check, checks = 200, 4, 40
    every_check = fixed = 0
    for _ in range(runs):
        arms: list[list[float]] = [[], []]
        made: dict[int, LatencyLook] = {}
        rolled_every = rolled_fixed = False
        for _check in range(checks):
            for units in arms:
                units.extend(rng.lognormvariate(3.0, 0.4) for _ in range(per_check))
            evidence = LatencyEvidence(tuple(arms[0]), tuple(arms[1]))
            for look in due_looks(evidence, config, made):
                made[look.index] = look
            looks = sorted(made.values(), key=lambda look: look.index)
            if len(arms[0]) >= config.min_clients:  # a bound recomputed at every check
                rolled_every |= evidence.slower(1.0, config.client_trim, config.alpha)[2] > 0
            rolled_fixed |= latency_rollback(evidence, config, False, looks) is not None
        every_check += rolled_every
        fixed += rolled_fixed
    assert fixed / runs <= config.alpha
    assert every_check / runs > 2 * config.alpha


def test_with_too_few_clients_the_point_estimate_decides_an_unrated_canary() -> None:
    """A one-key app: no look can be made, and before its unrated promotion the canary's mean
    time a token must be within the margin."""
    stats = ArmStats(60, 0, clients=1, served=60)
    unrated = client_evidence([], [], CONFIG)
    slow = LatencyEvidence((20.0,), (40.0,))
    verdict, reason = canary_verdict(
        stats, stats, CONFIG, 61.0, unrated, False, latency=slow, latency_looks=[]
    )
    assert verdict == "rollback" and "latency:" in reason
    even = LatencyEvidence((20.0,), (22.0,))
    verdict, _ = canary_verdict(
        stats, stats, CONFIG, 61.0, unrated, False, latency=even, latency_looks=[]
    )
    assert verdict == "promote"
    off = CanaryConfig(**{**CONFIG.model_dump(), "max_latency_increase": 0.0})
    verdict, _ = canary_verdict(stats, stats, off, 61.0, unrated, False, latency=slow)
    assert verdict == "promote"

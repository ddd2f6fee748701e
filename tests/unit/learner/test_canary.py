"""The canary: the pure verdict, and the watcher counting traffic and feedback records in a real
Redis and then promoting or rolling back through the real Lifecycle (no Kafka: the records are
handed to ``count()`` as the consumer would)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from learner import canary_counter
from learner.canary import CanaryWatcher, canary_verdict, counted, request_cap
from learner.canary_clients import client_evidence
from learner.canary_errors import ErrorEvidence, error_rollback
from learner.canary_ratings import Rating
from learner.canary_weight import minute_of, requests_key
from learner.leases import lease_key
from learner.metrics import LearnerMetrics
from learner.ratings import ratings_key
from proxy.upstream import stream_dropped
from ratchet.canary_state import ArmStats, read_counts, reset_counts
from ratchet.lease import Lease
from ratchet.lifecycle import Lifecycle
from ratchet.records import (
    ANONYMOUS_CLIENT,
    FEEDBACK_TOPIC,
    TRAFFIC_TOPIC,
    FeedbackRecord,
    TrafficRecord,
    utc_now,
)
from ratchet.registry import RegistryWriter
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import is_eval_rating
from ratchet.secrets import client_source, server_secret
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings
from ratchet.store import AdapterStore

ALIAS = "support"
CONFIG = CanaryConfig(
    weight=0.1,
    min_requests=10,
    client_request_share=0.5,  # 5 requests of one client count
    max_error_rate_increase=0.05,
    max_feedback_drop=0.2,
    min_feedback=3,
    min_clients=4,
    client_ratings=1,
    feedback_wait_s=60.0,
    min_duration_s=30.0,
)
LATE = 61.0  # a canary age past CONFIG's wait for feedback


# --- the verdict ------------------------------------------------------------------------------


def ratings(active: list[float], canary: list[float], config: CanaryConfig = CONFIG) -> Any:
    """The evidence of these ratings, each from its own client."""
    return client_evidence(
        [Rating(f"a{i}", x) for i, x in enumerate(active)],
        [Rating(f"c{i}", x) for i, x in enumerate(canary)],
        config,
    )


NONE = ratings([], [])


def arm(requests: int, clients: int = 10, errors: int = 0) -> ArmStats:
    """An arm's stats as counted by client."""
    return ArmStats(requests, errors, clients=clients, served=requests)


def test_one_clients_requests_count_only_up_to_its_share() -> None:
    """Audit N-2: 500 one-token requests from one key brought a canary to its decision."""
    flood = counted(ArmStats(500), {"flooder": (500, 0)}, CONFIG)
    assert (
        (flood.requests, flood.clients, flood.served)
        == (request_cap(CONFIG), 1, 500)
        == (
            5,
            1,
            500,
        )
    )
    errors = counted(ArmStats(60), {"a": (50, 50), "b": (5, 0), "c": (5, 1)}, CONFIG)
    assert (errors.requests, errors.errors) == (15, 6)
    # Without API keys everyone is one client: not capped, each request a client.
    alone = counted(ArmStats(40), {ANONYMOUS_CLIENT: (40, 2)}, CONFIG)
    assert (alone.requests, alone.errors, alone.clients) == (40, 2, 40)


def test_the_verdict_waits_for_enough_canary_requests_counted_by_client() -> None:
    verdict, reason = canary_verdict(arm(100), arm(9, errors=9), CONFIG, LATE, NONE)
    assert verdict == "wait" and "9 of 10" in reason
    # The audit's case: 150 and 50 requests, 5 s old, no rating; from one key they count 5.
    one_key = counted(ArmStats(50), {"k": (50, 0)}, CONFIG)
    verdict, reason = canary_verdict(arm(150, clients=1), one_key, CONFIG, 5.0, NONE)
    assert verdict == "wait" and "5 of 10" in reason


def test_the_verdict_rolls_back_on_an_error_rate_excess() -> None:
    # An error rate excess does not wait for ratings, and good ratings do not outweigh it.
    good = ratings([0.0] * 20, [1.0] * 20)
    assert good.test.decision == "pass"
    verdict, reason = canary_verdict(arm(100, errors=1), arm(10, errors=8), CONFIG, 0.0, good)
    assert verdict == "rollback" and reason.startswith("error_rate:")
    # One failure in ten is not shown to be worse by more than the margin on ten units.
    verdict, _ = canary_verdict(arm(100, errors=1), arm(10, errors=1), CONFIG, 0.0, good)
    assert verdict == "promote"
    # At the margin exactly (0.05 more), not beyond it: the canary is fine.
    verdict, _ = canary_verdict(arm(100), arm(100, errors=5), CONFIG, LATE, NONE)
    assert verdict == "promote"


def test_errors_are_counted_by_client_and_one_key_cannot_veto() -> None:
    """Audit: one key (5 requests counted) provoking failures vetoed through a flat error-rate
    threshold. Each client is one unit, its own share of failures, and a rollback needs a
    test on min_clients clients an arm."""
    honest = {f"u{i}": (5, 0) for i in range(30)}
    one_key = ErrorEvidence.of(honest, {**honest, "mallory": (5, 5)})
    assert one_key.excess() == pytest.approx(1 / 31)  # past the default margin, 0.02
    default = CONFIG.model_copy(update={"max_error_rate_increase": 0.02})
    assert error_rollback(one_key, default, few=False) is None
    verdict, _ = canary_verdict(arm(150), arm(155), default, LATE, NONE, errors=one_key)
    assert verdict == "promote"
    broken = ErrorEvidence.of(honest, {f"u{i}": (5, 3) for i in range(30)})
    reason = error_rollback(broken, CONFIG, few=False)
    assert reason is not None and reason.startswith("error_rate: canary 0.600")
    # Fewer clients than min_clients: no test to make, so nothing before the wait; after it
    # the point estimate decides.
    few = ErrorEvidence.of({"a": (5, 0)}, {"a": (5, 2)})
    assert error_rollback(few, CONFIG, few=False) is None
    assert error_rollback(few, CONFIG, few=True) is not None


def test_the_verdict_follows_the_client_test_as_soon_as_it_decides() -> None:
    worse = ratings([0.9] * 8, [0.1] * 8)
    assert worse.test.decision == "fail"
    verdict, reason = canary_verdict(arm(100), arm(10), CONFIG, 0.0, worse)
    assert verdict == "rollback" and reason.startswith("ratings: worse")
    assert "clients an arm" in reason
    same = ratings([0.9] * 40, [0.9] * 40)  # no worse: the margin (0.2) is cleared
    assert same.test.decision == "pass"
    verdict, reason = canary_verdict(arm(100), arm(10), CONFIG, 0.0, same)
    assert verdict == "promote" and reason.startswith("ratings: not worse by 0.2")


def test_an_alias_that_learns_from_ratings_is_never_decided_unrated_before_its_wait() -> None:
    """Audit N-2: 'unrated' was judged the moment both arms held no rating."""
    for age in (0.0, 5.0, 59.0):
        verdict, reason = canary_verdict(arm(1000), arm(1000), CONFIG, age, NONE)
        assert verdict == "wait" and "deciding without them after 60 s" in reason
    verdict, reason = canary_verdict(arm(1000), arm(1000), CONFIG, LATE, NONE)
    assert verdict == "promote" and reason.startswith("unrated"), reason


def test_an_alias_without_feedback_decides_on_errors_after_its_minimum_time() -> None:
    verdict, _ = canary_verdict(arm(100), arm(100), CONFIG, 29.0, NONE, expects_ratings=False)
    assert verdict == "wait"
    verdict, reason = canary_verdict(arm(100), arm(100), CONFIG, 30.0, NONE, False)
    assert verdict == "promote" and "error rate 0.000" in reason


def test_when_the_wait_runs_out_the_client_test_looks_once_and_decides() -> None:
    """Too few clients per arm for a look (3 < 4) until the wait's end, where every client
    that rated is looked at once; a canary not shown within the margin is rolled back."""
    config = CONFIG.model_copy(update={"client_ratings": 2})  # one rating each: none counts
    better = ratings([0.5] * 8, [0.9] * 8, config)
    assert better.test.decision == "continue"
    verdict, _ = canary_verdict(arm(100), arm(40), config, 59.0, better)
    assert verdict == "wait"
    verdict, reason = canary_verdict(arm(100), arm(40), config, LATE, better)
    assert verdict == "promote" and "the last look" in reason, reason
    spread = [0.0, 1.0] * 4
    verdict, reason = canary_verdict(
        arm(100), arm(40), config, LATE, ratings(spread, spread, config)
    )
    assert verdict == "rollback" and "inconclusive at 8 clients" in reason, reason


def test_ratings_from_fewer_clients_than_the_minimum_are_tested_as_any_others() -> None:
    """No step at canary.min_clients (4 here): after the wait three clients on each arm are
    looked at by the same test as forty, both ways: three rating the canary 0 and the active 1
    roll it back, the reverse promotes it, and an even split is not shown within the margin."""
    worse = ratings([1.0] * 3, [0.0] * 3)
    verdict, reason = canary_verdict(arm(100), arm(40), CONFIG, LATE, worse)
    assert verdict == "rollback" and "at 3 clients" in reason, reason
    better = ratings([0.0] * 3, [1.0] * 3)
    verdict, reason = canary_verdict(arm(100), arm(40), CONFIG, LATE, better)
    assert verdict == "promote" and "at 3 clients" in reason, reason
    even = ratings([0.0, 1.0, 1.0], [1.0, 0.0, 1.0])
    verdict, reason = canary_verdict(arm(100), arm(40), CONFIG, LATE, even)
    assert verdict == "rollback" and "inconclusive at 3 clients" in reason, reason


def test_with_fewer_clients_than_any_minimum_a_canary_decides_on_what_it_has() -> None:
    """A one-key app that vouches for no user is one client: after the wait it is decided on
    its ratings' mean and the error rate, and the reason says on how few clients."""
    one = counted(ArmStats(40), {"app": (40, 0)}, CONFIG)
    app = client_evidence([Rating("app", 1.0)], [Rating("app", 0.0)], CONFIG)
    verdict, _ = canary_verdict(one, one, CONFIG, 59.0, app)
    assert verdict == "wait"
    verdict, reason = canary_verdict(one, one, CONFIG, LATE, app)
    assert verdict == "rollback" and reason.startswith("decided on 1 clients, below"), reason
    liked = client_evidence([Rating("app", 0.5)], [Rating("app", 0.6)], CONFIG)
    verdict, reason = canary_verdict(one, one, CONFIG, LATE, liked)
    assert verdict == "promote" and "below canary.min_clients 4" in reason, reason
    # Its errors still roll back, once the wait is over.
    failing = counted(ArmStats(40, errors=20), {"app": (40, 20)}, CONFIG)
    verdict, reason = canary_verdict(one, failing, CONFIG, LATE, NONE)
    assert verdict == "rollback" and "error_rate" in reason


# --- the watcher ------------------------------------------------------------------------------


def add_version(store: AdapterStore, version: int) -> None:
    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

    store.write(ALIAS, version, write_adapter, "/models/base", {"parent_version": version - 1})


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    return RatchetSettings(
        redis_url=redis_url, home=tmp_path, aliases={ALIAS: AliasConfig(canary=CONFIG)}
    )


@pytest.fixture
def lifecycle(settings: RatchetSettings) -> Lifecycle:
    return lifecycle_of(settings)


def lifecycle_of(settings: RatchetSettings) -> Lifecycle:
    """v1 and v2 in the store, v1 active."""
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    for version in (1, 2):
        add_version(store, version)
    life = Lifecycle(RegistryWriter(settings.redis_url, settings.aliases), store, sink=None)
    life.promote(ALIAS, 1)
    return life


def start_canary(lifecycle: Lifecycle, version: int = 2) -> None:
    """As the learner starts one: counts reset in the same transaction."""
    lifecycle.start_canary(
        ALIAS, version, 0.1, {}, also=lambda pipe: reset_counts(pipe, ALIAS, version)
    )


def watcher_for(settings: RatchetSettings, lifecycle: Lifecycle) -> CanaryWatcher:
    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event())
    watcher.routes = lifecycle.writer.read_all().routes
    return watcher


def traffic(
    arm: str,
    version: int,
    status: int = 200,
    rid: str | None = None,
    code: str | None = None,
    key: str | None = None,
    source: str | None = None,
    stream: bool = False,
) -> Any:
    """A traffic record as the consumer reads it; ``code`` is the proxy's error code."""
    error = None if code is None else {"message": "m", "type": "t", "param": None, "code": code}
    record = TrafficRecord(
        request_id=rid or "req",
        endpoint="chat.completions",
        alias=ALIAS,
        request_model=ALIAS,
        response_model=f"{ALIAS}@v{version}",
        version=version,
        canary_arm=arm,  # type: ignore[arg-type]
        request={"messages": [{"role": "user", "content": "hi"}]},
        response_id=rid,
        status=status,
        error=error,
        latency_ms=12.0,
        api_key_hash=key,
        source=source,
        stream=stream,
    )
    return SimpleNamespace(topic=TRAFFIC_TOPIC, value=record.to_json())


def feedback(
    completion_id: str, score: float, key: str | None = None, source: str | None = None
) -> Any:
    record = FeedbackRecord(
        completion_id=completion_id, score=score, api_key_hash=key, source=source
    )
    return SimpleNamespace(topic=FEEDBACK_TOPIC, value=record.to_json())


def healthy_traffic(requests: int = 10) -> list[Any]:
    return [traffic("active", 1) for _ in range(requests)] + [
        traffic("canary", 2) for _ in range(requests)
    ]


def age_canary(lifecycle: Lifecycle, seconds: float) -> None:
    """Move the canary's start back in time (as if it had been running that long)."""
    key = f"ratchet:canary:{ALIAS}"
    started = float(lifecycle.writer.redis.hget(key, "started"))  # type: ignore[arg-type]
    lifecycle.writer.redis.hset(key, "started", started - seconds)


def route_of(lifecycle: Lifecycle) -> tuple[int, int | None]:
    route = lifecycle.writer.read(ALIAS)
    assert route is not None
    return route.active, route.canary


def test_a_healthy_canary_is_promoted(settings: RatchetSettings, lifecycle: Lifecycle) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(5))
    watcher.check()
    assert route_of(lifecycle) == (1, 2)  # 5 of 10 canary requests: wait

    # A restarted watcher carries on from the counts in Redis.
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(5))
    version, started, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert version == 2 and stats["canary"].requests == 10 and stats["active"].requests == 10
    assert started is not None and time.time() - started < 30
    watcher.check()
    assert route_of(lifecycle) == (1, 2)  # no feedback yet: it may still be on its way
    age_canary(lifecycle, LATE)
    watcher.check()
    assert route_of(lifecycle) == (2, None)
    event = lifecycle.writer.history(ALIAS)[0]
    assert event["kind"] == "promote" and event["version"] == 2
    assert event["detail"]["via"] == "canary" and event["detail"]["canary"]["requests"] == 10


def test_an_error_rate_excess_rolls_the_canary_back(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    messages = [traffic("active", 1) for _ in range(20)]
    messages += [traffic("canary", 2, status=502, code="upstream_error") for _ in range(8)]
    messages += [traffic("canary", 2) for _ in range(2)]
    watcher.count(messages)
    watcher.check()
    assert route_of(lifecycle) == (1, None)
    status = lifecycle.store.status(ALIAS, 2)
    assert status is not None and status["status"] == "rolled_back"
    event = lifecycle.writer.history(ALIAS)[0]
    assert event["kind"] == "rollback" and event["previous_version"] == 2
    assert event["detail"]["reason"].startswith("error_rate:")
    rollbacks = watcher.metrics.registry.get_sample_value(
        "ratchet_learner_rollbacks_total", {"alias": ALIAS, "reason": "error_rate"}
    )
    assert rollbacks == 1.0


def test_client_errors_are_not_the_canarys_fault(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    # Requests the model server refused (4xx) count for nothing: not even toward min_requests.
    watcher.count(healthy_traffic(5) + [traffic("canary", 2, status=400) for _ in range(5)])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert stats["canary"].requests == 5 and stats["canary"].errors == 0
    age_canary(lifecycle, LATE)
    watcher.check()
    assert route_of(lifecycle) == (1, 2)
    watcher.count(healthy_traffic(5))
    watcher.check()
    assert route_of(lifecycle) == (2, None)


@pytest.mark.parametrize(
    ("status", "code", "stream", "requests", "errors"),
    [
        (502, "upstream_error", False, 4, 4),  # vLLM answered 5xx, or dropped the answer
        (502, "upstream_error", True, 4, 4),  # ... or the stream
        (502, "adapter_unavailable", False, 4, 4),  # vLLM could not load the version
        (503, "upstream_unavailable", False, 4, 4),  # vLLM unreachable
        (504, "upstream_stalled", True, 4, 4),  # the replica stalled (its probe failed)
        # Past proxy.upstream_timeout_s, whole or streamed: a client provokes it with a large
        # max_tokens or a slow read, so it is not the version's failure.
        (504, "upstream_timeout", False, 4, 0),
        (504, "upstream_timeout", True, 4, 0),
        (400, "upstream_rejected", False, 0, 0),  # vLLM refused the client's request
        (400, "invalid_value", False, 0, 0),
        (413, "request_too_large", False, 0, 0),
        (429, "rate_limit_exceeded", False, 0, 0),
        (500, "internal_error", False, 4, 0),  # the proxy's own fault, not the version's
        (503, "queue_full", False, 4, 0),
        (500, None, False, 4, 0),  # no code: nothing says the model server failed
    ],
)
def test_only_upstream_failures_are_the_canarys_errors(
    settings: RatchetSettings,
    lifecycle: Lifecycle,
    status: int,
    code: str | None,
    stream: bool,
    requests: int,
    errors: int,
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count([traffic("canary", 2, status, code=code, stream=stream) for _ in range(4)])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["canary"].requests, stats["canary"].errors) == (requests, errors)


def test_streams_cut_at_the_proxys_deadline_do_not_roll_the_canary_back(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Audit H-1: a client reading its canary streams slowly, or asking for a long max_tokens,
    has them cut at proxy.upstream_timeout_s; three such among ten answers were a 0.23 error
    rate against the active arm's 0 and rolled the canary back."""
    cut = stream_dropped(TimeoutError()).body()["error"]
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    cut_streams = [traffic("canary", 2, status=504, code=cut["code"], stream=True)] * 3
    watcher.count(healthy_traffic(10) + cut_streams)
    age_canary(lifecycle, LATE)
    watcher.check()
    assert route_of(lifecycle) == (2, None)


def test_feedback_counts_once_and_only_from_the_key_that_got_the_answer(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count([traffic("canary", 2, rid="c1", key="alice"), traffic("active", 1, rid="a1")])
    watcher.count(
        [
            feedback("c1", 0.0, key="mallory"),  # not the key that got the answer
            feedback("c1", 0.0),  # no key at all
            feedback("c1", 1.0, key="alice"),
            feedback("c1", 0.0, key="alice"),  # a second rating of the same completion
            feedback("a1", 0.5),  # served without auth, rated without auth
        ]
    )
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["canary"].feedback, stats["canary"].feedback_sum) == (1, 1.0)
    assert (stats["active"].feedback, stats["active"].feedback_sum) == (1, 0.5)
    # A later exchange reusing a completion id does not take it over.
    watcher.count([traffic("canary", 2, rid="a1", key="mallory"), feedback("a1", 0.0, "mallory")])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert stats["active"].feedback == 1 and stats["canary"].feedback == 1


def test_a_ratings_drop_rolls_the_canary_back_once_the_test_is_sure(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    # A client's unit is its first two ratings, one of each arm here: one paired unit a key.
    paired = CONFIG.model_copy(update={"client_ratings": 2})
    settings = settings.model_copy(update={"aliases": {ALIAS: AliasConfig(canary=paired)}})
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(
        [traffic("active", 1, rid=f"a{i}", key=f"k{i}") for i in range(20)]
        + [traffic("canary", 2, rid=f"c{i}", key=f"k{i}") for i in range(20)]
    )
    rate = [feedback(f"a{i}", 1.0, f"k{i}") for i in range(3)]
    watcher.count(rate + [feedback(f"c{i}", 0.0, f"k{i}") for i in range(3)])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["active"].feedback, stats["active"].feedback_sum) == (3, 3.0)
    assert (stats["canary"].feedback, stats["canary"].feedback_sum) == (3, 0.0)
    watcher.check()
    assert route_of(lifecycle) == (1, 2)  # three pairs are not yet evidence at alpha 0.05
    # A restarted watcher replays the stored ratings, and the rest make the test sure.
    watcher = watcher_for(settings, lifecycle)
    rate = [feedback(f"a{i}", 1.0, f"k{i}") for i in range(3, 20)]
    watcher.count(rate + [feedback(f"c{i}", 0.0, f"k{i}") for i in range(3, 20)])
    watcher.check()
    assert route_of(lifecycle) == (1, None)
    detail = lifecycle.writer.history(ALIAS)[0]["detail"]
    assert detail["reason"].startswith("ratings:"), detail
    assert detail["ratings"]["decision"] == "fail" and detail["ratings"]["n"] <= 20


def test_a_canary_decided_by_the_waits_last_look_records_that_look(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """36 clients on each arm, even, and the wait over: rolled back as not shown within the
    margin, and the history's detail says so (not the running test's "continue")."""
    ended = CONFIG.model_copy(
        update={"feedback_wait_s": 0.0, "min_duration_s": 0.0, "client_ratings": 2}
    )
    settings = settings.model_copy(update={"aliases": {ALIAS: AliasConfig(canary=ended)}})
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    n = 36
    watcher.count(
        [traffic("active", 1, rid=f"a{i}", key=f"k{i}") for i in range(n)]
        + [traffic("canary", 2, rid=f"c{i}", key=f"k{i}") for i in range(n)]
    )
    # Each user likes one arm's answer, half of them each: even on average, not sure at all.
    watcher.count(
        [feedback(f"a{i}", float(i % 2), f"k{i}") for i in range(n)]
        + [feedback(f"c{i}", float((i + 1) % 2), f"k{i}") for i in range(n)]
    )
    watcher.check()
    assert route_of(lifecycle) == (1, None)
    detail = lifecycle.writer.history(ALIAS)[0]["detail"]
    assert "when the wait ran out" in detail["reason"], detail
    assert detail["ratings"]["decision"] == "fail", detail["ratings"]
    assert f"inconclusive at {n} clients" in detail["ratings"]["reason"]


def test_one_key_cannot_outvote_the_others_on_the_canary(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """A key is one client: its flood of ratings is one unit, and it stores no more ratings than
    that unit is made of (canary.client_ratings)."""
    settings = settings.model_copy(update={"aliases": {ALIAS: AliasConfig(canary=CONFIG)}})
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(
        [traffic("active", 1, rid=f"a{i}", key=f"k{i}") for i in range(30)]
        + [traffic("canary", 2, rid=f"c{i}", key="mallory") for i in range(30)]
    )
    # Mallory rates the canary's 30 answers 1.0 and the active arm's users rate 0.5: one
    # client on the canary arm, below min_clients: nothing is decided on it.
    watcher.count([feedback(f"c{i}", 1.0, "mallory") for i in range(30)])
    watcher.count([feedback(f"a{i}", 0.5, f"k{i}") for i in range(30)])
    watcher.check()
    assert route_of(lifecycle) == (1, 2)
    assert watcher.metrics.canary_rating_pairs.labels(ALIAS)._value.get() == 0
    redis = lifecycle.writer.redis
    assert redis.llen(f"ratchet:canary:{ALIAS}:ratings:canary") == CONFIG.client_ratings == 1
    summary = json.loads(redis.hget(f"ratchet:canary:{ALIAS}", "ratings"))  # type: ignore[arg-type]
    assert summary["clients"] == {"active": 30, "canary": 1}


def test_a_rating_counts_for_the_client_that_got_the_answer(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Audit N-14: for a vouching key, a rating's client is the user of the rated completion,
    not a user the feedback body names."""
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    secret = server_secret(settings)
    served = client_source(secret, "app", "alice")
    watcher.count([traffic("canary", 2, rid=f"c{i}", key="app", source=served) for i in range(3)])
    claimed = [client_source(secret, "app", f"sock{i}") for i in range(3)]
    watcher.count([feedback(f"c{i}", 0.0, "app", claimed[i]) for i in range(3)])
    stored = lifecycle.writer.redis.lrange(f"ratchet:canary:{ALIAS}:ratings:canary", 0, -1)
    assert [Rating.decode(raw).client for raw in stored] == [served]  # one client, one unit


def test_a_one_key_app_whose_users_are_told_apart_decides_its_canary(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """One API key serving 50 users, its key in proxy.user_vouching_keys: each user is a client
    (the proxy's source), so their ratings decide the canary. The same ratings under the bare key
    are one client's, and decide nothing."""
    # A client's unit is its first two ratings, one of each arm here: one paired unit a user.
    paired = CONFIG.model_copy(update={"client_ratings": 2})
    settings = settings.model_copy(update={"aliases": {ALIAS: AliasConfig(canary=paired)}})
    secret = server_secret(settings)
    for vouched, expected in ((False, (1, 2)), (True, (2, None))):
        if vouched:
            lifecycle.rollback(ALIAS, "undecided: start it again", canary=2)
        start_canary(lifecycle)
        watcher = watcher_for(settings, lifecycle)
        records, ratings_ = [], []
        for i in range(100):
            user = f"user{i % 50}"
            source = client_source(secret, "app", user if vouched else None)
            for arm, version in (("active", 1), ("canary", 2)):
                rid = f"{vouched}-{arm}-{i}"
                records.append(traffic(arm, version, rid=rid, key="app", source=source))
                ratings_.append(feedback(rid, 1.0, "app", source))
        watcher.count(records)
        watcher.count(ratings_)
        watcher.check()
        assert route_of(lifecycle) == expected, vouched


def test_records_outside_the_canary_are_not_counted(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(
        [traffic("canary", 7, status=500, rid="x") for _ in range(20)]  # not the canary version
        + [traffic("active", 0, status=500) for _ in range(20)]  # not the active version
        + [feedback("x", 0.0), feedback("never-seen", 0.0)]
    )
    version, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert version == 2
    assert stats["canary"] == ArmStats() and stats["active"] == ArmStats()
    watcher.check()
    assert route_of(lifecycle) == (1, 2)


def test_nothing_is_counted_without_a_canary(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(20))
    assert lifecycle.writer.redis.exists(f"ratchet:canary:{ALIAS}") == 0


def test_the_watcher_counts_every_exchange_of_a_known_alias_canary_or_not(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    # v1 active, no canary: the rate counts all of an alias's traffic
    watcher = watcher_for(settings, lifecycle)
    stranger = traffic("active", 1)
    stranger.value = stranger.value.replace(f'"alias":"{ALIAS}"'.encode(), b'"alias":"nobody"')
    watcher.count([*healthy_traffic(15), stranger])
    client = lifecycle.writer.redis
    minute = minute_of(utc_now())
    assert minute is not None
    counted = sum(int(client.get(requests_key(ALIAS, m)) or 0) for m in (minute - 1, minute))
    assert counted == 30
    assert not client.keys(requests_key("nobody", 0).replace(":0", ":*"))  # unknown alias


def test_a_canary_set_by_hand_is_not_judged(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    lifecycle.start_canary(ALIAS, 2, 0.1, {})  # no reset: the counts belong to no canary
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(20) + [traffic("canary", 2, status=500) for _ in range(20)])
    watcher.check()
    assert route_of(lifecycle) == (1, 2)

    # Counts left from an earlier canary (v3) do not judge this one either.
    lifecycle.writer.redis.hset(f"ratchet:canary:{ALIAS}", "version", 3)
    watcher.check()
    assert route_of(lifecycle) == (1, 2)


def test_a_rating_read_with_its_answer_counts(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """An answer and its rating in one batch: the rating's claim comes after the answer's."""
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    batch = [traffic("canary", 2, rid="c1", key="alice"), feedback("c1", 0.75, key="alice")]
    watcher.count([*batch, feedback("c1", 0.0, key="alice")])  # rated twice: counted once
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["canary"].feedback, stats["canary"].feedback_sum) == (1, 0.75)


def test_a_rating_read_before_its_answer_counts_when_the_answer_comes(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Ratings and answers are on different topics, read in no fixed order: a rating read first
    (in an earlier batch, or ahead of its answer in the same one) waits for the answer."""
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count([feedback("c1", 0.25, key="alice")])
    watcher.count([feedback("c2", 0.5, key="bob"), traffic("canary", 2, rid="c2", key="bob")])
    watcher.count([])  # a poll that read nothing: still waiting
    watcher.count([traffic("canary", 2, rid="c1", key="alice")])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["canary"].feedback, stats["canary"].feedback_sum) == (2, 0.75)
    watcher.count([traffic("canary", 2, rid="c1", key="alice")])  # read again: counted once
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert stats["canary"].feedback == 2


def test_a_rating_whose_answer_never_comes_is_given_up_and_counted(
    settings: RatchetSettings, lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count([feedback("gone", 0.0, key="alice")])
    monkeypatch.setattr(canary_counter, "RATING_WAIT_S", 0.0)
    watcher.count([])
    monkeypatch.setattr(canary_counter, "RATING_WAIT_S", 60.0)
    watcher.count([traffic("canary", 2, rid="gone", key="alice")])
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert stats["canary"].feedback == 0
    unmatched = watcher.metrics.canary_ratings_unmatched.labels("expired")._value.get()
    assert unmatched == 1


def test_ratings_wait_for_their_answers_only_while_a_canary_runs_and_in_bounds(
    settings: RatchetSettings, lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher = watcher_for(settings, lifecycle)  # no canary: no answer will be claimed
    watcher.count([feedback("x1", 0.0, key="alice")])
    assert not watcher.counter.waiting
    start_canary(lifecycle)
    watcher.routes = lifecycle.writer.read_all().routes
    monkeypatch.setattr(canary_counter, "MAX_WAITING_RATINGS", 2)
    watcher.count([feedback(f"y{i}", 0.0, key="alice") for i in range(3)])
    assert [r.completion_id for r, _ in watcher.counter.waiting] == ["y0", "y1"]
    overflow = watcher.metrics.canary_ratings_unmatched.labels("overflow")._value.get()
    assert overflow == 1


def test_feedback_read_by_another_replica_is_credited_to_its_arm(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Traffic and feedback are keyed differently, so one replica's watcher may read an answer
    and another its rating: the arm is found through Redis, and the rating counts once."""
    start_canary(lifecycle)
    first, second = watcher_for(settings, lifecycle), watcher_for(settings, lifecycle)
    first.count([traffic("canary", 2, rid="c1", key="alice")])
    second.count([feedback("c1", 0.25, key="alice")])
    first.count([feedback("c1", 0.0, key="alice")])  # the same rating read again elsewhere
    _, _, stats = read_counts(lifecycle.writer.redis, ALIAS)
    assert (stats["canary"].feedback, stats["canary"].feedback_sum) == (1, 0.25)


def test_two_replicas_decide_a_canary_once(settings: RatchetSettings, lifecycle: Lifecycle) -> None:
    """Both watchers see the same failing canary; one rolls it back, the other, deciding on the
    route it read before, must not roll the active version back as well."""
    start_canary(lifecycle)
    first, second = watcher_for(settings, lifecycle), watcher_for(settings, lifecycle)
    first.count(
        healthy_traffic(10) + [traffic("canary", 2, status=502, code="upstream_error")] * 10
    )
    first.check()
    assert route_of(lifecycle) == (1, None)
    second.check()  # its routes still show v2 on canary
    assert route_of(lifecycle) == (1, None)
    kinds = [e["kind"] for e in lifecycle.writer.history(ALIAS)]
    assert kinds.count("rollback") == 1, kinds


def test_a_stale_promotion_does_not_bring_back_a_rolled_back_canary(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    age_canary(lifecycle, LATE)
    lifecycle.rollback(ALIAS, "manual")
    watcher.count(healthy_traffic(10))  # counted against the route it read: v2 on canary
    watcher.check()
    assert route_of(lifecycle) == (1, None)


def test_no_decision_while_another_learner_holds_the_alias(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)
    other = Lease(lifecycle.writer.redis, lease_key(ALIAS), 5)
    assert other.acquire()
    watcher.check()
    assert route_of(lifecycle) == (1, 2)
    other.release()
    watcher.check()
    assert route_of(lifecycle) == (2, None)


def test_check_exports_the_canarys_state(settings: RatchetSettings, lifecycle: Lifecycle) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    failed = traffic("canary", 2, status=503, code="upstream_unavailable")
    watcher.count([failed] + [traffic("canary", 2)] * 3)
    watcher.check()
    sample = watcher.metrics.registry.get_sample_value
    assert sample("ratchet_learner_canary_version", {"alias": ALIAS}) == 2
    assert sample("ratchet_learner_active_version", {"alias": ALIAS}) == 1
    assert sample("ratchet_learner_canary_requests", {"alias": ALIAS, "arm": "canary"}) == 4
    assert sample("ratchet_learner_canary_error_rate", {"alias": ALIAS, "arm": "canary"}) == 0.25


def rated_answers(client: Any, secret: bytes, version: int, count: int, score: float) -> None:
    """Joined ratings of ``count`` answers of ``version`` (as learner/ratings.py keeps them), on
    prompts of the reward model's held-out split, the only ones the guard compares on."""
    held_out = (h for h in (f"h{n}" for n in range(10_000)) if is_eval_rating(secret, h, 0.25))
    for i, digest in zip(range(count), held_out, strict=False):
        answer = RatedAnswer(
            [{"role": "user", "content": f"q{i}"}],
            f"v{version} answer",
            score,
            f"k{i}",
            digest,
            f"{version}-{i}",
            version,
        )
        client.rpush(ratings_key(ALIAS), json.dumps(asdict(answer)))


@pytest.mark.parametrize(("canary_predicted", "promoted"), [(0.9, False), (0.6, True)])
def test_a_canary_that_fooled_the_reward_model_is_rolled_back_and_learning_paused(
    redis_url: str, tmp_path: Path, canary_predicted: float, promoted: bool
) -> None:
    """Users rate both arms 0.5; the reward model predicts 0.5 for the active version's answers
    and ``canary_predicted`` for the canary's: overrating by 0.4 is beyond max_reward_gap
    (0.15), by 0.1 is not."""
    config = AliasConfig(canary=CONFIG, reward={"kind": "feedback"})
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, aliases={ALIAS: config})
    lifecycle = lifecycle_of(settings)
    start_canary(lifecycle)
    secret = server_secret(settings)
    rated_answers(lifecycle.writer.redis, secret, 1, 6, 0.5)
    rated_answers(lifecycle.writer.redis, secret, 2, 6, 0.5)

    def predict(alias: str, answers: list[RatedAnswer]) -> list[float]:
        assert alias == ALIAS
        return [canary_predicted if a.version == 2 else 0.5 for a in answers]

    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event(), None, predict)
    watcher.routes = lifecycle.writer.read_all().routes
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)
    watcher.check()
    route = lifecycle.writer.read(ALIAS)
    assert route is not None
    if promoted:
        assert (route.active, route.canary, route.paused) == (2, None, False)
        return
    assert (route.active, route.canary, route.paused) == (1, None, True)
    paused, rolled_back = lifecycle.writer.history(ALIAS)[:2]
    assert rolled_back["kind"] == "rollback" and paused["kind"] == "pause"
    assert paused["detail"]["reason"].startswith("reward_hacking: the reward model overrates")
    assert "+0.400" in paused["detail"]["reason"] and "+0.000" in paused["detail"]["reason"]


def test_the_reward_gap_ignores_the_prompts_the_reward_model_trained_on(
    redis_url: str, tmp_path: Path
) -> None:
    """On its training prompts the model fits the active version's ratings by construction: a
    gap measured there would blame every new version. Only held-out prompts count."""
    config = AliasConfig(canary=CONFIG, reward={"kind": "feedback"})
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, aliases={ALIAS: config})
    lifecycle = lifecycle_of(settings)
    start_canary(lifecycle)
    secret = server_secret(settings)
    trained = (h for h in (f"t{n}" for n in range(10_000)) if not is_eval_rating(secret, h, 0.25))
    for i, digest in zip(range(12), trained, strict=False):
        for version in (1, 2):
            answer = RatedAnswer([], "a", 0.5, f"k{i}", digest, f"{version}-{i}", version)
            lifecycle.writer.redis.rpush(ratings_key(ALIAS), json.dumps(asdict(answer)))
    route = lifecycle.writer.read(ALIAS)
    assert route is not None

    def predict(alias: str, answers: list[RatedAnswer]) -> list[float]:
        return [0.9 if a.version == 2 else 0.5 for a in answers]

    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event(), None, predict)
    guard = watcher.reward_gap(ALIAS, route, config)
    assert guard is not None and guard.outcome == "unchecked" and guard.blocks(False) is None


def test_one_key_cannot_open_the_reward_gap(redis_url: str, tmp_path: Path) -> None:
    """The guard's verdict rolls back and pauses learning: mallory, rating the canary's answers
    0 and the active version's 1 on held-out prompts, holds one answer of each arm among six
    users' (each client at most half max_reward_gap of an arm), so the gap stays shut."""
    config = AliasConfig(canary=CONFIG, reward={"kind": "feedback"})
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, aliases={ALIAS: config})
    lifecycle = lifecycle_of(settings)
    start_canary(lifecycle)
    secret = server_secret(settings)
    held_out = (h for h in (f"h{n}" for n in range(10_000)) if is_eval_rating(secret, h, 0.25))
    raters = [("mallory", {1: 1.0, 2: 0.0})] * 20 + [(f"u{i}", {1: 0.5, 2: 0.5}) for i in range(6)]
    for i, ((key, scores), digest) in enumerate(zip(raters, held_out, strict=False)):
        for version in (1, 2):
            answer = RatedAnswer([], "a", scores[version], key, digest, f"{version}-{i}", version)
            lifecycle.writer.redis.rpush(ratings_key(ALIAS), json.dumps(asdict(answer)))
    route = lifecycle.writer.read(ALIAS)
    assert route is not None
    seen: list[list[str]] = []

    def predict(alias: str, answers: list[RatedAnswer]) -> list[float]:
        seen.append([a.owner for a in answers])
        return [0.5] * len(answers)

    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event(), None, predict)
    guard = watcher.reward_gap(ALIAS, route, config)
    assert guard is not None and guard.outcome == "checked"
    assert seen[0].count("mallory") == 2  # one answer of each arm


@pytest.mark.parametrize("required", [False, True])
def test_a_promotion_the_guard_could_not_check_says_so_or_is_blocked(
    redis_url: str, tmp_path: Path, required: bool
) -> None:
    """Two rated answers an arm are too few for the guard (canary.min_feedback): the promotion
    goes through and its event says the guard could not check, unless the alias sets
    feedback.require_reward_check, which rolls the canary back instead."""
    config = AliasConfig(
        canary=CONFIG,
        reward={"kind": "feedback"},
        feedback={"require_reward_check": required},
    )
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, aliases={ALIAS: config})
    lifecycle = lifecycle_of(settings)
    start_canary(lifecycle)
    secret = server_secret(settings)
    rated_answers(lifecycle.writer.redis, secret, 1, 2, 0.5)
    rated_answers(lifecycle.writer.redis, secret, 2, 2, 0.5)

    def predict(alias: str, answers: list[RatedAnswer]) -> list[float]:
        return [0.5] * len(answers)

    watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event(), None, predict)
    watcher.routes = lifecycle.writer.read_all().routes
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)
    watcher.check()
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary is None
    event = lifecycle.writer.history(ALIAS)[0]
    if required:
        assert route.active == 1 and event["kind"] == "rollback"
        assert event["detail"]["reason"].startswith("reward_unchecked: could not check")
    else:
        assert route.active == 2
        assert "; reward guard could not check: too few raters" in event["detail"]["reason"]

"""The learner service around its rounds, against a real Redis and a real adapter store: what
becomes of each scored group (intake), version numbers, held-out pool, when a round is due,
offset commits, and the guard that pauses learning. No model is loaded: the learner loads it
lazily on its first round, and rounds themselves are covered by the integration tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from kafka.structs import OffsetAndMetadata, TopicPartition

from learner.guard import baseline_length_key
from learner.heldout import HeldoutPool
from learner.leases import lease_key
from learner.round import trained_key
from learner.service import LearnerService
from ratchet.bill import Bill
from ratchet.carry import Carry, write_carry
from ratchet.lease import Lease
from ratchet.progress import LearnerProgress, progress_key, read_progress
from ratchet.records import GROUPS_TOPIC, DeadLetter, HeldoutPrompt, Sample, ScoredGroup
from ratchet.registry import alias_key
from ratchet.settings import (
    AliasConfig,
    GateConfig,
    LearnerSettings,
    LearningConfig,
    RatchetSettings,
    ServedCheckSettings,
)
from ratchet.versions import next_version_key

ALIAS = "support"
TP0 = TopicPartition(GROUPS_TOPIC, 0)
TP1 = TopicPartition(GROUPS_TOPIC, 1)


def group(
    gid: str,
    version: int = 0,
    rewards: tuple[float, ...] = (0.0, 1.0),
    texts: tuple[str, ...] | None = None,
    length: int = 4,
    alias: str = ALIAS,
    key: str | None = None,
) -> ScoredGroup:
    texts = texts or tuple(f"answer {i}" for i in range(len(rewards)))
    samples = [
        Sample(
            message={"role": "assistant", "content": text},
            text=text,
            token_ids=list(range(length)),
            logprobs=[-0.5] * length,
        )
        for text in texts
    ]
    return ScoredGroup(
        group_id=gid,
        alias=alias,
        version=version,
        response_model=f"{alias}@v{version}",
        prompt_messages=[{"role": "user", "content": f"question {gid}"}],
        prompt_token_ids=[1, 2, 3],
        samples=samples,
        rewards=list(rewards),
        traffic_request_id=f"req-{gid}",
        api_key_hash=key,
    )


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    return RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        kafka_bootstrap_servers="127.0.0.1:1",  # never reached: no Kafka in these tests
        aliases={
            ALIAS: AliasConfig(gate=GateConfig(min_pairs=2, max_pairs=3)),
            "frozen": AliasConfig(learning=LearningConfig(enabled=False)),
        },
        learner=LearnerSettings(
            max_staleness=1,
            max_waiting_groups=3,
            batch_groups=3,
            min_groups=2,
            interval_s=60,
            heldout_pool=3,
            guard_rounds=3,
            collapse_share=0.8,
            max_length_growth=3.0,
            # No vLLM here to ask (the gate is scripted): tests/integration/test_served_check.py.
            served_check=ServedCheckSettings(enabled=False),
        ),
    )


@pytest.fixture
def service(settings: RatchetSettings) -> LearnerService:
    service = LearnerService(settings, base_model_path=Path("unused"))
    service.lifecycle.sink = None  # Redis history only
    service.refresh_routes()
    return service


def add_versions(service: LearnerService, *versions: tuple[int, int]) -> None:
    """(version, parent) adapter folders with just enough in them to count as written."""

    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

    for version, parent in versions:
        service.store.write(ALIAS, version, write_adapter, "/base", {"parent_version": parent})


def waiting_ids(service: LearnerService) -> list[str]:
    return [w.group.group_id for w in service.waiting[ALIAS]]


def metric(service: LearnerService, name: str, **labels: str) -> float | None:
    return service.metrics.registry.get_sample_value(name, labels)


# --- intake -----------------------------------------------------------------------------------


def test_a_usable_group_waits_for_the_next_round(service: LearnerService) -> None:
    assert service.take(group("g1"), TP0, 5) == "waiting"
    [waiting] = service.waiting[ALIAS]
    assert (waiting.group.group_id, waiting.partition, waiting.offset) == ("g1", TP0, 5)


def test_groups_of_aliases_that_do_not_learn_are_dropped(service: LearnerService) -> None:
    assert service.take(group("g1", alias="elsewhere"), TP0, 0) == "unknown_alias"
    assert service.take(group("g2", alias="frozen"), TP0, 1) == "learning_disabled"
    assert not any(service.waiting.values())


def test_a_paused_alias_takes_no_groups(service: LearnerService) -> None:
    service.lifecycle.pause(ALIAS, "manual")
    assert service.take(group("g1"), TP0, 0) == "waiting"  # the learner has not seen it yet
    service.refresh_routes()
    assert service.take(group("g2"), TP0, 1) == "paused"
    assert waiting_ids(service) == ["g1"]


def test_a_group_already_waiting_is_a_duplicate(service: LearnerService) -> None:
    assert service.take(group("g1"), TP0, 0) == "waiting"
    assert service.take(group("g1"), TP1, 9) == "duplicate"  # a judge retry, another partition
    assert waiting_ids(service) == ["g1"]


def test_a_group_already_trained_is_a_duplicate(service: LearnerService) -> None:
    service.redis.zadd(trained_key(ALIAS), {"g1": time.time()})
    assert service.take(group("g1"), TP0, 0) == "duplicate"
    assert service.take(group("g2"), TP0, 1) == "waiting"


def test_a_group_with_equal_rewards_carries_no_signal(service: LearnerService) -> None:
    assert service.take(group("g1", rewards=(0.5, 0.5, 0.5)), TP0, 0) == "zero_spread"
    assert service.take(group("g2", rewards=()), TP0, 1) == "zero_spread"
    assert service.take(group("g3", rewards=(0.5, 0.5, 0.6)), TP0, 2) == "waiting"


def test_staleness_is_counted_along_the_live_versions_lineage(service: LearnerService) -> None:
    add_versions(service, (1, 0), (2, 1), (3, 2), (4, 0))
    service.lifecycle.promote(ALIAS, 3)
    service.refresh_routes()
    assert [service.lineage.promotions_between(ALIAS, v, 3) for v in (3, 2, 1, 0)] == [0, 1, 2, 3]
    assert service.lineage.promotions_between(ALIAS, 4, 3) is None  # a sibling, not an ancestor
    assert service.lineage.promotions_between(ALIAS, 9, 3) is None  # not in the store at all

    outcomes = [service.take(group(f"g{v}", version=v), TP0, v) for v in (3, 2, 1, 0, 4)]
    assert outcomes == ["waiting", "waiting", "stale", "stale", "stale"]


def test_groups_of_a_rolled_back_version_are_stale(service: LearnerService) -> None:
    add_versions(service, (1, 0), (2, 1))
    service.lifecycle.promote(ALIAS, 1)
    service.lifecycle.promote(ALIAS, 2)
    service.lifecycle.rollback(ALIAS, "manual")
    service.refresh_routes()
    assert service.take(group("g2", version=2), TP0, 0) == "stale"
    assert service.take(group("g1", version=1), TP0, 1) == "waiting"


def carry_on(service: LearnerService, live: int, *chain: int) -> None:
    """Live ``live`` (promoted from v0), and candidates ``chain`` each trained on from the one
    before it (the first from the live version), the last one carried by the next round."""
    add_versions(service, (live, 0))
    service.lifecycle.promote(ALIAS, live)
    source = live
    for version in chain:
        service.store.write(
            ALIAS,
            version,
            lambda folder: (folder / "adapter_config.json").write_text("{}"),
            "/base",
            {"parent_version": live, "trained_from": source},
        )
        source = version
    pipe = service.redis.pipeline()
    write_carry(pipe, ALIAS, Carry(chain[-1], live, len(chain), 0.6))
    pipe.execute()
    service.refresh_routes()


def test_a_carried_candidates_own_groups_are_fresh_and_count_its_rounds(
    service: LearnerService,
) -> None:
    """The next round trains on from carried v2 (one round beyond live v1): v2's groups are on
    its policy, v1's one round behind, v0's two (stale at max_staleness 1); a sibling is not on
    the path at all."""
    carry_on(service, 1, 2)
    add_versions(service, (3, 1))
    start = service.rounds.start_of_round(ALIAS, 1)
    assert [service.lineage.policy_lag(ALIAS, v, 1, start) for v in (2, 1, 0, 3)] == [0, 1, 2, None]
    outcomes = [service.take(group(f"g{v}", version=v), TP0, v) for v in (2, 1, 0, 3)]
    assert outcomes == ["waiting", "waiting", "stale", "stale"]


def test_two_carried_rounds_follow_the_chain_of_candidates(service: LearnerService) -> None:
    carry_on(service, 1, 2, 4)
    service.settings.learner.max_candidate_rounds = 2
    assert not service.rounds.start_of_round(ALIAS, 1).carried  # v4 holds max_candidate_rounds
    service.settings.learner.max_candidate_rounds = 3
    start = service.rounds.start_of_round(ALIAS, 1)
    assert [service.lineage.policy_lag(ALIAS, v, 1, start) for v in (4, 2, 1, 0)] == [0, 1, 2, 3]


def test_a_round_trains_the_groups_of_where_it_starts_first(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    carry_on(service, 1, 2)
    for i, version in enumerate((1, 1, 2)):  # the live version's answers came first
        assert service.take(group(f"g{i}", version=version), TP0, i) == "waiting"
    ran: list[tuple[list[str], Any]] = []
    monkeypatch.setattr(
        service.rounds,
        "run",
        lambda alias, route, groups, heldout, waiting, start: ran.append(
            ([g.group_id for g in groups], start)
        ),
    )
    service.run_round(ALIAS)
    [(trained, start)] = ran
    assert trained == ["g2", "g0", "g1"]  # v2's own, then v1's, oldest first
    assert start.version == 2 and start.carried


def test_groups_of_a_candidate_no_longer_carried_are_dropped_before_a_round(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    carry_on(service, 1, 2)
    for i, version in enumerate((2, 2, 1)):
        assert service.take(group(f"g{i}", version=version), TP0, i) == "waiting"
    pipe = service.redis.pipeline()
    write_carry(pipe, ALIAS, None)  # v2's next round leaned no better: nothing is carried
    pipe.execute()
    rounds: list[str] = []
    monkeypatch.setattr(service, "run_round", lambda alias: rounds.append(alias))
    assert service.leased_round(ALIAS) == []
    assert rounds == [] and waiting_ids(service) == ["g2"]
    assert metric(service, "ratchet_learner_groups_total", alias=ALIAS, outcome="stale") == 2


def test_the_oldest_waiting_group_overflows(service: LearnerService) -> None:
    for i in range(5):
        assert service.take(group(f"g{i}"), TP0, i) == "waiting"
    assert waiting_ids(service) == ["g2", "g3", "g4"]  # max_waiting_groups = 3
    assert metric(service, "ratchet_learner_groups_total", alias=ALIAS, outcome="overflow") == 2


def test_a_flood_overflows_its_own_groups_not_the_others(service: LearnerService) -> None:
    assert service.take(group("honest", key="alice"), TP0, 0) == "waiting"
    for i in range(5):
        assert service.take(group(f"flood{i}", key="mallory"), TP0, 1 + i) == "waiting"
    # max_waiting_groups = 3: the key with the most waiting loses its oldest each time.
    assert waiting_ids(service) == ["honest", "flood3", "flood4"]
    assert metric(service, "ratchet_learner_groups_total", alias=ALIAS, outcome="overflow") == 3


# --- one key's share of a round ---------------------------------------------------------------


@pytest.fixture
def shared(redis_url: str, tmp_path: Path) -> LearnerService:
    """A learner with rounds of 8, room for 100 waiting groups, and gate prompts from 4 keys."""
    settings = RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        kafka_bootstrap_servers="127.0.0.1:1",
        aliases={
            ALIAS: AliasConfig(
                gate=GateConfig(min_pairs=4, max_pairs=8),
                learning=LearningConfig(max_key_share=0.25),
            )
        },
        learner=LearnerSettings(
            batch_groups=8,
            min_groups=2,
            max_waiting_groups=100,
            served_check=ServedCheckSettings(enabled=False),
        ),
    )
    service = LearnerService(settings, base_model_path=Path("unused"))
    service.lifecycle.sink = None
    service.refresh_routes()
    for i in range(8):
        service.add_heldout(heldout(f"h{i}", key=f"key-{i % 4}"))
    return service


def test_a_flooding_key_fills_at_most_its_share_of_a_round(
    shared: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = shared
    trained: list[list[str]] = []

    def run(
        alias: str,
        route: Any,
        groups: list[ScoredGroup],
        heldout: Any,
        waiting: int = 0,
        start: Any = None,
    ) -> Any:
        trained.append([g.group_id for g in groups])

    monkeypatch.setattr(service.rounds, "run", run)
    for i in range(40):  # the flood arrives first
        service.take(group(f"flood{i}", key="mallory"), TP0, i)
    for name in ("alice", "bob", "carol"):
        for i in range(2):
            service.take(group(f"{name}{i}", key=name), TP0, 100)
    assert service.ready(ALIAS)  # 8 can be taken: 2 from each of the four keys
    service.run_round(ALIAS)
    [round_groups] = trained
    assert sorted(round_groups) == sorted(
        ["flood0", "flood1", "alice0", "alice1", "bob0", "bob1", "carol0", "carol1"]
    )
    # The flood's surplus waits for later rounds, counted as held back.
    assert waiting_ids(service) == [f"flood{i}" for i in range(2, 40)]
    assert metric(service, "ratchet_learner_groups_deferred_total", alias=ALIAS) == 38


def test_a_flood_alone_beside_one_group_is_not_a_full_round(shared: LearnerService) -> None:
    service = shared
    for i in range(40):
        service.take(group(f"flood{i}", key="mallory"), TP0, i)
    service.take(group("alice0", key="alice"), TP0, 50)
    assert not service.ready(ALIAS)  # 2 usable (1 + 1) of batch_groups 8
    service.waiting[ALIAS][0].arrived -= 601  # past interval_s with min_groups 2
    assert service.ready(ALIAS)


def test_no_round_while_the_gate_would_judge_mostly_one_keys_prompts(
    shared: LearnerService,
) -> None:
    service = shared
    service.heldout[ALIAS] = HeldoutPool(capacity=1000)  # room for the whole flood
    for i in range(100):
        service.add_heldout(heldout(f"flood{i}", key="mallory"))
    service.add_heldout(heldout("h-alice", key="alice"))
    for i in range(8):
        service.take(group(f"g{i}", key=f"key-{i}"), TP0, i)
    assert not service.ready(ALIAS)  # 2 fair pairs (1 + 1) of gate.min_pairs 4
    service.add_heldout(heldout("h-bob", key="bob"))
    service.add_heldout(heldout("h-carol", key="carol"))
    assert service.ready(ALIAS)  # 4 keys: 1 pair each


# --- versions and the held-out pool -----------------------------------------------------------


def test_next_version_is_above_every_version_in_the_store(
    service: LearnerService, settings: RatchetSettings
) -> None:
    add_versions(service, (1, 0), (2, 1), (3, 2))
    assert service.rounds.next_version(ALIAS) == 4  # the counter was behind the store
    assert service.rounds.next_version(ALIAS) == 5
    other = LearnerService(settings, base_model_path=Path("unused"))  # a second learner
    assert other.rounds.next_version(ALIAS) == 6
    assert service.rounds.next_version("frozen") == 1  # per alias


def test_a_learner_behind_the_store_never_sets_the_counter_back(
    service: LearnerService, settings: RatchetSettings
) -> None:
    """A learner whose store listing is old (say, 3) while others have taken up to 7 must not
    reset the counter to 3: versions 4 to 7 would be handed out twice."""
    add_versions(service, (1, 0), (2, 1), (3, 2))
    service.redis.set(next_version_key(ALIAS), 7)  # taken by other learners meanwhile
    assert service.rounds.next_version(ALIAS) == 8
    service.redis.set(next_version_key(ALIAS), 1)  # Redis lost the counter
    assert service.rounds.next_version(ALIAS) == 4  # lifted above the store


def heldout(h: str, key: str | None = None) -> HeldoutPrompt:
    messages = [{"role": "user", "content": h}]
    return HeldoutPrompt(
        prompt_hash=h, alias=ALIAS, prompt_messages=messages, traffic_request_id=h, api_key_hash=key
    )


def test_the_held_out_pool_keeps_the_newest_distinct_prompts(service: LearnerService) -> None:
    for h in ("a", "b", "c", "a", "d"):
        service.add_heldout(heldout(h))
    # "a" came again, so it is newer than "b"; the pool holds 3, so "b" went first.
    assert list(service.heldout[ALIAS]) == ["c", "a", "d"]
    assert metric(service, "ratchet_learner_heldout_prompts", alias=ALIAS) == 3


# --- when a round is due ----------------------------------------------------------------------


@pytest.fixture
def gateable(service: LearnerService) -> LearnerService:
    """The service with gate.min_pairs held-out prompts in its pool."""
    for h in ("h1", "h2"):
        service.add_heldout(heldout(h))
    return service


def test_no_round_until_the_gate_has_enough_held_out_prompts(service: LearnerService) -> None:
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)
    service.add_heldout(heldout("h1"))
    assert not service.ready(ALIAS)  # a full batch, but 1 held-out prompt of min_pairs 2
    service.add_heldout(heldout("h2"))
    assert service.ready(ALIAS)


def test_a_round_is_due_with_a_full_batch(gateable: LearnerService) -> None:
    service = gateable
    assert not service.ready(ALIAS)  # nothing waiting
    service.take(group("g1"), TP0, 0)
    service.take(group("g2"), TP0, 1)
    assert not service.ready(ALIAS)  # two of three, and the oldest is new
    service.take(group("g3"), TP0, 2)
    assert service.ready(ALIAS)


def test_a_round_is_due_when_the_oldest_group_has_waited_long_enough(
    gateable: LearnerService,
) -> None:
    service = gateable
    service.take(group("g1"), TP0, 0)
    service.waiting[ALIAS][0].arrived -= 61
    assert not service.ready(ALIAS)  # one group, fewer than min_groups
    service.take(group("g2"), TP0, 1)
    assert service.ready(ALIAS)


def test_groups_that_waited_through_a_round_wait_interval_s_from_its_end(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)

    def round_meanwhile(alias: str) -> None:
        service.waiting[alias] = []  # the round's batch, spent
        for i in (3, 4):  # in flight when it began, read while it ran
            service.take(group(f"g{i}"), TP0, i)
            service.waiting[alias][-1].arrived -= 61  # past interval_s by its end

    monkeypatch.setattr(service, "run_round", round_meanwhile)
    assert service.leased_round(ALIAS) == []
    assert waiting_ids(service) == ["g3", "g4"]
    assert not service.ready(ALIAS)  # min_groups, old enough, but the round has just ended
    service.work.worked_at[ALIAS] -= 61
    assert service.ready(ALIAS)
    service.work.worked_at[ALIAS] += 61
    service.take(group("g5"), TP0, 5)
    assert service.ready(ALIAS)  # a full batch never waits


def test_no_round_while_another_learner_holds_the_alias(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)
    rounds: list[str] = []
    monkeypatch.setattr(service, "run_round", lambda alias: rounds.append(alias))
    other = Lease(service.redis, lease_key(ALIAS), 5)
    assert other.acquire()
    assert service.leased_round(ALIAS) == []
    assert rounds == []
    assert metric(service, "ratchet_learner_lease_busy_total", alias=ALIAS, what="round") == 1
    other.release()
    service.leased_round(ALIAS)
    assert rounds == [ALIAS]
    assert not service.redis.exists(lease_key(ALIAS))  # released after the round
    assert metric(service, "ratchet_learner_lease_held", alias=ALIAS) == 0


def test_groups_another_learner_trained_are_dropped_before_a_round(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)
    # Another learner read them too (before a rebalance) and stored its round's outcome.
    service.redis.zadd(trained_key(ALIAS), {"g0": time.time(), "g1": time.time()})
    rounds: list[str] = []
    monkeypatch.setattr(service, "run_round", lambda alias: rounds.append(alias))
    assert service.leased_round(ALIAS) == []
    assert rounds == []  # one group left: no longer a full batch
    assert waiting_ids(service) == ["g2"]
    assert metric(service, "ratchet_learner_groups_total", alias=ALIAS, outcome="duplicate") == 2


def test_a_round_whose_lease_is_lost_writes_nothing_and_does_not_pause(
    gateable: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = gateable
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)

    def stalled_round(alias: str) -> Any:
        service.redis.set(lease_key(alias), "another-learner")  # ours expired meanwhile
        service.lifecycle.record(service.lifecycle.event(alias, "candidate", version=7))

    monkeypatch.setattr(service, "run_round", stalled_round)
    assert service.leased_round(ALIAS) == []
    assert service.writer.history(ALIAS) == []
    assert not route_paused(service)
    assert waiting_ids(service) == ["g0", "g1", "g2"]
    assert metric(service, "ratchet_learner_lease_lost_total", alias=ALIAS, what="round") == 1
    assert service.redis.get(lease_key(ALIAS)) == b"another-learner"  # not released: not ours


def test_no_round_while_paused_or_on_canary(gateable: LearnerService) -> None:
    service = gateable
    add_versions(service, (1, 0))
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)
    service.lifecycle.start_canary(ALIAS, 1, 0.1, {})
    service.refresh_routes()
    assert not service.ready(ALIAS)
    service.lifecycle.promote(ALIAS, 1)
    service.refresh_routes()
    assert service.ready(ALIAS)
    service.lifecycle.pause(ALIAS, "manual")
    service.refresh_routes()
    assert not service.ready(ALIAS)


def test_the_canary_watcher_acts_under_the_lease_its_replicas_round_holds(
    service: LearnerService,
) -> None:
    """A round that trains on from a canary holds the alias's lease for minutes: the canary's
    decision, in the same replica, acts under it meanwhile; another replica still cannot."""
    canary_leases = service.leases.sharing("canary")
    with service.leases.hold(ALIAS) as round_lease:
        assert round_lease is not None
        with canary_leases.hold(ALIAS) as canary_lease:
            assert canary_lease is round_lease
        assert round_lease.held()  # the canary's release left the round's hold alone
    assert service.redis.get(lease_key(ALIAS)) is None  # released with its last holder
    other = Lease(service.redis, lease_key(ALIAS), 5)
    assert other.acquire()
    with canary_leases.hold(ALIAS) as lease:
        assert lease is None
    assert metric(service, "ratchet_learner_lease_busy_total", alias=ALIAS, what="canary") == 1


# --- offsets ----------------------------------------------------------------------------------


class FakeConsumer:
    def __init__(self, assigned: tuple[TopicPartition, ...] = (TP0, TP1)) -> None:
        self.commits: list[dict[TopicPartition, OffsetAndMetadata]] = []
        self.assigned = set(assigned)

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.commits.append(offsets)

    def last(self) -> dict[TopicPartition, int]:
        return {tp: meta.offset for tp, meta in self.commits[-1].items()}


def test_offsets_stop_at_the_oldest_group_still_waiting(service: LearnerService) -> None:
    consumer = FakeConsumer()
    service.consumers.groups = consumer  # type: ignore[assignment]
    service.consumers.read_up_to = {TP0: 10, TP1: 7}
    service.take(group("g6"), TP0, 6)
    service.take(group("g4"), TP0, 4)
    service.take(group("x8", alias="frozen"), TP0, 8)  # dropped: nothing to hold back for
    service.commit_offsets()
    assert consumer.last() == {TP0: 4, TP1: 7}

    service.waiting[ALIAS].clear()  # the round that used them is stored
    service.commit_offsets()
    assert consumer.last() == {TP0: 10, TP1: 7}


def test_offsets_stop_at_the_groups_of_a_held_candidate(service: LearnerService) -> None:
    """A candidate trained through a canary has spent its groups but is not settled yet: a
    learner killed now must read them again."""
    from learner.held import Held, HeldCandidate
    from learner.intake import Waiting

    consumer = FakeConsumer()
    service.consumers.groups = consumer  # type: ignore[assignment]
    service.consumers.read_up_to = {TP0: 10, TP1: 7}
    spent = Waiting(group("g3"), TP0, 3)
    candidate = HeldCandidate(2, 1, ["g3"], stats=None, bill=Bill())  # type: ignore[arg-type]
    service.held.hold(ALIAS, Held(candidate, [spent]))
    service.commit_offsets()
    assert consumer.last() == {TP0: 3, TP1: 7}
    service.consumers.revoked({TP0})
    service.forget_revoked()  # the new owner trains them again: the held candidate is void
    assert ALIAS not in service.held


def test_only_assigned_partitions_are_committed(service: LearnerService) -> None:
    consumer = FakeConsumer(assigned=(TP1,))
    service.consumers.groups = consumer  # type: ignore[assignment]
    service.consumers.read_up_to = {TP0: 10, TP1: 7}
    service.commit_offsets()
    assert consumer.last() == {TP1: 7}  # TP0 is another learner's now: its offsets are its own


def test_revoked_partitions_forget_their_groups(service: LearnerService) -> None:
    consumer = FakeConsumer()
    service.consumers.groups = consumer  # type: ignore[assignment]
    service.consumers.read_up_to = {TP0: 10, TP1: 7}
    service.take(group("g0"), TP0, 4)
    service.take(group("g1"), TP1, 5)
    service.consumers.revoked({TP0})
    assert consumer.commits == []  # from kafka-python's IO thread: nothing that blocks
    assert waiting_ids(service) == ["g0", "g1"]  # a round may be using them
    service.forget_revoked()  # the loop's next poll
    assert waiting_ids(service) == ["g1"]
    assert service.consumers.read_up_to == {TP1: 7}


def test_no_commit_before_anything_was_read(service: LearnerService) -> None:
    consumer = FakeConsumer()
    service.consumers.groups = consumer  # type: ignore[assignment]
    service.commit_offsets()
    assert consumer.commits == []


# --- the guard --------------------------------------------------------------------------------


def record_round(service: LearnerService, version: int, reward: float, passed: bool) -> None:
    life = service.lifecycle
    life.record(life.event(ALIAS, "candidate", version=version, detail={"mean_reward": reward}))
    life.record(life.event(ALIAS, "gate", version=version, detail={"passed": passed}))


def route_paused(service: LearnerService) -> bool:
    route = service.writer.read(ALIAS)
    assert route is not None
    return route.paused


def test_reward_up_while_every_gate_rejects_pauses_learning(service: LearnerService) -> None:
    for version, reward in ((1, 0.2), (2, 0.4), (3, 0.6)):
        record_round(service, version, reward, passed=False)
    service.guard.after_round(ALIAS, [group("g", length=4)])
    assert route_paused(service)
    pause = service.writer.history(ALIAS)[0]
    assert pause["kind"] == "pause" and pause["detail"]["reason"].startswith("reward_hacking:")
    assert service.guard.paused_reason[ALIAS] == "reward_hacking"
    assert metric(service, "ratchet_learner_paused", alias=ALIAS, reason="reward_hacking") == 1


def test_a_passed_gate_keeps_learning_on(service: LearnerService) -> None:
    for version, reward, passed in ((1, 0.2, False), (2, 0.4, True), (3, 0.6, False)):
        record_round(service, version, reward, passed)
    service.guard.after_round(ALIAS, [group("g", length=4)])
    assert not route_paused(service)


def test_resuming_starts_the_guards_window_afresh(service: LearnerService) -> None:
    for version, reward in ((1, 0.2), (2, 0.4)):
        record_round(service, version, reward, passed=False)
    service.lifecycle.pause(ALIAS, "manual")
    service.lifecycle.resume(ALIAS)
    record_round(service, 3, 0.6, passed=False)
    service.guard.after_round(ALIAS, [group("g", length=4)])
    assert not route_paused(service)


def test_groups_of_one_repeated_answer_pause_learning(service: LearnerService) -> None:
    for i in range(4):
        texts = ("Same.", "same. ", "SAME.")
        outcome = service.take(group(f"c{i}", rewards=(0.0, 0.5, 1.0), texts=texts), TP0, i)
        assert outcome == "waiting"
    service.take(group("d"), TP0, 9)
    service.guard.after_round(ALIAS, [])  # 4 of 5 recent groups collapsed, share 0.8
    assert route_paused(service)
    assert service.guard.paused_reason[ALIAS] == "collapse"
    assert service.guard.recent[ALIAS] == []  # the next round counts afresh


def test_answers_growing_past_the_first_rounds_length_pause_learning(
    service: LearnerService,
) -> None:
    service.guard.after_round(ALIAS, [group("g1", length=10)])  # the first round sets the baseline
    assert float(service.redis.get(baseline_length_key(ALIAS)) or 0) == 10.0
    service.guard.after_round(ALIAS, [group("g2", length=30)])  # 3x: still within max_length_growth
    assert not route_paused(service)
    service.guard.after_round(ALIAS, [group("g3", length=31)])
    assert route_paused(service)
    assert service.guard.paused_reason[ALIAS] == "runaway_length"


def test_a_round_that_fails_pauses_the_alias_and_keeps_its_groups(
    service: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.take(group("g1"), TP0, 0)

    def broken_round(alias: str) -> Any:
        raise ValueError("token ids do not match the prompt")

    monkeypatch.setattr(service, "run_round", broken_round)
    monkeypatch.setattr(service, "ready", lambda alias: True)
    assert service.leased_round(ALIAS) == []
    assert route_paused(service)
    reason = service.writer.history(ALIAS)[0]["detail"]["reason"]
    assert reason == "round_failed: ValueError: token ids do not match the prompt"
    assert metric(service, "ratchet_learner_rounds_total", alias=ALIAS, result="failed") == 1
    assert waiting_ids(service) == ["g1"]  # uncommitted, for the operator to look at


def test_an_outage_during_a_round_is_raised_not_paused(
    service: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def outage(alias: str) -> Any:
        raise redis.ConnectionError("redis went away")

    monkeypatch.setattr(service, "run_round", outage)
    monkeypatch.setattr(service, "ready", lambda alias: True)
    with pytest.raises(redis.ConnectionError):
        service.leased_round(ALIAS)
    assert not route_paused(service)
    assert ALIAS not in service.guard.paused_reason


def test_a_pause_by_an_operator_is_picked_up_with_its_reason(service: LearnerService) -> None:
    service.lifecycle.pause(ALIAS, "investigating: odd answers")
    service.refresh_routes()
    assert service.guard.paused_reason[ALIAS] == "investigating"
    assert metric(service, "ratchet_learner_paused", alias=ALIAS, reason="investigating") == 1
    service.lifecycle.resume(ALIAS)
    service.refresh_routes()
    assert ALIAS not in service.guard.paused_reason
    assert metric(service, "ratchet_learner_paused", alias=ALIAS, reason="investigating") is None


def test_no_round_while_the_aliases_hash_is_invalid(gateable: LearnerService) -> None:
    """A field written by hand into the alias's hash must neither crash the learner's refresh nor
    let a round decide on a route nobody can read; fixed, the alias learns again."""
    service = gateable
    for i in range(3):
        service.take(group(f"g{i}"), TP0, i)
    service.refresh_routes()
    assert service.ready(ALIAS)
    service.writer.redis.hset(alias_key(ALIAS), "canary_weight", "lots")
    service.refresh_routes()
    assert list(service.invalid_routes.now) == [ALIAS]
    assert not service.ready(ALIAS)
    assert metric(service, "ratchet_learner_failures_total", alias=ALIAS, cause="invalid_route")
    service.writer.redis.hset(alias_key(ALIAS), "canary_weight", "0.0")
    service.refresh_routes()
    assert not service.invalid_routes.now and service.ready(ALIAS)


# --- records the learner cannot use -----------------------------------------------------------


def message(value: bytes, offset: int = 5) -> SimpleNamespace:
    return SimpleNamespace(topic=GROUPS_TOPIC, partition=0, offset=offset, value=value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [(b"{not json", "malformed"), (b'{"schema": "scored_group/1", "alias": 1}', "invalid")],
)
def test_a_value_that_is_not_a_group_is_dead_lettered(
    service: LearnerService, value: bytes, reason: str
) -> None:
    service.intake(message(value), TP0)
    [letter] = service.lifecycle.unsent
    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.offset, letter.consumer) == (reason, 5, "ratchet-learner")
    assert metric(service, "ratchet_learner_failures_total", alias="-", cause=reason) == 1.0


def test_a_group_the_learner_fails_on_is_dead_lettered_and_the_next_is_taken(
    service: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(group: ScoredGroup) -> bool:
        raise TypeError("a bug that only this group finds")

    monkeypatch.setattr("learner.guard.is_collapsed", broken)
    service.intake(message(group("g0").to_json()), TP0)
    monkeypatch.undo()
    service.intake(message(group("g1").to_json(), offset=6), TP0)
    [letter] = service.lifecycle.unsent
    assert isinstance(letter, DeadLetter) and letter.reason == "handler_error"
    assert "TypeError: a bug" in letter.error
    assert waiting_ids(service) == ["g1"]


def test_an_outage_while_taking_a_group_is_not_the_groups_fault(
    service: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def away(*_: Any) -> None:
        raise redis.ConnectionError("redis is away")

    monkeypatch.setattr(service.redis, "zscore", away)
    with pytest.raises(redis.ConnectionError):
        service.intake(message(group("g0").to_json()), TP0)
    assert service.lifecycle.unsent == []


# --- progress ---------------------------------------------------------------------------------


class PollingConsumer(FakeConsumer):
    """Hands out the given batches, one per poll, then nothing."""

    def __init__(self, *batches: dict[TopicPartition, list[Any]]) -> None:
        super().__init__()
        self.batches = list(batches)

    def poll(self, timeout_ms: int = 0, max_records: int = 0) -> dict[TopicPartition, list[Any]]:
        return self.batches.pop(0) if self.batches else {}


def polling(service: LearnerService, *batches: dict[TopicPartition, list[Any]]) -> None:
    service.consumers.groups = PollingConsumer(*batches)  # type: ignore[assignment]
    service.consumers.heldout = PollingConsumer()  # type: ignore[assignment]


def progress_of(service: LearnerService, alias: str = ALIAS) -> LearnerProgress | None:
    return read_progress(service.redis, alias)


def test_the_loop_publishes_what_it_read_and_why_it_waits(service: LearnerService) -> None:
    # Three groups read: two wait, one is a duplicate; no held-out prompts yet.
    batch = [message(group(gid).to_json(), offset=i) for i, gid in enumerate(("g0", "g1", "g0"))]
    polling(service, {TP0: batch})
    service.step()
    progress = progress_of(service)
    assert progress is not None
    assert (progress.phase, progress.waiting, progress.read) == ("waiting_heldout", 2, 3)
    assert (progress.batch_groups, progress.heldout) == (3, 0)
    assert progress.describe() == "waiting_heldout: 2/3 groups, 0 held-out prompts"
    assert progress_of(service, "frozen") is None  # nothing read of it here: not ours to publish
    phase = metric(service, "ratchet_learner_round_phase", alias=ALIAS, phase="waiting_heldout")
    assert phase == 1


def test_groups_read_and_dropped_still_count_as_read(service: LearnerService) -> None:
    flat = group("g0", rewards=(0.5, 0.5))  # zero spread: dropped
    polling(service, {TP0: [message(flat.to_json(), offset=0)]})
    service.step()
    progress = progress_of(service)
    assert progress is not None and (progress.phase, progress.waiting, progress.read) == (
        "idle", 0, 1,
    )  # fmt: skip
    # Nothing read nor waiting any more: this replica stops publishing the alias.
    service.redis.delete(progress_key(ALIAS))
    service.step()
    assert progress_of(service) is None


def test_a_redis_error_while_publishing_does_not_fail_the_loop(
    service: LearnerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def away(*_: Any, **__: Any) -> None:
        raise redis.ConnectionError("redis is away")

    polling(service, {TP0: [message(group("g0").to_json(), offset=0)]})
    monkeypatch.setattr("learner.reporter.publish", away)
    service.step()
    assert metric(service, "ratchet_learner_progress_errors_total", alias=ALIAS) == 1
    assert waiting_ids(service) == ["g0"]
    monkeypatch.undo()
    service.rounds.progress.clock = lambda: time.monotonic() + 10  # past the throttle
    service.step()
    progress = progress_of(service)
    assert progress is not None and progress.read == 1  # the read was kept for the next write


# --- imported versions (`ratchet import`) -------------------------------------------------------


def scripted_gate(service: LearnerService, passed: bool | Exception) -> list[str]:
    """The gate's verdict fixed (vLLM is not here); returns the served names it was asked to
    compare, as (candidate, incumbent)."""
    from learner.gate_verdict import GateResult

    asked: list[str] = []

    async def evaluate(alias: str, config: Any, prompts: Any, cand: str, inc: str, **_: Any) -> Any:
        asked.extend([cand, inc])
        if isinstance(passed, Exception):
            raise passed
        return GateResult(passed, "scripted", 3, 0.9 if passed else 0.1, 0.6, 1.0, 0.5, 2)

    service.rounds.gate.evaluate = evaluate  # type: ignore[method-assign]
    return asked


def imported(service: LearnerService, version: int) -> None:
    from ratchet.versions import queue_import

    add_versions(service, (version, 0))
    queue_import(service.redis, ALIAS, version)


def kinds(service: LearnerService) -> list[str]:
    return [e["kind"] for e in reversed(service.writer.history(ALIAS, limit=20))]


def test_an_imported_version_waits_for_held_out_prompts_then_is_gated_and_canaried(
    service: LearnerService,
) -> None:
    from ratchet.versions import queued_imports

    asked = scripted_gate(service, passed=True)
    imported(service, 1)
    assert service.imports.waiting_aliases() == [ALIAS]
    service.imports.gate_next(ALIAS)
    assert not asked and queued_imports(service.redis, ALIAS) == [1]  # no held-out prompts yet
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    service.imports.gate_next(ALIAS)
    assert asked == [f"{ALIAS}@v1", service.routes[ALIAS].base_model]
    assert kinds(service) == ["gate", "canary"]  # as a learned candidate: canary.weight > 0
    canary = service.writer.history(ALIAS, limit=1)[0]
    assert canary["version"] == 1 and canary["detail"]["origin"] == "import"
    assert service.writer.read(ALIAS).canary == 1  # type: ignore[union-attr]
    assert queued_imports(service.redis, ALIAS) == [] and service.imports.waiting_aliases() == []
    stored = service.rounds.candidates.get(ALIAS, 1)
    assert stored is not None and (stored.origin, stored.stage) == ("import", "canary")


def test_an_imported_version_the_gate_rejects_leaves_the_queue_with_its_reason(
    service: LearnerService,
) -> None:
    from ratchet.versions import queued_imports

    scripted_gate(service, passed=False)
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    imported(service, 2)
    service.imports.gate_next(ALIAS)
    assert kinds(service) == ["gate", "reject"]
    assert service.store.is_rejected(ALIAS, 2) and queued_imports(service.redis, ALIAS) == []
    assert service.writer.read(ALIAS).active == 0  # type: ignore[union-attr]


def test_an_import_whose_gate_breaks_is_rejected_not_retried_forever(
    service: LearnerService,
) -> None:
    from ratchet.versions import queued_imports

    scripted_gate(service, passed=RuntimeError("bug"))
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    imported(service, 1)
    service.imports.gate_next(ALIAS)
    [reject] = [e for e in service.writer.history(ALIAS, limit=5) if e["kind"] == "reject"]
    assert reject["detail"]["reason"].startswith("import_failed: RuntimeError: bug")
    stored = service.rounds.candidates.get(ALIAS, 1)
    assert stored is not None and (stored.stage, stored.reason) == (
        "rejected",
        reject["detail"]["reason"],
    )
    assert queued_imports(service.redis, ALIAS) == []
    assert metric(service, "ratchet_learner_failures_total", alias=ALIAS, cause="import") == 1


def test_a_settled_or_missing_import_is_dropped_and_none_is_gated_during_a_canary(
    service: LearnerService,
) -> None:
    from ratchet.registry import AliasRoute
    from ratchet.versions import queue_import, queued_imports

    asked = scripted_gate(service, passed=True)
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    queue_import(service.redis, ALIAS, 7)  # never written to the store
    service.imports.gate_next(ALIAS)
    assert queued_imports(service.redis, ALIAS) == [] and not asked
    add_versions(service, (1, 0), (2, 0))
    base = service.routes[ALIAS].base_model
    service.writer.write(AliasRoute(alias=ALIAS, base_model=base, canary=1, canary_weight=0.1))
    service.refresh_routes()
    queue_import(service.redis, ALIAS, 2)
    service.imports.gate_next(ALIAS)
    assert queued_imports(service.redis, ALIAS) == [2] and not asked  # waits for the canary
    service.store.mark(ALIAS, 2, "rejected", {})
    service.imports.gate_next(ALIAS)
    assert queued_imports(service.redis, ALIAS) == [] and not asked

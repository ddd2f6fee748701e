"""Lifecycle changes against a real Redis and a real adapter store: promote, reject, canary,
rollback (one step at a time, as far back as the lineage goes), pause and resume, the caller's
own commands in the same transaction, and events kept for Kafka until it takes them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka.errors import KafkaTimeoutError

from ratchet.lifecycle import Lifecycle, LifecycleError
from ratchet.records import LifecycleEvent
from ratchet.registry import CHANNEL, AliasRoute, InvalidRoute, RegistryWriter, alias_key
from ratchet.settings import AliasConfig
from ratchet.store import AdapterStore

ALIAS = "support"


def add_version(store: AdapterStore, version: int, parent: int) -> None:
    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

    store.write(ALIAS, version, write_adapter, "/models/base", {"parent_version": parent})


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    store = AdapterStore(tmp_path / "adapters")
    for version in (1, 2, 3):
        add_version(store, version, parent=version - 1)
    return store


@pytest.fixture
def writer(redis_url: str) -> RegistryWriter:
    return RegistryWriter(redis_url, {ALIAS: AliasConfig(base_model="base")})


@pytest.fixture
def life(writer: RegistryWriter, store: AdapterStore) -> Lifecycle:
    return Lifecycle(writer, store, sink=None, actor="test")


def status_of(store: AdapterStore, version: int) -> str | None:
    status = store.status(ALIAS, version)
    return None if status is None else status["status"]


def kinds(writer: RegistryWriter) -> list[tuple[str, int | None, int | None]]:
    return [(e["kind"], e["version"], e["previous_version"]) for e in writer.history(ALIAS)]


# --- promote and reject -----------------------------------------------------------------------


def test_promote_makes_the_version_live_and_records_it(
    life: Lifecycle, writer: RegistryWriter, store: AdapterStore
) -> None:
    route = life.promote(ALIAS, 1, {"why": "gate"})
    assert route.active == 1 and route.canary is None
    stored = writer.read(ALIAS)
    assert stored is not None and stored.active == 1
    status = store.status(ALIAS, 1)
    assert status is not None and status["status"] == "promoted" and status["by"] == "test"

    life.promote(ALIAS, 2)
    history = writer.history(ALIAS)
    assert kinds(writer) == [("promote", 2, 1), ("promote", 1, 0)]  # newest first
    assert history[1]["detail"] == {"why": "gate"} and history[1]["actor"] == "test"


def test_promote_refuses_what_cannot_be_served(life: Lifecycle, writer: RegistryWriter) -> None:
    with pytest.raises(LifecycleError, match="not in the adapter store"):
        life.promote(ALIAS, 9)
    with pytest.raises(LifecycleError, match="unknown alias"):
        life.promote("nobody", 1)
    life.promote(ALIAS, 1)
    with pytest.raises(LifecycleError, match="already serves v1"):
        life.promote(ALIAS, 1)
    assert kinds(writer) == [("promote", 1, 0)]


def test_a_rejected_version_is_only_served_with_force(
    life: Lifecycle, writer: RegistryWriter, store: AdapterStore
) -> None:
    life.reject(ALIAS, 2, {"reason": "win rate 0.4"})
    assert store.is_rejected(ALIAS, 2)
    assert store.status(ALIAS, 2) == {"status": "rejected", "reason": "win rate 0.4"}
    assert kinds(writer) == [("reject", 2, None)]
    route = writer.read(ALIAS)
    assert route is not None and route.active == 0  # rejecting changes no route

    with pytest.raises(LifecycleError, match="rejected by the gate"):
        life.promote(ALIAS, 2)
    with pytest.raises(LifecycleError, match="rejected by the gate"):
        life.start_canary(ALIAS, 2, 0.1, {})
    assert life.promote(ALIAS, 2, force=True).active == 2
    assert not store.is_rejected(ALIAS, 2)


# --- canary -----------------------------------------------------------------------------------


def test_a_canary_takes_a_share_until_it_is_promoted(
    life: Lifecycle, writer: RegistryWriter
) -> None:
    life.promote(ALIAS, 1)
    life.start_canary(ALIAS, 2, 0.25, {"gate": "ok"})
    route = writer.read(ALIAS)
    assert route is not None and (route.active, route.canary, route.canary_weight) == (1, 2, 0.25)
    assert writer.history(ALIAS)[0]["detail"] == {"weight": 0.25, "gate": "ok"}

    life.promote(ALIAS, 2)
    route = writer.read(ALIAS)
    assert route is not None and (route.active, route.canary, route.canary_weight) == (2, None, 0.0)
    assert kinds(writer)[:2] == [("promote", 2, 1), ("canary", 2, 1)]


def test_rollback_with_a_canary_ends_the_canary(
    life: Lifecycle, writer: RegistryWriter, store: AdapterStore
) -> None:
    life.promote(ALIAS, 1)
    life.start_canary(ALIAS, 2, 0.1, {})
    route = life.rollback(ALIAS, "error_rate: too many 500s")
    assert (route.active, route.canary, route.canary_weight) == (1, None, 0.0)
    stored = writer.read(ALIAS)
    assert stored is not None and (stored.active, stored.canary) == (1, None)
    status = store.status(ALIAS, 2)
    assert status is not None and status["status"] == "rolled_back"
    assert status["reason"] == "error_rate: too many 500s"
    assert status_of(store, 1) == "promoted"
    assert kinds(writer)[0] == ("rollback", 1, 2)


# --- rollback without a canary ----------------------------------------------------------------


def test_rollbacks_walk_back_one_version_at_a_time_to_v0(
    life: Lifecycle, writer: RegistryWriter, store: AdapterStore
) -> None:
    life.promote(ALIAS, 1)
    life.promote(ALIAS, 2)
    assert life.rollback(ALIAS, "manual").active == 1
    assert status_of(store, 2) == "rolled_back"
    # The rollback event names v1 as restored; the step back from v1 is v0, not v2 again.
    assert life.rollback(ALIAS, "manual").active == 0
    assert status_of(store, 1) == "rolled_back"
    with pytest.raises(LifecycleError, match="no earlier version"):
        life.rollback(ALIAS, "manual")
    route = writer.read(ALIAS)
    assert route is not None and route.active == 0
    assert kinds(writer)[:2] == [("rollback", 0, 1), ("rollback", 1, 2)]


def test_rollback_after_a_canary_rollback_goes_back_not_to_the_canary(
    life: Lifecycle, writer: RegistryWriter
) -> None:
    life.promote(ALIAS, 1)
    life.start_canary(ALIAS, 2, 0.1, {})
    life.rollback(ALIAS, "feedback")  # ends the canary; v1 stays
    route = life.rollback(ALIAS, "manual")
    assert route.active == 0, "a rolled-back canary must never come back through a rollback"


def test_rollback_follows_the_store_lineage_without_history(
    life: Lifecycle, writer: RegistryWriter
) -> None:
    # Set by hand, with no event: only the store knows v3's parent.
    route = writer.read(ALIAS)
    assert route is not None
    writer.write(replace(route, active=3))
    assert life.rollback(ALIAS, "manual").active == 2
    assert life.rollback(ALIAS, "manual").active == 1
    assert life.rollback(ALIAS, "manual").active == 0


def test_rollback_on_v0_is_refused(life: Lifecycle, writer: RegistryWriter) -> None:
    with pytest.raises(LifecycleError, match="no earlier version"):
        life.rollback(ALIAS, "manual")
    assert writer.history(ALIAS) == []


# --- pause and resume -------------------------------------------------------------------------


def test_pause_and_resume_set_the_flag_and_record_why(
    life: Lifecycle, writer: RegistryWriter
) -> None:
    life.promote(ALIAS, 1)
    assert life.pause(ALIAS, "collapse: 9 of 10", {"groups": 10}).paused
    route = writer.read(ALIAS)
    assert route is not None and route.paused and route.active == 1  # serving is untouched
    assert writer.history(ALIAS)[0]["detail"] == {"reason": "collapse: 9 of 10", "groups": 10}

    assert not life.resume(ALIAS).paused
    route = writer.read(ALIAS)
    assert route is not None and not route.paused
    assert [k for k, _, _ in kinds(writer)] == ["resume", "pause", "promote"]
    with pytest.raises(LifecycleError, match="not paused"):
        life.resume(ALIAS)


# --- one transaction, and the registry channel ------------------------------------------------


def test_also_runs_in_the_same_transaction(life: Lifecycle, writer: RegistryWriter) -> None:
    def mark(pipe: Any) -> None:
        pipe.zadd("caller:trained", {"g1": 1.0, "g2": 1.0})

    life.promote(ALIAS, 1, also=mark)
    assert writer.redis.zcard("caller:trained") == 2
    life.reject(ALIAS, 2, {"reason": "no"}, also=lambda pipe: pipe.set("caller:rejected", "1"))
    assert writer.redis.get("caller:rejected") == b"1"

    def broken(pipe: Any) -> None:
        pipe.set("caller:half", "1")
        raise RuntimeError("the caller failed while queueing")

    with pytest.raises(RuntimeError):
        life.start_canary(ALIAS, 3, 0.1, {}, also=broken)
    # Nothing of the failed change was applied: not the route, not the event, not the caller's.
    route = writer.read(ALIAS)
    assert route is not None and route.canary is None
    assert writer.redis.get("caller:half") is None
    assert [k for k, _, _ in kinds(writer)] == ["reject", "promote"]


def test_every_route_change_is_published(life: Lifecycle, redis_url: str) -> None:
    pubsub = redis.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(CHANNEL)
    subscribed = pubsub.get_message(timeout=2)
    assert subscribed is not None and subscribed["type"] == "subscribe"
    life.promote(ALIAS, 1)
    message = pubsub.get_message(timeout=2)
    assert message is not None and message["data"] == ALIAS.encode()
    life.reject(ALIAS, 2, {})  # no route change: nothing to refresh
    assert pubsub.get_message(timeout=0.3) is None
    pubsub.close()


# --- events on their way to Kafka -------------------------------------------------------------


class FlakySink:
    """Stands in for EventSink: refuses while ``down``, then takes everything."""

    def __init__(self) -> None:
        self.down = True
        self.sent: list[LifecycleEvent] = []

    def send(self, events: list[LifecycleEvent]) -> None:
        if self.down:
            raise KafkaTimeoutError("broker away")
        self.sent.extend(events)


def test_events_wait_for_kafka_after_redis_is_written(
    writer: RegistryWriter, store: AdapterStore
) -> None:
    sink = FlakySink()
    life = Lifecycle(writer, store, sink=sink)  # type: ignore[arg-type]
    life.promote(ALIAS, 1)  # Redis is the source of truth: the change is made
    life.pause(ALIAS, "manual")
    route = writer.read(ALIAS)
    assert route is not None and route.active == 1 and route.paused
    assert [e.kind for e in life.unsent] == ["promote", "pause"]
    with pytest.raises(KafkaTimeoutError):
        life.flush_events()
    assert life.flush_events(raise_errors=False) is False

    sink.down = False
    assert life.flush_events() is True
    assert [e.kind for e in sink.sent] == ["promote", "pause"] and life.unsent == []


def test_without_a_sink_the_redis_history_is_the_record(life: Lifecycle) -> None:
    life.promote(ALIAS, 1)
    assert life.unsent == [] and life.flush_events() is True


# --- concurrent writers -----------------------------------------------------------------------


def test_a_change_computed_before_a_concurrent_pause_keeps_the_pause(
    life: Lifecycle, writer: RegistryWriter, redis_url: str
) -> None:
    """The learner computes a promotion from the route it read; an operator pauses the alias
    before the promotion is written. The write must not put the route back unpaused: it is
    computed again from the paused route."""
    operator = Lifecycle(RegistryWriter(redis_url, writer.aliases), life.store, sink=None)
    seen: list[bool] = []

    def promote_to_2(route: AliasRoute) -> tuple[AliasRoute, LifecycleEvent]:
        seen.append(route.paused)
        if len(seen) == 1:
            operator.pause(ALIAS, "manual")  # lands between our read and our write
        return replace(route, active=2), life.event(ALIAS, "promote", version=2)

    new, _ = life.change(ALIAS, promote_to_2)
    assert seen == [False, True]
    route = writer.read(ALIAS)
    assert route is not None and route.paused and route.active == 2 and new == route
    assert [k for k, _, _ in kinds(writer)] == ["promote", "pause"]


def test_a_change_to_an_invalid_hash_is_refused_by_name(
    life: Lifecycle, writer: RegistryWriter
) -> None:
    writer.redis.hset(alias_key(ALIAS), "active", "two")
    with pytest.raises(LifecycleError, match="active is 'two'"):
        life.pause(ALIAS, "manual")


def test_an_operators_route_write_replaces_an_invalid_hash(writer: RegistryWriter) -> None:
    """`ratchet alias set` is how an operator repairs the hash: it starts from the defaults."""
    writer.redis.hset(alias_key(ALIAS), mapping={"active": "two", "base_model": "base"})

    def serve_3(route: AliasRoute | None) -> tuple[AliasRoute, LifecycleEvent]:
        assert route is not None
        return replace(route, active=3), LifecycleEvent(alias=ALIAS, kind="route", version=3)

    with pytest.raises(InvalidRoute):
        writer.change(ALIAS, serve_3)
    writer.change(ALIAS, serve_3, replace_invalid=True)
    route = writer.read(ALIAS)
    assert route is not None and (route.active, route.base_model, route.canary) == (3, "base", None)

"""Leases against a real Redis: one holder at a time, renewed only by its holder, released only by
its holder, free again after the TTL, and fencing a registry write."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from embedded.processes import wait_until
from ratchet.lease import Lease, LeaseKeeper, LeaseLost
from ratchet.records import LifecycleEvent
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import AliasConfig

KEY = "ratchet:test:lease"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_one_holder_at_a_time(client: redis.Redis) -> None:
    first, second = Lease(client, KEY, 5), Lease(client, KEY, 5)
    assert first.token != second.token  # two holders in one process differ
    assert first.acquire()
    assert not second.acquire()
    assert first.held() and not second.held()
    assert first.acquire()  # taking it again renews it
    assert second.holder() == first.token


def test_only_the_holder_renews_or_releases(client: redis.Redis) -> None:
    first, second = Lease(client, KEY, 5), Lease(client, KEY, 5)
    assert first.acquire()
    assert not second.renew()
    assert not second.release()
    assert first.held()
    assert first.release()
    assert client.get(KEY) is None
    assert second.acquire()


def test_a_lease_nobody_renews_is_free_after_its_ttl(client: redis.Redis) -> None:
    dead, survivor = Lease(client, KEY, 0.3), Lease(client, KEY, 0.3)
    assert dead.acquire()
    assert not survivor.acquire()
    wait_until(survivor.acquire, 5, "the lease to expire", interval_s=0.05)
    # The one that stalled past its TTL can neither renew nor release the new holder's lease.
    assert not dead.renew()
    assert not dead.release()
    assert survivor.held()


def test_a_renewal_extends_the_ttl(client: redis.Redis) -> None:
    lease = Lease(client, KEY, 2)
    assert lease.acquire()
    client.pexpire(KEY, 100)
    assert lease.renew()
    assert client.pttl(KEY) > 1000


def test_the_keeper_keeps_a_lease_past_its_ttl_until_dropped(client: redis.Redis) -> None:
    keeper = LeaseKeeper()
    # A TTL of 1 s (renewed every third of it): a busy 2-core machine can starve a thread for
    # a few tenths of a second, which must not look like a lost lease here.
    lease, other = Lease(client, KEY, 1.0), Lease(client, KEY, 1.0)
    assert lease.acquire()
    keeper.keep(lease)
    try:
        deadline = time.monotonic() + 2.5  # past two TTLs
        while time.monotonic() < deadline:
            assert not other.acquire()
            time.sleep(0.05)
        keeper.drop(lease)
        wait_until(other.acquire, 5, "the dropped lease to expire")
    finally:
        keeper.stop()


def test_the_keeper_reports_a_lease_taken_from_it(client: redis.Redis) -> None:
    lost = threading.Event()
    keeper = LeaseKeeper(on_lost=lambda lease: lost.set())
    lease = Lease(client, KEY, 0.3)
    assert lease.acquire()
    keeper.keep(lease)
    try:
        client.set(KEY, "someone-else")  # as if it had expired and another holder took it
        assert lost.wait(5)
        assert client.get(KEY) == b"someone-else"
    finally:
        keeper.stop()


def test_a_write_fenced_by_a_lost_lease_writes_nothing(redis_url: str) -> None:
    writer = RegistryWriter(redis_url, {"support": AliasConfig(base_model="m")})
    lease = Lease(writer.redis, KEY, 5)
    assert lease.acquire()
    route = AliasRoute(alias="support", base_model="m", active=1)
    event = LifecycleEvent(alias="support", kind="promote", actor="t", version=1)
    writer.change("support", lambda _: (route, event), fence=lease)
    writer.write(None, event, alias="support", fence=lease)
    assert len(writer.history("support")) == 2

    writer.redis.set(KEY, "someone-else")
    moved = AliasRoute(alias="support", base_model="m", active=2)
    with pytest.raises(LeaseLost):
        writer.change("support", lambda _: (moved, event), fence=lease)
    with pytest.raises(LeaseLost):
        writer.write(None, event, alias="support", fence=lease)
    current = writer.read("support")
    assert current is not None and current.active == 1
    assert len(writer.history("support")) == 2


def test_a_ttl_must_be_positive(client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="positive"):
        Lease(client, KEY, 0)

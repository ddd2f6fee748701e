"""The proxy's routing table against a real Redis: a hash someone wrote by hand costs its alias
nothing but its updates, costs the other aliases nothing, and shows in /readyz and /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from embedded.processes import free_port as closed_port
from embedded.processes import wait_until_async
from proxy.app import create_app
from proxy.routing import RoutingCache
from proxy.state import shared_redis
from ratchet.registry import CHANNEL, AliasRoute, RegistryWriter, alias_key
from ratchet.settings import AliasConfig, RatchetSettings


@pytest.fixture
async def shared_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """The proxy's shared client, as ProxyState makes it (the cache does not close it)."""
    shared = shared_redis(redis_url)
    yield shared
    await shared.aclose()


# Aliases only Redis knows ("good", "bad", "sub") route on a base model that ratchet.yaml names.
ALIASES = {"configured": AliasConfig(base_model="b")}


async def test_an_invalid_hash_freezes_only_its_own_alias(
    redis_url: str, shared_client: aioredis.Redis
) -> None:
    writer = RegistryWriter(redis_url, ALIASES)
    writer.write(AliasRoute(alias="good", base_model="b", active=1))
    writer.write(AliasRoute(alias="bad", base_model="b", active=1))
    cache = RoutingCache(shared_client, ALIASES, refresh_s=0.05)
    await cache.start()
    raw = redis.Redis.from_url(redis_url)
    try:
        assert cache.routes["bad"].active == 1
        raw.hset(alias_key("bad"), "active", "two")
        raw.publish(CHANNEL, "bad")
        await wait_until_async(
            lambda: "bad" in cache.invalid.now, 5, "the invalid hash to be noticed"
        )
        assert cache.routes["bad"].active == 1  # its last valid route keeps serving
        # The table keeps refreshing: the other alias's change arrives.
        raw.hset(alias_key("good"), "active", "5")
        await wait_until_async(
            lambda: cache.routes["good"].active == 5, 5, "the refresh to carry on"
        )
        assert not cache.stale
        raw.hset(alias_key("bad"), "active", "3")
        raw.publish(CHANNEL, "bad")
        await wait_until_async(
            lambda: cache.routes["bad"].active == 3, 5, "the fixed hash to be read"
        )
        assert not cache.invalid.now
    finally:
        raw.close()
        await cache.close()


async def test_readyz_and_metrics_name_the_invalid_alias(
    redis_url: str, upstream: dict[str, Any], tmp_path: Path
) -> None:
    redis.Redis.from_url(redis_url).hset(alias_key("bad"), mapping={"canary_weight": "lots"})
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=redis_url,
        vllm_url=upstream["url"],
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            ready = (await client.get("/readyz")).json()
            metrics = (await client.get("/metrics")).text
    assert ready["routing_invalid"] == ["bad"] and ready["registry_stale"] is False, ready
    assert "ratchet_proxy_routing_invalid_aliases 1.0" in metrics


async def test_readyz_says_the_table_is_stale_while_redis_is_away(proxy: Any) -> None:
    client, _ = proxy
    ready = (await client.get("/readyz")).json()
    assert ready["registry"] is False and ready["registry_stale"] is True, ready


async def test_connected_means_a_write_arrives_without_waiting_for_a_refresh(
    redis_url: str,
    shared_client: aioredis.Redis,
) -> None:
    writer = RegistryWriter(redis_url, ALIASES)
    writer.write(AliasRoute(alias="sub", base_model="b", active=1))
    cache = RoutingCache(shared_client, ALIASES, refresh_s=3600)  # no full refresh during the test
    await cache.start()
    try:
        assert cache.readable  # read at start, before the subscription is up
        await wait_until_async(lambda: cache.connected, 5, "the change channel subscribed")
        writer.write(AliasRoute(alias="sub", base_model="b", active=2))
        await wait_until_async(
            lambda: cache.routes["sub"].active == 2, 2, "the write to arrive by pub/sub"
        )
    finally:
        await cache.close()


async def test_a_base_model_not_in_the_config_never_reaches_vllm(
    redis_url: str, shared_client: aioredis.Redis
) -> None:
    """v0 is served under the hash's base_model, which vLLM's filesystem resolver would join
    onto its adapter store: a name ratchet.yaml does not give is not routed."""
    raw = redis.Redis.from_url(redis_url)
    raw.hset(alias_key("configured"), mapping={"active": "0", "base_model": "../../tmp/evil"})
    raw.hset(alias_key("redis-only"), mapping={"active": "0", "base_model": "/abs/lora"})
    cache = RoutingCache(shared_client, ALIASES, refresh_s=3600)
    await cache.start()
    try:
        assert cache.routes["configured"].base_model == "b"  # its ratchet.yaml default
        assert "redis-only" not in cache.routes
        assert set(cache.invalid.now) == {"configured", "redis-only"}
        assert "base_model" in cache.invalid.now["configured"]
    finally:
        raw.close()
        await cache.close()


async def test_a_new_alias_with_an_invalid_hash_leaves_the_listener_running(
    redis_url: str,
    shared_client: aioredis.Redis,
) -> None:
    """Pushed by pub/sub, an alias never valid here (a base model this proxy's ratchet.yaml does
    not name) is not routed; the listener goes on and the next change still arrives at once."""
    cache = RoutingCache(shared_client, ALIASES, refresh_s=3600)  # no full refresh during the test
    await cache.start()
    writer = RegistryWriter(redis_url, {"other": AliasConfig(base_model="not-ours")})
    try:
        await wait_until_async(lambda: cache.connected, 5, "the change channel subscribed")
        writer.write(AliasRoute(alias="other", base_model="not-ours", active=1))
        await wait_until_async(
            lambda: "other" in cache.invalid.now, 5, "the invalid alias to be noticed"
        )
        assert "other" not in cache.routes
        RegistryWriter(redis_url, ALIASES).write(AliasRoute(alias="sub", base_model="b", active=4))
        await wait_until_async(
            lambda: "sub" in cache.routes, 5, "the next write to arrive by pub/sub"
        )
    finally:
        await cache.close()

"""A replica out of one version's rotation (ratchet/version_exclusion.py), through the proxy in
front of two stand-in replicas and a real Redis: once the learner excludes a replica for the
canary version, no request for that version reaches it (round robin would send every other one
there), the active version's requests still do, the exclusion arrives by the registry's
channel, shows as ``ratchet_fleet_version_excluded``, and a version every replica is out of is a
503, never a request to one of them."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from embedded.processes import free_port, wait_until_async
from proxy.app import create_app
from ratchet.fleet import NoReplica, Replicas, candidates
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.version_exclusion import (
    VersionExclusions,
    exclude,
    excluded_key,
    read_excluded,
)
from tests.unit.proxy.test_fleet_routing import Replica

ALIAS = "support"
BASE = "base"
ACTIVE, CANARY = 1, 2


@asynccontextmanager
async def proxy_of(
    tmp_path: Path, redis_url: str, replicas: list[Replica]
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
        redis_url=redis_url,
        vllm_endpoints=[r.url for r in replicas],
        aliases={ALIAS: AliasConfig(base_model=BASE)},
        proxy={
            "upstream_timeout_s": 5,
            "upstream_health_interval_s": 0.1,
            "balance": "round_robin",  # every replica in turn, unless one is out of rotation
            "expose_arm": True,
        },
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.ratchet


async def ask(client: httpx.AsyncClient, sticky: str) -> tuple[int, str | None, str]:
    """(status, the version header, the replica that answered or the error code)."""
    response = await client.post(
        "/v1/chat/completions",
        headers={"x-ratchet-sticky-key": sticky},
        json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    if response.status_code != 200:
        return response.status_code, None, response.json()["error"]["code"]
    answered: str = response.json()["choices"][0]["message"]["content"]
    return 200, response.headers.get("x-ratchet-version"), answered


async def test_a_replica_out_of_the_canarys_rotation_gets_none_of_its_requests(
    tmp_path: Path, redis_url: str
) -> None:
    bad, good = Replica(), Replica()
    await bad.start()
    await good.start()
    writer = RegistryWriter(redis_url, {ALIAS: AliasConfig(base_model=BASE)})
    writer.write(AliasRoute(ALIAS, BASE, active=ACTIVE, canary=CANARY, canary_weight=0.5))
    client = redis.Redis.from_url(redis_url)
    try:
        async with proxy_of(tmp_path, redis_url, [bad, good]) as (http, state):
            await wait_until_async(
                lambda: all(e.healthy for e in state.upstream.endpoints.values()),
                10,
                "both replicas healthy",
            )
            # Started before the exclusion: it must arrive by the channel, not at start.
            exclude(client, ALIAS, CANARY, {bad.url: "cannot serve it: HTTP 404"}, ttl_s=600)
            await wait_until_async(
                lambda: bad.url in state.upstream.exclusions.barred(f"{ALIAS}@v{CANARY}"),
                5,
                "the exclusion to reach the proxy",
            )
            served: Counter[tuple[str | None, str]] = Counter()
            for i in range(40):
                status, version, replica = await ask(http, f"user-{i}")
                assert status == 200, replica
                served[version, replica] += 1
            canary = {r for v, r in served if v == str(CANARY)}
            active = {r for v, r in served if v == str(ACTIVE)}
            assert canary == {good.url}, served  # never the excluded replica
            assert active == {bad.url, good.url}, served  # the active version still goes there
            assert all(b["model"] != f"{ALIAS}@v{CANARY}" for b in bad.bodies)
            metrics = (await http.get("/metrics")).text
            line = (
                f'ratchet_fleet_version_excluded{{alias="{ALIAS}",replica="{bad.url}",'
                f'version="{CANARY}"}} 1.0'
            )
            assert line in metrics, metrics

            # Every replica out of the version's rotation: a 503, and neither is asked.
            exclude(client, ALIAS, CANARY, {good.url: "cannot serve it"}, ttl_s=600)
            await wait_until_async(
                lambda: len(state.upstream.exclusions.barred(f"{ALIAS}@v{CANARY}")) == 2,
                5,
                "the second exclusion to reach the proxy",
            )
            seen = {r.url: len(r.bodies) for r in (good, bad)}
            outcomes = [await ask(http, f"user-{i}") for i in range(40)]
            refused = [o for o in outcomes if o[0] != 200]
            assert refused and {o[2] for o in refused} == {"no_replica_for_version"}, outcomes
            asked = [b for r in (good, bad) for b in r.bodies[seen[r.url] :]]
            assert len(asked) == len(outcomes) - len(refused)  # only the active version's
            assert {b["model"] for b in asked} == {f"{ALIAS}@v{ACTIVE}"}
    finally:
        client.delete(excluded_key(ALIAS, CANARY))
        await bad.stop()
        await good.stop()


def test_exclusions_are_kept_with_a_ttl_and_read_back(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    exclude(client, ALIAS, 3, {"http://a:8000": "cannot serve it"}, ttl_s=120)
    exclude(client, ALIAS, 0, {"http://a:8000": "v0 is never excluded"}, ttl_s=120)
    assert read_excluded(client, ALIAS, 3) == {"http://a:8000": "cannot serve it"}
    assert 0 < client.ttl(excluded_key(ALIAS, 3)) <= 120
    assert not client.exists(excluded_key(ALIAS, 0))


def test_the_filter_never_offers_a_barred_replica() -> None:
    urls = ["http://a", "http://b", "http://c"]
    up = {"http://a"}
    # The only healthy replica is barred: the others are offered (the request says if any is
    # up), never the barred one.
    assert candidates(urls, lambda u: u in up, barred={"http://a"}) == ["http://b", "http://c"]
    # Every other replica tried: still never the barred one.
    assert candidates(urls, lambda u: True, {"http://b", "http://c"}, {"http://a"}) == [
        "http://b",
        "http://c",
    ]
    assert candidates(urls, lambda u: True, barred=set(urls)) == []
    assert candidates(urls, lambda u: True) == urls  # no exclusion: as before


async def test_clients_outside_the_proxy_avoid_a_barred_replica() -> None:
    replicas = Replicas(["http://a", "http://b"], resolve=False)
    replicas.exclusions.add(ALIAS, 4, {"http://a": "cannot serve it"})
    for i in range(20):
        async with replicas.use(f"{ALIAS}@v4", conversation=str(i)) as url:
            assert url == "http://b"
    used = set()
    for i in range(20):
        async with replicas.use(f"{ALIAS}@v3", conversation=str(i)) as url:
            used.add(url)
    assert used <= {"http://a", "http://b"} and used  # another version is unaffected
    replicas.exclusions.add(ALIAS, 4, {"http://b": "cannot serve it"})
    with pytest.raises(NoReplica):
        async with replicas.use(f"{ALIAS}@v4"):
            pass


def test_exclusions_are_looked_up_by_served_name_and_replaced_per_alias() -> None:
    exclusions = VersionExclusions()
    exclusions.replace({ALIAS: {2: {"http://a": "x"}}, "other": {}})
    assert exclusions.barred(f"{ALIAS}@v2") == {"http://a"}
    assert exclusions.barred(f"{ALIAS}@v1") == frozenset()
    exclusions.set_alias("other", {5: {"http://b": "y"}})
    assert list(exclusions.entries()) == [("other", 5, "http://b"), (ALIAS, 2, "http://a")]
    exclusions.set_alias(ALIAS, {})
    assert exclusions.barred(f"{ALIAS}@v2") == frozenset()

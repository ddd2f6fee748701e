"""The proxy in front of two vLLM replicas (vllm_endpoints), stand-ins that say who answered: a
served name sticks to one replica, a hot one spreads within the load bound, a replica that dies
costs no request (the next replica answers), and one that comes back is used again once its
health check passes. Per-replica counters say where requests went."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

import ratchet.fleet
from embedded.processes import free_port, wait_until_async
from proxy.app import create_app
from ratchet.fleet import choose, conversation_key
from ratchet.settings import RatchetSettings

# Two aliases whose served names (their base models: no Redis here, so both serve v0) the ring
# puts on different replicas; found below for the ports of the run.
NAMES = [f"base-{i}" for i in range(20)]


class Replica:
    """A stand-in vLLM on a fixed port that can be stopped and started again."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port or free_port()
        self.url = f"http://{host}:{self.port}"
        # Set: answers wait until it is opened, so a test can hold requests in flight.
        self.gate: asyncio.Event | None = None
        self.held = 0
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.gate is not None:
            self.held += 1
            await self.gate.wait()
        message = {"role": "assistant", "content": self.url}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@asynccontextmanager
async def fleet_proxy(
    tmp_path: Path, replicas: list[Replica] | list[str], names: list[str]
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        vllm_endpoints=[r if isinstance(r, str) else r.url for r in replicas],
        aliases={f"a{i}": {"base_model": name} for i, name in enumerate(names)},
        proxy={"upstream_timeout_s": 5, "upstream_health_interval_s": 0.1},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.ratchet


async def ask(client: httpx.AsyncClient, alias: str) -> str:
    """The replica that answered a chat request for ``alias``."""
    response = await client.post(
        "/v1/chat/completions",
        json={"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    assert response.status_code == 200, response.text
    answered: str = response.json()["choices"][0]["message"]["content"]
    return answered


def apart(replicas: list[Replica]) -> list[str]:
    """Two served names the ring puts on different replicas."""
    urls = [r.url for r in replicas]
    first = NAMES[0]
    other = next(n for n in NAMES[1:] if choose(n, urls, {}) != choose(first, urls, {}))
    return [first, other]


async def test_a_version_sticks_to_its_replica_and_a_dead_one_costs_no_request(
    tmp_path: Path,
) -> None:
    replicas = [Replica(), Replica()]
    for replica in replicas:
        await replica.start()
    names = apart(replicas)
    home = {name: choose(name, [r.url for r in replicas], {}) for name in names}
    try:
        async with fleet_proxy(tmp_path, replicas, names) as (client, state):
            await wait_until_async(
                lambda: state.upstream.ready, 5, "a replica to pass its health check"
            )
            for i, name in enumerate(names):
                assert {await ask(client, f"a{i}") for _ in range(6)} == {home[name]}
            metrics = (await client.get("/metrics")).text
            for replica in replicas:
                assert (
                    f'ratchet_proxy_endpoint_requests_total{{endpoint="{replica.url}"}} 6.0'
                    in metrics
                )
                assert f'ratchet_proxy_endpoint_up{{endpoint="{replica.url}"}} 1.0' in metrics

            # The replica of a1 dies: its requests are answered by the other, none fails.
            dead = next(r for r in replicas if r.url == home[names[1]])
            await dead.stop()
            assert {await ask(client, "a1") for _ in range(4)} == {home[names[0]]}
            assert not state.upstream.endpoints[dead.url].healthy
            # Back, and healthy again: a1's requests return to it.
            await dead.start()
            await wait_until_async(
                lambda: state.upstream.endpoints[dead.url].healthy,
                5,
                "the restarted replica healthy again",
            )
            assert await ask(client, "a1") == dead.url
            assert all(e.outstanding == 0 for e in state.upstream.endpoints.values())
    finally:
        for replica in replicas:
            await replica.stop()


async def test_a_hot_version_spreads_over_the_replicas_within_the_bound(tmp_path: Path) -> None:
    replicas = [Replica(), Replica()]
    gate = asyncio.Event()  # every answer waits: the 12 requests are all in flight at once
    for replica in replicas:
        replica.gate = gate
        await replica.start()
    try:
        async with fleet_proxy(tmp_path, replicas, NAMES[:1]) as (client, state):
            await wait_until_async(
                lambda: state.upstream.ready, 5, "a replica to pass its health check"
            )
            asked = asyncio.gather(*(ask(client, "a0") for _ in range(12)))
            await wait_until_async(
                lambda: sum(r.held for r in replicas) == 12, 5, "all 12 requests in flight"
            )
            gate.set()
            answered = Counter(await asked)
            # 12 at once of one version: ceil(1.25 x 12 / 2) = 8 at most on one replica.
            assert set(answered) == {r.url for r in replicas} and max(answered.values()) <= 8
            assert all(e.outstanding == 0 for e in state.upstream.endpoints.values())
    finally:
        for replica in replicas:
            await replica.stop()


async def test_replicas_behind_a_name_join_and_leave_as_it_resolves(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A headless Service's name resolves to one address per ready pod: the proxy re-resolves
    it at each health check, so a pod that starts is used once healthy and one that goes is
    dropped, its series with it."""
    port = free_port()
    replicas = [Replica(host="127.0.0.1", port=port), Replica(host="127.0.0.2", port=port)]
    for replica in replicas:
        await replica.start()
    addresses = ["127.0.0.1"]

    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        assert host == "vllm-headless.ml.svc"
        return [(2, 1, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    name = f"http://vllm-headless.ml.svc:{port}"
    try:
        async with fleet_proxy(tmp_path, [name], NAMES[:1]) as (client, state):
            await wait_until_async(
                lambda: state.upstream.ready, 5, "a replica to pass its health check"
            )
            assert list(state.upstream.endpoints) == [replicas[0].url]
            assert await ask(client, "a0") == replicas[0].url

            addresses.append("127.0.0.2")  # a second pod is ready
            await wait_until_async(
                lambda: replicas[1].url in state.upstream.endpoints,
                5,
                "the second pod in the fleet",
            )
            await wait_until_async(
                lambda: state.upstream.endpoints[replicas[1].url].healthy,
                5,
                "the second pod healthy",
            )
            answered = set(await asyncio.gather(*(ask(client, "a0") for _ in range(2))))
            assert answered <= {r.url for r in replicas}

            addresses.remove("127.0.0.1")  # the first pod is gone
            await wait_until_async(
                lambda: list(state.upstream.endpoints) == [replicas[1].url],
                5,
                "the first pod gone from the fleet",
            )
            assert await ask(client, "a0") == replicas[1].url
            metrics = (await client.get("/metrics")).text
            assert f'endpoint="{replicas[1].url}"' in metrics
            assert f'endpoint="{replicas[0].url}"' not in metrics
    finally:
        for replica in replicas:
            await replica.stop()


async def test_round_robin_takes_each_replica_in_turn(tmp_path: Path) -> None:
    """proxy.balance round_robin, the fleet bench's peer: one version's requests alternate."""
    replicas = [Replica(), Replica()]
    for replica in replicas:
        await replica.start()
    try:
        settings = RatchetSettings(
            home=tmp_path,
            kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            vllm_endpoints=[r.url for r in replicas],
            aliases={"a0": {"base_model": NAMES[0]}},
            proxy={"balance": "round_robin", "upstream_health_interval_s": 0.1},
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            state = app.state.ratchet
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                await wait_until_async(
                    lambda: all(e.healthy for e in state.upstream.endpoints.values()),
                    5,
                    "both replicas healthy",
                )
                answered = [await ask(client, "a0") for _ in range(4)]
        assert answered[0] != answered[1] and answered[:2] == answered[2:]
    finally:
        for replica in replicas:
            await replica.stop()


async def test_each_request_is_routed_by_its_conversation_too(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The key the replica is chosen by: a conversation's turns share it, the client's
    prompt_cache_key replaces it, and vLLM never gets that parameter."""
    replicas = [Replica(), Replica()]
    for replica in replicas:
        await replica.start()
    keys: list[str | None] = []

    def choose_recorded(*args: Any) -> str:
        keys.append(args[4])  # choose(key, endpoints, outstanding, load_factor, conversation, …)
        return choose(*args)

    monkeypatch.setattr(ratchet.fleet, "choose", choose_recorded)

    async def chat(messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
        body = {"model": "a0", "messages": messages, "max_tokens": 1, **extra}
        return await client.post("/v1/chat/completions", json=body)

    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    later = [*opening, {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "?"}]
    try:
        async with fleet_proxy(tmp_path, replicas, NAMES[:1]) as (client, state):
            await wait_until_async(
                lambda: state.upstream.ready, 5, "a replica to pass its health check"
            )
            for messages in (opening, later, [{"role": "user", "content": "Bergen?"}]):
                assert (await chat(messages)).status_code == 200
            assert keys[0] is not None and keys[0] == keys[1] != keys[2]
            assert keys[0] == conversation_key({"messages": opening})
            for messages in (opening, [{"role": "user", "content": "Bergen?"}]):
                assert (await chat(messages, prompt_cache_key="ticket-7")).status_code == 200
            assert keys[3] == keys[4] == conversation_key({"prompt_cache_key": "ticket-7"})
            refused = await chat(opening, prompt_cache_key=7)
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "prompt_cache_key"
    finally:
        for replica in replicas:
            await replica.stop()
    bodies = [b for r in replicas for b in r.bodies]
    assert len(bodies) == 5 and not any("prompt_cache_key" in b for b in bodies)

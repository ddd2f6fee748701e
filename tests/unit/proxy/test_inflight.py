"""The per-key bounds on requests in flight and on parse memory, and the replica's bound on parse
memory across every key (proxy/inflight.py, audit M-2): the middleware around a small ASGI app
that holds each request until the test lets it go."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest

from proxy.inflight import (
    BODY_COPIES,
    PARSE_AMPLIFICATION,
    PARSED_BYTES_PER_ITEM,
    InFlightBound,
    parse_charge,
)

MAX_BODY = 4 * 2**20
ITEMS = 262_144
MiB = 2**20


class Held:
    """An app that answers 200 only when released (or raises, when told to)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0
        self.fail = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.entered += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the route failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def bound(app: Held, auth: bool = True, **limits: int) -> InFlightBound:
    return InFlightBound(
        app,
        max_in_flight=limits.get("max_in_flight", 2),
        max_parse_bytes=limits.get("max_parse_bytes", 64 * MiB),
        max_body_bytes=MAX_BODY,
        max_json_items=ITEMS,
        auth=auth,
        on_refused=refused.append,
        replica_max_parse_bytes=limits.get("replica_max_parse_bytes", 1024 * MiB),
    )


refused: list[str] = []


async def call(
    middleware: InFlightBound,
    key: str | None = "k1",
    size: int | None = 100,
    path: str = "/v1/chat/completions",
    method: str = "POST",
) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if size is not None:
        headers.append((b"content-length", str(size).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], orjson.loads(body), dict(sent[0]["headers"])


async def started(app: Held, count: int) -> None:
    while app.entered < count:
        await asyncio.sleep(0)


def test_what_a_body_is_charged_bounds_what_it_can_hold_parsed() -> None:
    assert parse_charge(0, ITEMS) == 0
    small = 2000
    assert parse_charge(small, ITEMS) == small * (BODY_COPIES + PARSE_AMPLIFICATION)
    # Past the item bound the tree can grow no more, however large the body.
    assert parse_charge(MAX_BODY, ITEMS) == MAX_BODY * BODY_COPIES + ITEMS * PARSED_BYTES_PER_ITEM
    assert parse_charge(MAX_BODY, ITEMS) < 60 * MiB


async def test_a_key_past_its_requests_in_flight_gets_429_and_its_slots_come_back() -> None:
    refused.clear()
    app = Held()
    middleware = bound(app)
    held = [asyncio.create_task(call(middleware)) for _ in range(2)]
    await started(app, 2)
    status, body, headers = await call(middleware)
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert body["error"]["code"] == "too_many_requests_in_flight"
    assert body["error"]["type"] == "rate_limit_error"
    assert "proxy.rate_limit.max_in_flight" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert refused == ["max_in_flight"]
    # Another key is served meanwhile; probes are never counted.
    other = asyncio.create_task(call(middleware, key="k2"))
    await started(app, 3)
    app.release.set()
    assert (await other)[0] == 200
    assert [(await task)[0] for task in held] == [200, 200]
    assert middleware.loads == {}  # given back, and forgotten
    assert (await call(middleware))[0] == 200


async def test_a_failing_route_gives_its_charge_back_too() -> None:
    app = Held()
    app.fail = True
    app.release.set()
    middleware = bound(app)
    with pytest.raises(RuntimeError):
        await call(middleware, size=MAX_BODY)
    assert middleware.loads == {}


async def test_a_body_past_the_keys_parse_memory_gets_413_unless_it_is_alone() -> None:
    refused.clear()
    app = Held()
    middleware = bound(app, max_in_flight=10, max_parse_bytes=2 * MiB)
    # Alone, a body charged more than the bound is let in: max_body_bytes bounds one body.
    alone = asyncio.create_task(call(middleware, size=MAX_BODY))
    await started(app, 1)
    status, body, _ = await call(middleware, size=200)  # 5 KB charged: past 2 MiB with the first
    assert status == 413 and body["error"]["code"] == "parse_memory_exceeded"
    assert "proxy.rate_limit.max_parse_bytes" in body["error"]["message"]
    assert refused == ["max_parse_bytes"]
    # A GET reads no body: it costs nothing but its slot.
    models = asyncio.create_task(call(middleware, size=None, path="/v1/models", method="GET"))
    await started(app, 2)
    app.release.set()
    assert (await alone)[0] == 200 and (await models)[0] == 200


async def test_a_body_without_content_length_is_charged_as_the_largest() -> None:
    app = Held()
    middleware = bound(app, max_in_flight=10, max_parse_bytes=2 * MiB)
    first = asyncio.create_task(call(middleware, size=10))
    await started(app, 1)
    assert (await call(middleware, size=None))[0] == 413
    app.release.set()
    await first


async def test_without_keys_everyone_is_one_client_and_probes_pass() -> None:
    app = Held()
    middleware = bound(app, auth=False)
    held = [asyncio.create_task(call(middleware, key=f"made-up-{i}")) for i in range(2)]
    await started(app, 2)
    assert (await call(middleware, key="made-up-3"))[0] == 429
    assert (await call(middleware, key=None))[0] == 429
    probe = asyncio.create_task(call(middleware, path="/healthz", method="GET", size=None))
    await started(app, 3)
    app.release.set()
    assert (await probe)[0] == 200
    for task in held:
        await task


async def test_keys_each_within_their_bound_get_503_past_the_replicas_parse_memory() -> None:
    """Many keys, each far below max_parse_bytes, cannot take the replica past its own bound:
    the request that would pass it gets a 503 with retry-after in its API's envelope, counted;
    every charge comes back, and the replica takes the next one."""
    refused.clear()
    app = Held()
    middleware = bound(app, max_in_flight=10, replica_max_parse_bytes=28 * MiB)
    per_100k = parse_charge(100_000, ITEMS)  # 2.6 MB
    first = asyncio.create_task(call(middleware, key="k1", size=1_100_000))  # 27.3 MiB
    await started(app, 1)
    status, body, headers = await call(middleware, key="k2", size=100_000)
    assert parse_charge(1_100_000, ITEMS) + per_100k > 28 * MiB
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert body["error"]["code"] == "replica_parse_memory_exceeded"
    assert body["error"]["type"] == "server_error"
    assert "proxy.rate_limit.replica_max_parse_bytes" in body["error"]["message"]
    assert refused == ["replica_max_parse_bytes"]
    status, body, headers = await call(middleware, key="k3", size=100_000, path="/v1/messages")
    assert status == 503 and body["type"] == "error"  # Anthropic's envelope on its route
    assert body["error"]["type"] == "overloaded_error" and headers[b"retry-after"] == b"1"
    assert set(middleware.loads) == {b"Bearer k1"}  # the refused keys hold nothing
    # A body-less request costs no parse memory: it is not refused for it.
    models = asyncio.create_task(call(middleware, size=None, path="/v1/models", method="GET"))
    await started(app, 2)
    app.release.set()
    assert (await first)[0] == 200 and (await models)[0] == 200
    assert (middleware.all.requests, middleware.all.parse_bytes) == (0, 0)
    assert (await call(middleware, key="k2", size=100_000))[0] == 200
    # Alone, a body charged past the replica's bound is let in (one body: max_body_bytes).
    assert parse_charge(MAX_BODY, ITEMS) > 28 * MiB
    assert (await call(middleware, key="k3", size=MAX_BODY))[0] == 200

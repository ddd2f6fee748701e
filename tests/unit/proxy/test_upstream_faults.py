"""Upstream faults vLLM cannot be made to produce on demand: a hang, a 500, a missing adapter and
a stream cut mid-way. A small aiohttp server stands in for vLLM; everything else is the real app."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.log.spool import Spool
from ratchet.dev.processes import free_port as closed_port
from ratchet.settings import RatchetSettings

MSG = [{"role": "user", "content": "hi"}]


async def hang(_: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.json_response({})


async def fail(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "CUDA out of memory", "type": "x"}}, status=500)


async def missing(_: web.Request) -> web.Response:
    return web.json_response(
        {"error": {"message": "The model `support@v9` does not exist.", "code": 404}}, status=404
    )


async def cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    request.transport.close()  # the model server dies mid-answer
    return response


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def upstream() -> AsyncIterator[dict[str, Any]]:
    routes: dict[str, Any] = {"handler": hang}

    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await routes["handler"](request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dispatch)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = closed_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    routes["url"] = f"http://127.0.0.1:{port}"
    yield routes
    await runner.cleanup()


@pytest.fixture
async def proxy(
    upstream: dict[str, Any], tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = RatchetSettings(
        home=tmp_path,  # its own spool; the broker's port is closed, so records land there
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=f"redis://127.0.0.1:{closed_port()}/0",
        vllm_url=upstream["url"],
        proxy={"upstream_timeout_s": 0.5},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.ratchet


def assert_envelope(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and "Traceback" not in response.text
    return error


async def test_hanging_upstream_is_a_504(proxy: Any, upstream: dict[str, Any]) -> None:
    client, _ = proxy
    upstream["handler"] = hang
    response = await client.post("/v1/chat/completions", json={"model": "support", "messages": MSG})
    assert_envelope(response, 504, "upstream_timeout")


async def test_upstream_500_is_a_502(proxy: Any, upstream: dict[str, Any]) -> None:
    client, _ = proxy
    upstream["handler"] = fail
    response = await client.post("/v1/chat/completions", json={"model": "support", "messages": MSG})
    error = assert_envelope(response, 502, "upstream_error")
    assert "CUDA out of memory" in error["message"]


async def test_missing_adapter_is_a_502_naming_it(proxy: Any, upstream: dict[str, Any]) -> None:
    client, _ = proxy
    upstream["handler"] = missing
    response = await client.post("/v1/chat/completions", json={"model": "support", "messages": MSG})
    error = assert_envelope(response, 502, "adapter_unavailable")
    assert "smollm2-135m-instruct" in error["message"]


async def test_stream_cut_midway_ends_with_an_error_event_and_is_logged(
    proxy: Any, upstream: dict[str, Any]
) -> None:
    client, state = proxy
    upstream["handler"] = cut_stream
    response = await client.post(
        "/v1/chat/completions", json={"model": "support", "messages": MSG, "stream": True}
    )
    assert response.status_code == 200  # headers were already sent when it broke
    events = [
        orjson.loads(line[6:])
        for line in response.content.split(b"\n")
        if line.startswith(b"data: {")
    ]
    assert events[0]["choices"][0]["delta"]["content"] == "Hel"
    assert events[-1]["error"]["code"] == "upstream_error"
    # The broken exchange still reaches the log (spooled here: no broker) with status 502.
    log = state.traffic_log
    for _ in range(600):
        if log.spooled:
            break
        await asyncio.sleep(0.05)
    await log.close()
    spool = Spool(state.settings.spool_dir / f"proxy-{state.settings.proxy.port}")
    records = [orjson.loads(r.value) for _, rs in spool.drain() for r in rs]
    assert records[-1]["status"] == 502 and records[-1]["stream"] is True
    assert records[-1]["choices"][0]["message"]["content"] == "Hel"

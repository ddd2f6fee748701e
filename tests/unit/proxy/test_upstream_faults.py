"""Upstream faults vLLM cannot be made to produce on demand: a hang, a 500, a missing adapter and
a stream cut mid-way. A small aiohttp server stands in for vLLM (conftest.py); everything else
is the real app."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from aiohttp import web

from proxy.log.spool import Spool

MSG = [{"role": "user", "content": "hi"}]


async def hang(_: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.json_response({})


async def fail(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "CUDA out of memory", "type": "x"}}, status=500)


async def missing(request: web.Request) -> web.Response:
    """vLLM's 404 for an adapter it could not load names the served name it was asked for."""
    served = (await request.json())["model"]
    return web.json_response(
        {"error": {"message": f"The model `{served}` does not exist.", "code": 404}}, status=404
    )


async def cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    request.transport.close()  # the model server dies mid-answer
    return response


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
    """The client's error names the alias it asked for; the served name (which would tell the
    version or canary arm, proxy.expose_arm being off) is nowhere in it, vLLM's own words
    included."""
    client, _ = proxy
    upstream["handler"] = missing
    response = await client.post("/v1/chat/completions", json={"model": "support", "messages": MSG})
    error = assert_envelope(response, 502, "adapter_unavailable")
    assert error["message"] == (
        "the model server could not load support: The model `support` does not exist."
    )


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

"""The relay of a streamed answer: the usage event is found by its JSON however it is spaced,
left out for a client that did not ask for it, and counted; in-flight accounting ends at zero."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
from aiohttp import web

MSG = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def content(text: str, finish: str | None = None) -> dict[str, Any]:
    delta = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"id": "c1", "object": "chat.completion.chunk", "choices": [delta]}


# As a server other than vLLM writes them: json.dumps spacing, "usage": {...}, "choices": [].
PRETTY_EVENTS = [
    b"data: " + json.dumps(event).encode() + b"\n\n"
    for event in (
        content("Hel"),
        content("lo", finish="stop"),
        {"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    )
] + [b"data: [DONE]\n\n"]


def pretty_stream(seen: list[dict[str, Any]]) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in PRETTY_EVENTS:
            await response.write(event)
        await response.write_eof()
        return response

    return handler


async def whole_answer(_: web.Request) -> web.Response:
    body = {"id": "c2", "choices": [{"index": 0, "message": {"content": "Hi"}}], "usage": USAGE}
    return web.json_response(body)


async def cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(PRETTY_EVENTS[0])
    request.transport.close()  # the model server dies mid-answer
    return response


async def hang(_: web.Request) -> web.Response:
    await asyncio.sleep(5)  # past the proxy's upstream_timeout_s; cancelled at teardown
    return web.json_response({})


async def fail(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)


async def eventually(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def sample(state: Any, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


async def stream(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    body = {"model": "support", "messages": MSG, "stream": True, **fields}
    return await client.post("/v1/chat/completions", json=body)


async def test_spaced_usage_event_left_out_unless_asked_for_and_counted(
    proxy: Any, upstream: dict[str, Any]
) -> None:
    client, state = proxy
    seen: list[dict[str, Any]] = []
    upstream["handler"] = pretty_stream(seen)

    plain = await stream(client)
    assert plain.status_code == 200, plain.text
    assert plain.content == b"".join(PRETTY_EVENTS[:2]) + b"data: [DONE]\n\n"
    assert seen[-1]["stream_options"] == {"include_usage": True}, "usage is always asked of vLLM"

    asked = await stream(client, stream_options={"include_usage": True})
    assert asked.content == b"".join(PRETTY_EVENTS), "passed on byte for byte"

    # Both exchanges' tokens reach the token metric through the log worker.
    output = {"alias": "support", "version": "0", "arm": "active", "direction": "output"}
    await eventually(lambda: sample(state, "ratchet_proxy_tokens_total", **output) == 6)
    assert sample(state, "ratchet_proxy_tokens_total", **{**output, "direction": "input"}) == 14


async def test_in_flight_is_back_to_zero_after_every_kind_of_ending(
    proxy: Any, upstream: dict[str, Any]
) -> None:
    client, state = proxy
    endings: list[tuple[Any, bool, int]] = [
        (pretty_stream([]), True, 200),
        (whole_answer, False, 200),
        (fail, False, 502),
        (fail, True, 502),
        (cut_stream, True, 200),  # then an error event, and counted as a 502
        (hang, False, 504),
    ]
    for handler, streamed, status in endings:
        upstream["handler"] = handler
        body = {"model": "support", "messages": MSG, "stream": streamed}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == status, response.text
        assert sample(state, "ratchet_proxy_in_flight_requests") == 0
    labels = {"alias": "support", "version": "0", "arm": "active"}
    ok = sample(
        state, "ratchet_proxy_requests_total", **labels, endpoint="chat.completions", status="200"
    )
    failed = sample(
        state, "ratchet_proxy_requests_total", **labels, endpoint="chat.completions", status="502"
    )
    assert (ok, failed) == (2, 3)
    assert orjson.loads(response.content)["error"]["code"] == "upstream_timeout"


async def stalled_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(PRETTY_EVENTS[0])
    await asyncio.sleep(5)  # past the proxy's upstream_timeout_s; cancelled at teardown
    return response


async def test_a_stream_past_the_deadline_is_a_timeout_not_a_server_failure(
    proxy: Any, upstream: dict[str, Any]
) -> None:
    """A client provokes it at will (a long max_tokens, or reading slowly): recorded as the
    non-stream 504 is, upstream_timeout, which the canary does not count against the version."""
    client, state = proxy
    upstream["handler"] = stalled_stream
    response = await stream(client)
    assert response.status_code == 200, response.text
    last = response.content.strip().split(b"\n\n")[-1]
    assert orjson.loads(last.removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"
    labels = {"alias": "support", "version": "0", "arm": "active", "endpoint": "chat.completions"}
    assert sample(state, "ratchet_proxy_requests_total", **labels, status="504") == 1

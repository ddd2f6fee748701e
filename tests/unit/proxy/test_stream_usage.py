"""Stream budgets on what vLLM generated, not on what the client read (audit N-7;
proxy/stream_usage.py): a budgeted stream asks vLLM for its counts in every event, the client
still sees the stream it asked for, and a client that leaves is charged vLLM's last count,
read on after it left. (tests/integration/test_hostile_clients.py does it with the real vLLM.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from proxy.buckets import prompt_estimate
from proxy.stream_usage import DRAIN_S, StreamUsage, ask_continuous_usage
from tests.unit.proxy.test_ratelimit import (
    budgeted,  # noqa: F401  (the fixture)
    chat_body,
    post,
    spent,
    stream_and_leave,
)

PROMPT = 12  # what the fake vLLM says the prompt was


def chunk(index: int, text: str, completion: int | None, finish: str | None = None) -> bytes:
    """A chat event as vLLM 0.32 writes it, with ``continuous_usage_stats`` when ``completion``
    is given: the usage so far of that one choice."""
    event: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "support@v1",
        "choices": [
            {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        ],
    }
    if completion is not None:
        event["usage"] = {
            "prompt_tokens": PROMPT,
            "total_tokens": PROMPT + completion,
            "completion_tokens": completion,
        }
    return b"data: " + orjson.dumps(event) + b"\n\n"


def usage_only(total_completion: int) -> bytes:
    usage = {
        "prompt_tokens": PROMPT,
        "total_tokens": PROMPT + total_completion,
        "completion_tokens": total_completion,
    }
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def test_the_counts_are_read_and_left_out_of_what_the_client_sees() -> None:
    usage = StreamUsage(shown=False)
    plain = chunk(0, "a", None)
    tricky = 'c\\","usage":{"x":1}}'  # what a key and a brace look like inside a string
    events = chunk(0, "a", 1) + chunk(1, "b", 1) + chunk(0, tricky, 5) + usage_only(9)
    shown = usage.feed(events)
    # Each choice event as it would be without continuous usage; the usage-only event kept
    # (the relay drops it for a client that did not ask for usage, as before).
    assert shown.split(b"\n\n")[0] + b"\n\n" == plain
    assert shown.count(b'"usage"') == 1 and shown.endswith(usage_only(9))
    assert orjson.loads(shown.split(b"\n\n")[2][6:])["choices"][0]["delta"]["content"] == tricky
    assert usage.final == PROMPT + 9 and usage.generated == PROMPT + 9
    # Cut before the usage-only event: the prompt and each choice's last count.
    cut = StreamUsage(shown=False)
    cut.feed(chunk(0, "a", 1) + chunk(1, "b", 3) + chunk(0, "c", 7))
    assert cut.seen and cut.final is None and cut.generated == PROMPT + 7 + 3
    # A client that asked for continuous usage gets it.
    asked = StreamUsage(shown=True)
    assert asked.feed(chunk(0, "a", 1)) == chunk(0, "a", 1)


def test_a_stream_read_on_is_counted_across_torn_events() -> None:
    usage = StreamUsage(shown=False)
    stream = b"".join(chunk(0, "x", n) for n in range(1, 40))
    for at in range(0, len(stream), 7):
        usage.read_on(stream[at : at + 7])
    assert usage.generated == PROMPT + 39
    nothing = StreamUsage(shown=False)
    assert nothing.feed(b'data: {"choices":[],"usage":null}\n\n').endswith(b"null}\n\n")
    assert not nothing.seen


def test_vllm_is_asked_for_counts_and_the_client_only_sees_what_it_asked_for() -> None:
    options: dict[str, Any] = {}
    assert not ask_continuous_usage(options)
    assert options == {"include_usage": True, "continuous_usage_stats": True}
    assert not ask_continuous_usage({"continuous_usage_stats": True})  # vLLM: needs both
    assert ask_continuous_usage({"include_usage": True, "continuous_usage_stats": True})


async def test_a_slow_client_that_leaves_is_charged_what_vllm_generated(
    budgeted: Any,  # noqa: F811
    redis_url: str,
) -> None:
    """The client reads a few events and leaves; vLLM, which the proxy was no longer reading,
    had merged 300 tokens into its next event (as it does for a lagging reader): that count is
    what the key pays, not the few events it read (the old charge)."""
    asked: list[dict[str, Any]] = []
    left = asyncio.Event()

    async def vllm(request: web.Request) -> web.StreamResponse:
        asked.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, 6):
            await response.write(chunk(0, "one ", n))
        await left.wait()  # the proxy stopped reading; vLLM went on generating
        await response.write(chunk(0, "one " * 295, 300))
        await asyncio.sleep(30)
        return response

    body = chat_body(stream=True, max_tokens=400)
    async with budgeted(vllm, upstream_timeout_s=30) as app:
        await stream_and_leave(app, body, events=5)
        left.set()
        reserved = prompt_estimate(body) + 400
        deadline = time.monotonic() + 10 * DRAIN_S + 5
        while (charged := await spent(app, redis_url)) > reserved - 50:  # until settled
            assert time.monotonic() < deadline, charged
            await asyncio.sleep(0.05)
    assert asked[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert PROMPT + 300 - 5 <= charged <= PROMPT + 300, charged  # a second's refill at most


async def test_a_budgeted_answer_has_the_shape_the_client_asked_for(
    budgeted: Any,  # noqa: F811
) -> None:
    async def vllm(request: web.Request) -> web.StreamResponse:
        asked = await request.json()
        continuous = asked["stream_options"].get("continuous_usage_stats")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        served = b'"' + asked["model"].encode() + b'"'  # vLLM names what it served
        for n in (1, 2):
            event = chunk(0, "hi", n if continuous else None)
            await response.write(event.replace(b'"support@v1"', served))
        await response.write(usage_only(2) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with budgeted(vllm) as app:
        plain = await post(app, chat_body(stream=True, max_tokens=40))
        with_usage = await post(
            app, chat_body(stream=True, max_tokens=40, stream_options={"include_usage": True})
        )
        continuous = {"include_usage": True, "continuous_usage_stats": True}
        asked = await post(app, chat_body(stream=True, max_tokens=40, stream_options=continuous))
    # Exactly what it would be with no budget: no counts, the alias as the model.
    assert plain.content == (chunk(0, "hi", None) * 2).replace(b"@v1", b"") + b"data: [DONE]\n\n"
    assert with_usage.content.count(b'"usage"') == 1
    assert asked.content.count(b'"usage"') == 3

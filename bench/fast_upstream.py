"""A fast upstream for bench/proxy_overhead.py: what the proxy adds is measured against it.

A raw asyncio + httptools HTTP server that answers ``POST /v1/chat/completions`` with a canned
OpenAI-shaped body (echoing the ``model`` it was sent; an SSE stream when ``stream`` is true) and
``GET /health``. It costs a few microseconds a request, so what the proxy path adds over the
direct path is the proxy's own cost. Run as its own process::

    .venv/bin/python bench/fast_upstream.py PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, ClassVar

import httptools
import orjson
import uvloop


def _chat_answer(model: str) -> bytes:
    body = orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello! How can I help?"},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 31, "completion_tokens": 8, "total_tokens": 39},
        }
    )
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    return head + body


def _chat_stream(model: str, include_usage: bool) -> bytes:
    def event(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    events = [event({"role": "assistant", "content": ""}, None)]
    events += [event({"content": word}, None) for word in ("Hello", "! How", " can I", " help?")]
    events.append(event({}, "length"))
    if include_usage:
        usage = {"prompt_tokens": 31, "completion_tokens": 8, "total_tokens": 39}
        events.append({**event({}, None), "choices": [], "usage": usage})
    datas = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(d), d) for d in datas)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + chunks + b"0\r\n\r\n"


HEALTH_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class FastUpstream(asyncio.Protocol):
    """One keep-alive connection: parse with httptools, answer with cached bytes."""

    answers: ClassVar[dict[tuple[str, bool, bool], bytes]] = {}

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(self.answer())
        if not self.parser.should_keep_alive():
            self.transport.close()

    def answer(self) -> bytes:
        if self.url == b"/health":
            return HEALTH_ANSWER
        if self.url != b"/v1/chat/completions":
            return NOT_FOUND
        payload = orjson.loads(b"".join(self.body))
        stream = bool(payload.get("stream"))
        usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        key = (str(payload.get("model")), stream, usage)
        cached = self.answers.get(key)
        if cached is None:
            cached = _chat_stream(key[0], usage) if stream else _chat_answer(key[0])
            self.answers[key] = cached
        return cached


async def serve(port: int) -> None:
    """Answer on 127.0.0.1:``port`` until killed."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FastUpstream, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1])))

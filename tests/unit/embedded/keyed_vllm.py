"""A stand-in vLLM that requires its API key, as the embedded stack's and the chart's vLLM do.

Every path but /health needs ``Authorization: Bearer <key>``; without it the answer is vLLM's
401 ``{"error": "Unauthorized"}``. Every request's path and Authorization header is recorded.
/v1/chat/completions answers a RULER judge call (its response_format names the sample ids) with
a verdict over exactly those ids, and any other call with ``n`` distinct answers carrying token
ids and logprobs (what the judge's sampler asks for). It runs on its own event loop in a thread,
so callers on any loop (``asyncio.run``, pytest-asyncio) can reach it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from embedded.processes import free_port


@dataclass
class KeyedVllm:
    key: str
    url: str = ""
    # (method, path, Authorization header or None) of every request, in arrival order.
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def authorized(self) -> list[tuple[str, str, str | None]]:
        return [s for s in self.seen if s[2] == f"Bearer {self.key}"]

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        self.seen.append((request.method, request.path, authorization))
        if request.path == "/health":
            return web.Response(text="")
        if authorization != f"Bearer {self.key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if request.path != "/v1/chat/completions":
            return web.json_response({"error": {"message": "no such route"}}, status=404)
        body = await request.json()
        return web.json_response(_completion(body))


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")
    if schema is not None:  # a RULER judge call: score exactly the ids it names
        ids = schema["properties"]["scores"]["required"]
        scores = {
            sid: {"explanation": "ok", "score": 1.0 if i == 0 else 0.0} for i, sid in enumerate(ids)
        }
        content = json.dumps({"scores": scores})
        choices = [_choice(0, content)]
    else:
        # Distinct per model and per choice, so nothing is a tie that skips the judge.
        model = body.get("model", "m")
        choices = [_choice(i, f"{model} answer {i}") for i in range(int(body.get("n") or 1))]
    return {
        "id": "chatcmpl-stand-in",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "m"),
        "choices": choices,
        "prompt_token_ids": [5, 6, 7],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def _choice(index: int, content: str) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
        "token_ids": [1, 2 + index],
        "logprobs": {
            "content": [
                {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []},
                {"token": "b", "logprob": -0.2, "bytes": [98], "top_logprobs": []},
            ]
        },
    }


@contextmanager
def keyed_vllm(key: str) -> Iterator[KeyedVllm]:
    """Start a stand-in on a free port; stop it (and its thread) on exit."""
    stand_in = KeyedVllm(key=key)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", stand_in._dispatch)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    stand_in.url = f"http://127.0.0.1:{port}"
    try:
        yield stand_in
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

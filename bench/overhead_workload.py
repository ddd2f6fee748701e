"""The requests bench/proxy_overhead.py sends, and how a block of them is sent and summed up.

The same conversations go to the upstream directly as chat requests and through the proxy as
chat, Responses (stored or not) or Anthropic Messages requests; ``concurrency`` closed-loop
workers each send their next request as soon as the previous one is answered, and the client
times each from send to the last byte of the answer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import orjson

PROMPTS = [
    "Summarise the plot of Hamlet in two sentences.",
    "Write a haiku about a lighthouse in winter.",
    "What is the capital of Australia, and why not Sydney?",
    "Give me three tips for writing clear commit messages.",
    "Explain what a hash map is to a ten-year-old.",
    "Translate 'good morning, how are you?' into French.",
    "List four prime numbers larger than one hundred.",
    "Suggest a name for a bakery that only sells bread.",
]


MODES = (
    "json",
    "stream",
    "responses",
    "responses-stream",
    "responses-stored",
    "messages",
    "messages-stream",
)


def api_of(mode: str) -> str:
    """The API a mode's proxy path speaks: ``chat``, ``responses`` or ``messages``."""
    return mode.split("-")[0] if mode.startswith(("responses", "messages")) else "chat"


def route_of(mode: str) -> str:
    return {
        "chat": "/v1/chat/completions",
        "responses": "/v1/responses",
        "messages": "/v1/messages",
    }[api_of(mode)]


def make_bodies(model: str, n: int, max_tokens: int, mode: str) -> list[bytes]:
    """``n`` request bodies of ``mode``'s API (chat for ``json`` and ``stream``); in chat,
    ``ignore_eos`` makes vLLM produce exactly ``max_tokens`` each. The Responses bodies
    (``POST /v1/responses``, which the proxy translates to the chat request the direct path
    sends) are not stored but in ``responses-stored`` (``store: true``, OpenAI's default: the
    proxy saves each answer in Redis under the key's quota); the Messages bodies
    (``POST /v1/messages``) are Anthropic's."""
    stream = mode.endswith("stream")
    streaming = {"stream": True} if stream else {}
    system = "You are a helpful assistant. Answer briefly."
    api = api_of(mode)
    if api == "messages":
        return [
            orjson.dumps(
                {
                    "model": model,
                    "system": system,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    **streaming,
                }
            )
            for i in range(n)
        ]
    if api == "responses":
        return [
            orjson.dumps(
                {
                    "model": model,
                    "instructions": system,
                    "input": PROMPTS[i % len(PROMPTS)],
                    "max_output_tokens": max_tokens,
                    "temperature": 0.0,
                    "store": mode == "responses-stored",
                    **streaming,
                }
            )
            for i in range(n)
        ]
    return [
        orjson.dumps(
            {
                "model": model,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": PROMPTS[i % len(PROMPTS)]},
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                **streaming,
            }
        )
        for i in range(n)
    ]


@dataclass
class Block:
    latencies_s: list[float]
    wall_s: float
    errors: int


async def run_block(
    session: aiohttp.ClientSession, url: str, bodies: list[bytes], concurrency: int
) -> Block:
    """Send ``bodies`` from ``concurrency`` closed-loop workers; time each request."""
    pending = iter(bodies)
    latencies: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal errors
        for body in pending:
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            elapsed = time.perf_counter() - started
            if ok:
                latencies.append(elapsed)
            else:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Block(latencies, time.perf_counter() - started, errors)


@dataclass
class PathStats:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    rps: float
    n: int
    errors: int


def summarise(blocks: list[Block]) -> PathStats:
    latencies = [x for b in blocks for x in b.latencies_s]
    if len(latencies) < 2:
        raise RuntimeError("too few successful requests to summarise")
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    wall = sum(b.wall_s for b in blocks)
    return PathStats(
        p50_ms=cuts[49] * 1000,
        p99_ms=cuts[98] * 1000,
        mean_ms=statistics.fmean(latencies) * 1000,
        rps=len(latencies) / wall,
        n=len(latencies),
        errors=sum(b.errors for b in blocks),
    )


def rotation(paths: tuple[str, ...], rounds: int) -> Iterator[str]:
    """The paths in turn, forward then backward (A-B-B-A; A-B-C-C-B-A with a baseline), so slow
    drift of the machine (other load, CPU clocks) lands on every path alike."""
    for i in range(rounds):
        yield from paths if i % 2 == 0 else reversed(paths)

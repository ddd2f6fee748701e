"""The hot path of a generation request, one step each: authenticate, parse, route, call, relay,
record.

vLLM's answer is not parsed here: its bytes go back to the client as they come and, with the
request's bytes, down a pipe to the log worker (proxy/log/pipe.py), which makes the record.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.errors import ProxyError, internal_error
from proxy.http1 import UpstreamResponse
from proxy.log.worker import ExchangeMeta
from proxy.sse import without_usage_only
from proxy.state import ProxyState, read_json
from proxy.upstream import stream_dropped, upstream_error
from proxy.validation import check_alias, check_chat, check_completion, unknown_alias
from ratchet.registry import served_name

STICKY_HEADER = "x-ratchet-sticky-key"
VERSION_HEADER = "x-ratchet-version"


@dataclass(slots=True)
class Call:
    """One generation request on its way through: what the relay, the metrics and the log need."""

    meta: ExchangeMeta  # status, error and timings are filled in as the call goes
    body: bytes  # the request as the client sent it
    forwarded: bytes  # the request as vLLM gets it
    labels: tuple[str, str, str]  # alias, version, arm
    client_wants_usage: bool
    started: float  # perf_counter when the request arrived
    upstream_started: float = 0.0
    upstream_done: float | None = None  # None: upstream time runs until the call is recorded
    first_chunk_at: float | None = None  # streams only
    answer: bytes = b""  # a whole answer (not streamed)
    chunks: list[bytes] = field(default_factory=list)  # a stream, as vLLM sent it

    def fail(self, error: ProxyError) -> None:
        self.meta.status, self.meta.error = error.status, error.body()["error"]


async def generate(state: ProxyState, request: Request, endpoint: str) -> Response:
    """One generation request, step by step; see :func:`relay` for how it ends."""
    started, started_at = time.perf_counter(), time.time()
    key_hash = state.authenticate(request)
    payload, body = await read_json(request, state.settings.proxy.max_body_bytes)
    alias = parse(payload, endpoint)
    version, arm, served = route(state, request, payload, alias)
    stream = bool(payload.get("stream"))
    forwarded, client_wants_usage = forward(payload, served, stream)
    log_rate = state.log_rates.get(alias, 1.0)
    meta = ExchangeMeta(
        request_id=(request.headers.get("x-request-id") or uuid.uuid4().hex)[:128],
        endpoint=endpoint,
        alias=alias,
        served_name=served,
        version=version,
        canary_arm=arm,
        stream=stream,
        api_key_hash=key_hash,
        logged=log_rate >= 1.0 or random.random() < log_rate,
        started_at=started_at,
    )
    call = Call(meta, body, forwarded, (alias, str(version), arm), client_wants_usage, started)
    headers = {
        VERSION_HEADER: str(version),
        "x-request-id": meta.request_id,
        "x-ratchet-served-name": served,
        "x-ratchet-canary-arm": arm,
    }
    exchange = relay(state, call)
    try:
        await anext(exchange)  # raises the ProxyError of a refused or failed call
    except StopAsyncIteration:  # a whole answer: the call is over and recorded
        return Response(call.answer, media_type="application/json", headers=headers)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(exchange, media_type="text/event-stream", headers=headers)


def parse(payload: dict[str, Any], endpoint: str) -> str:
    """Check the body for what the proxy relies on; return the alias it names."""
    alias = check_alias(payload)
    (check_chat if endpoint == "chat.completions" else check_completion)(payload)
    return alias


def route(
    state: ProxyState, request: Request, payload: dict[str, Any], alias: str
) -> tuple[int, str, str]:
    """(version, canary arm, served name) from the cached routing table; 404 for an unknown
    alias. A sticky key (header, else ``user``) keeps a caller on one arm."""
    alias_route = state.routing.routes.get(alias)
    if alias_route is None:
        raise unknown_alias(alias)
    version, arm = alias_route.pick(request.headers.get(STICKY_HEADER) or payload.get("user"))
    return version, arm, served_name(alias, version, alias_route.base_model)


def forward(payload: dict[str, Any], served: str, stream: bool) -> tuple[bytes, bool]:
    """The body vLLM gets, and whether the client asked for the usage event of a stream.

    Usage is always asked of vLLM so the record has token counts; the relay leaves the usage
    event out again for clients that did not ask for it.
    """
    upstream_payload = dict(payload)
    upstream_payload["model"] = served
    client_wants_usage = False
    if stream:
        options = dict(payload.get("stream_options") or {})
        client_wants_usage = bool(options.get("include_usage"))
        options["include_usage"] = True
        upstream_payload["stream_options"] = options
    return orjson.dumps(upstream_payload), client_wants_usage


async def call_vllm(state: ProxyState, call: Call) -> UpstreamResponse | None:
    """Forward the request. A 200 stream is returned to be relayed; a whole answer (not streamed,
    or refused) is read here, left in ``call.answer`` or raised as a ProxyError."""
    call.upstream_started = time.perf_counter()
    response = await state.upstream.post(call.meta.endpoint, call.forwarded)
    if response.status == 200 and call.meta.stream:
        call.meta.status = 200
        return response
    answer = await state.upstream.read(response)
    call.upstream_done = time.perf_counter()
    if response.status != 200:
        raise upstream_error(response.status, answer, call.meta.served_name)
    call.meta.status, call.answer = 200, answer
    return None


async def relay(state: ProxyState, call: Call) -> AsyncIterator[bytes]:
    """Call vLLM and relay its answer: in flight from the call until the exchange is recorded.

    A whole answer yields nothing (it is in ``call.answer``). A stream yields ``b""`` once vLLM
    has answered 200, then its bytes as they come, kept in ``call.chunks``: whole events only,
    and without the usage event, for a client that did not ask for usage. A stream vLLM breaks
    off ends with an error event, as the client already has its 200. The relay loop is written
    out here rather than in a generator of its own: that would be one more hop per chunk.
    """
    state.metrics.in_flight.inc()
    response: UpstreamResponse | None = None
    try:
        response = await call_vllm(state, call)
        if response is None:
            return
        yield b""
        pending = b""
        try:
            async for chunk in response.iter_any():
                if call.first_chunk_at is None:
                    call.first_chunk_at = time.perf_counter()
                call.chunks.append(chunk)
                if call.client_wants_usage:
                    yield chunk
                    continue
                pending += chunk
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                ready, pending = pending[: cut + 2], pending[cut + 2 :]
                yield without_usage_only(ready)
            if pending:
                yield without_usage_only(pending)
        except Exception as exc:
            error = stream_dropped(exc)
            call.fail(error)
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n"
    except Exception as exc:
        call.fail(exc if isinstance(exc, ProxyError) else internal_error())
        raise
    finally:
        if response is not None:
            response.release()
        state.metrics.in_flight.dec()
        if call.meta.status:  # 0: the client left before vLLM answered; nothing to count
            record(state, call)


def record(state: ProxyState, call: Call) -> None:
    """Count the exchange in the metrics and hand it to the log worker, unparsed; for a stream
    cut short, what the client did receive is logged with the error."""
    now = time.perf_counter()
    total = now - call.started
    upstream = (call.upstream_done or now) - call.upstream_started
    meta, metrics = call.meta, state.metrics
    metrics.count_request(call.labels, meta.endpoint, meta.status)
    children = metrics.call(call.labels)
    children.latency.observe(total)
    children.upstream_latency.observe(upstream)
    children.added_latency.observe(max(0.0, total - upstream))
    if call.first_chunk_at is not None:
        ttft = call.first_chunk_at - call.started
        children.ttft.observe(ttft)
        meta.ttft_ms = round(ttft * 1000, 3)
    if meta.error is not None:
        metrics.errors.labels(str(meta.error.get("code"))).inc()
    meta.latency_ms = round(total * 1000, 3)
    answer = b"".join(call.chunks) if meta.stream else call.answer
    state.traffic_log.submit_exchange(orjson.dumps(meta), call.body, answer)

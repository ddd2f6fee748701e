"""The hot path of a generation request, one step each: authenticate, parse, route, call, relay,
record.

vLLM's answer is not parsed here: its bytes go back to the client as they come and, with the
request's bytes, down a pipe to the log worker (proxy/log/pipe.py), which makes the record.

What a client learns of the learning loop is limited. The request id of the record is the
proxy's own; the client's ``x-request-id`` is kept (cut to 128 characters) as a correlation
field and echoed back. An answer looks the same with or without a canary (audit N-2): unless
``proxy.expose_arm`` is on, no answer has an ``x-ratchet-canary-arm``, ``x-ratchet-version`` or
``x-ratchet-served-name`` header, and every answer's ``model`` is the alias, never the served
name, inside a canary or not (a version that appeared outside canaries and vanished inside one
told a client that one had started). Both arms take the same path through the relay, so the
proxy adds no difference in timing either. What served an answer is its record's: the
``x-request-id`` header and the answer's ``id`` name the traffic record, which holds the
version and arm, for an operator to look up. No stable per-version token is given instead:
any token that stays the same across answers of one version and changes with the version tells
a client that it was moved, which is what a canary does to one arm.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.answer_ids import upstream_request_id
from proxy.buckets import choice_events, prompt_estimate, reservation, total_tokens
from proxy.errors import ProxyError, internal_error
from proxy.http1 import UpstreamResponse
from proxy.log.worker import ExchangeMeta
from proxy.ratelimit import Admission
from proxy.sse import without_usage_only
from proxy.state import ProxyState, read_json
from proxy.stream_usage import DRAIN_S, StreamUsage, ask_continuous_usage
from proxy.upstream import stream_dropped, upstream_error
from proxy.validation import (
    RequestLimits,
    check_alias,
    check_chat,
    check_completion,
    check_limits,
    unknown_alias,
)
from ratchet.fleet import conversation_key
from ratchet.records import CLIENT_REQUEST_ID_MAX
from ratchet.registry import served_name

STICKY_HEADER = "x-ratchet-sticky-key"
VERSION_HEADER = "x-ratchet-version"
SERVED_NAME_HEADER = "x-ratchet-served-name"
ARM_HEADER = "x-ratchet-canary-arm"
# Chunks of a stream past proxy.max_answer_bytes still kept: enough for the usage event.
STREAM_TAIL_CHUNKS = 4


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
    streamed: int = 0  # bytes of the stream so far
    head: bytes = b""  # a stream's first chunk: its id names the completion, whatever is kept
    # (served, alias) names while the arm is concealed: the client is shown the alias instead.
    concealed: tuple[str, str] | None = None
    reserved: int = 0  # tokens reserved from the key's budgets (0: none are on)
    prompt_tokens: int = 0  # the prompt's tokens as estimated for the reservation
    dropped_events: int = 0  # choice events in the chunks of a stream no longer kept
    conversation: str | None = None  # its replica's key in a fleet (ratchet/fleet.py)
    # A budgeted stream's counts as vLLM sends them (proxy/stream_usage.py); None: not asked.
    usage: StreamUsage | None = None

    def fail(self, error: ProxyError) -> None:
        self.meta.status, self.meta.error = error.status, error.body()["error"]

    def keep(self, chunk: bytes, limit: int) -> None:
        """Keep a stream's chunk for the log. Past ``limit`` bytes (proxy.max_answer_bytes) only
        the last few chunks stay, for the usage event at the end: the exchange is then counted
        but not logged, and memory stays bounded however long the stream."""
        self.chunks.append(chunk)
        self.streamed += len(chunk)
        if self.streamed > limit:
            self.meta.logged = False
            for dropped in self.chunks[:-STREAM_TAIL_CHUNKS]:  # still charged for
                self.dropped_events += choice_events(dropped)
            del self.chunks[:-STREAM_TAIL_CHUNKS]

    def shown(self, events: bytes) -> bytes:
        """A whole answer or whole stream events as the client gets them: without the usage
        event it did not ask for (streams), nor the usage in every event that budgets asked for,
        and naming the alias while the arm is concealed."""
        if self.usage is not None:
            events = self.usage.feed(events)
        if self.meta.stream and not self.client_wants_usage:
            events = without_usage_only(events)
        for served, alias in self.renames:
            events = events.replace(served, alias)
        return events

    @property
    def renames(self) -> tuple[tuple[bytes, bytes], ...]:
        """What ``shown`` replaces while concealed: ``"model":"<served>"`` by the alias."""
        if self.concealed is None:
            return ()
        return model_renames(*self.concealed)


@functools.lru_cache(maxsize=1024)
def model_renames(served_name: str, alias: str) -> tuple[tuple[bytes, bytes], ...]:
    """``"model":"<served>"`` to ``"model":"<alias>"``, made once per version rather than per
    request (every answer is concealed unless proxy.expose_arm)."""
    served, alias_name = (b'"' + name.encode() + b'"' for name in (served_name, alias))
    # vLLM writes compact JSON; the spaced form is that of other servers.
    return tuple(
        (b'"model"' + colon + served, b'"model"' + colon + alias_name) for colon in (b":", b": ")
    )


@dataclass(slots=True)
class Arrival:
    """A request before its body is read: when it came, whose key, its rate-limit question."""

    started: float  # perf_counter
    started_at: float  # wall clock
    key_hash: str | None
    admission: Admission | None  # asked of Redis now, answered once the body is parsed


def arrive(state: ProxyState, request: Request) -> Arrival:
    started, started_at = time.perf_counter(), time.time()
    key_hash = state.authenticate_client(request)
    limiter = state.rate_limiter
    # With token budgets the body comes first: the request reserves what it may use.
    asked = limiter.ask(key_hash) if limiter.enabled and not limiter.token_limits else None
    return Arrival(started, started_at, key_hash, asked)


async def refused(state: ProxyState, arrival: Arrival) -> None:
    """A request refused before it was routed still takes one from its key's rate (429 first,
    as without budgets)."""
    if state.rate_limiter.token_limits:
        await state.rate_limiter.admit(arrival.key_hash)


async def generate(state: ProxyState, request: Request, endpoint: str) -> Response:
    """One generation request, step by step; see :func:`relay` for how it ends."""
    arrival = arrive(state, request)
    try:
        payload, body = await read_json(request, state.limits)
        alias = parse(payload, endpoint, state.limits)
        routed = route(state, request, payload, alias, arrival.key_hash)
    except Exception:  # a client's error or ours alike: refused before routing, and charged
        await refused(state, arrival)
        raise
    call, exchange, headers = await start_call(
        state, request, arrival, endpoint, payload, body, routed
    )
    try:
        await anext(exchange)  # raises the ProxyError of a refused or failed call
    except StopAsyncIteration:  # a whole answer: the call is over and recorded
        answer = call.answer if call.concealed is None else call.shown(call.answer)
        return Response(answer, media_type="application/json", headers=headers)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(exchange, media_type="text/event-stream", headers=headers)


async def start_call(
    state: ProxyState,
    request: Request,
    arrival: Arrival,
    endpoint: str,
    payload: dict[str, Any],
    body: bytes,
    routed: tuple[int, str, str, bool],
    client_api: str | None = None,
    client_wants_usage: bool | None = None,
) -> tuple[Call, AsyncIterator[bytes], dict[str, str]]:
    """A parsed, routed request admitted and sent: its Call, the relay (not started yet) and
    the response headers. ``client_api`` names the API the client called when the exchange was
    translated to ``endpoint`` (the Responses API); ``client_wants_usage`` overrides the body's
    ``stream_options`` for such a caller, which reads the usage event itself."""
    limiter = state.rate_limiter
    alias = payload["model"]
    version, arm, served, conceal = routed
    stream = bool(payload.get("stream"))
    budgeted_stream = stream and bool(limiter.token_limits)
    request_id = uuid.uuid4().hex  # ours, never the client's: group ids and sampling derive from it
    forwarded, wants_usage, usage = forward(payload, served, stream, budgeted_stream, request_id)
    if client_wants_usage is not None:
        wants_usage = client_wants_usage
    admission, reserved, prompt_tokens = arrival.admission, 0, 0
    if limiter.token_limits:
        prompt_tokens = prompt_estimate(body)
        reserved = reservation(payload, endpoint, state.limits, prompt_tokens)
        admission = limiter.ask(arrival.key_hash, reserved)
    if admission is not None:
        await limiter.settle(admission)  # 429 when a limit is reached
    log_rate = state.log_rates.get(alias, 1.0)
    client_request_id = request.headers.get("x-request-id")
    meta = ExchangeMeta(
        request_id=request_id,
        client_request_id=client_request_id[:CLIENT_REQUEST_ID_MAX] if client_request_id else None,
        endpoint=endpoint,
        alias=alias,
        served_name=served,
        version=version,
        canary_arm=arm,
        stream=stream,
        api_key_hash=arrival.key_hash,
        source=state.source(arrival.key_hash, payload),
        logged=log_rate >= 1.0 or random.random() < log_rate,
        started_at=arrival.started_at,
        client_api=client_api,
    )
    labels = (alias, str(version), arm)
    call = Call(meta, body, forwarded, labels, wants_usage, arrival.started, usage=usage)
    if reserved:  # settled when the exchange is recorded; kept whole if the client left first
        call.reserved, call.prompt_tokens = reserved, prompt_tokens
    if state.upstream.routes_by_conversation:
        call.conversation = conversation_key(payload)
    headers = {"x-request-id": meta.client_request_id or meta.request_id}
    if conceal:
        call.concealed = (served, alias)
    else:
        headers[VERSION_HEADER] = str(version)
        headers[SERVED_NAME_HEADER] = served
        headers[ARM_HEADER] = arm
    return call, relay(state, call), headers


def parse(payload: dict[str, Any], endpoint: str, limits: RequestLimits) -> str:
    """Check the body for what the proxy relies on and its limits; return the alias it names."""
    alias = check_alias(payload)
    (check_chat if endpoint == "chat.completions" else check_completion)(payload)
    check_limits(payload, endpoint, limits)
    return alias


def route(
    state: ProxyState, request: Request, payload: dict[str, Any], alias: str, key_hash: str | None
) -> tuple[int, str, str, bool]:
    """(version, canary arm, served name, whether to conceal what served it) from the cached
    routing table; 404 for an unknown alias. A sticky key (header, else ``user``) keeps a caller
    on one arm, drawn by a keyed hash of it and the caller's API key (ratchet/registry.py).
    Concealed unless ``proxy.expose_arm``: with or without a canary, so that nothing tells."""
    alias_route = state.routing.routes.get(alias)
    if alias_route is None:
        raise unknown_alias(alias)
    sticky = request.headers.get(STICKY_HEADER) or payload.get("user")
    version, arm = alias_route.pick(
        sticky if isinstance(sticky, str) else None, key_hash=key_hash, secret=state.secret
    )
    conceal = not state.settings.proxy.expose_arm
    return version, arm, served_name(alias, version, alias_route.base_model), conceal


def forward(
    payload: dict[str, Any],
    served: str,
    stream: bool,
    budgeted: bool = False,
    request_id: str | None = None,
) -> tuple[bytes, bool, StreamUsage | None]:
    """The body vLLM gets, whether the client asked for the usage event of a stream, and for a
    ``budgeted`` stream what reads vLLM's counts as it goes.

    Usage is always asked of vLLM so the record has token counts; the relay leaves the usage
    event out again for clients that did not ask for it. A stream under token budgets also asks
    for usage in every event (proxy/stream_usage.py), left out again unless the client asked.
    vLLM names the answer after ``request_id`` (the proxy's), with the client's own after it
    (proxy/answer_ids.py).
    """
    upstream_payload = dict(payload)
    upstream_payload["model"] = served
    if request_id is not None:
        upstream_payload["request_id"] = upstream_request_id(request_id, payload.get("request_id"))
    upstream_payload.pop("prompt_cache_key", None)  # the proxy's routing key, not vLLM's
    client_wants_usage, usage = False, None
    if stream:
        options = dict(payload.get("stream_options") or {})
        client_wants_usage = bool(options.get("include_usage"))
        if budgeted:
            usage = StreamUsage(shown=ask_continuous_usage(options))
        options["include_usage"] = True
        upstream_payload["stream_options"] = options
    return orjson.dumps(upstream_payload), client_wants_usage, usage


async def call_vllm(state: ProxyState, call: Call) -> UpstreamResponse | None:
    """Forward the request. A 200 stream is returned to be relayed; a whole answer (not streamed,
    or refused) is read here, left in ``call.answer`` or raised as a ProxyError."""
    call.upstream_started = time.perf_counter()
    response = await state.upstream.post(
        call.meta.endpoint, call.forwarded, call.meta.served_name, call.conversation
    )
    if response.status == 200 and call.meta.stream:
        call.meta.status = 200
        return response
    answer = await state.upstream.read(response, state.limits.max_answer_bytes)
    call.upstream_done = time.perf_counter()
    if response.status != 200:
        error = upstream_error(response.status, answer, call.meta.served_name)
        if call.concealed is not None:  # vLLM's message may name the version
            error.message = error.message.replace(*call.concealed)
        raise error
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
    pending, ended = b"", False
    try:
        response = await call_vllm(state, call)
        if response is None:
            return
        yield b""
        kept_limit = state.limits.max_answer_bytes
        whole = not (call.client_wants_usage and call.concealed is None and call.usage is None)
        try:
            async for chunk in response.iter_any():
                if call.first_chunk_at is None:
                    call.first_chunk_at = time.perf_counter()
                    call.head = chunk
                call.keep(chunk, kept_limit)
                if not whole:
                    yield chunk
                    continue
                pending += chunk
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                ready, pending = pending[: cut + 2], pending[cut + 2 :]
                yield call.shown(ready)
            if pending:
                pending, rest = b"", pending
                yield call.shown(rest)
        except Exception as exc:
            error = stream_dropped(exc)
            call.fail(error)
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n"
        ended = True
    except Exception as exc:
        call.fail(exc if isinstance(exc, ProxyError) else internal_error())
        raise
    finally:
        state.metrics.in_flight.dec()
        finish(state, call, response, pending if not ended else None)


def finish(
    state: ProxyState, call: Call, response: UpstreamResponse | None, left: bytes | None
) -> None:
    """Release vLLM's answer and record the exchange; ``left`` (not None: the client left the
    stream, with these bytes of an event it never got): a budgeted stream is read on first."""
    reads_on = call.usage is not None and call.usage.seen and not call.meta.error
    if response is not None and left is not None and reads_on:
        # The client left a budgeted stream vLLM counts as it goes: read on for what vLLM
        # generated, then charge that (a vLLM that sends no counts is charged its events).
        task = asyncio.get_running_loop().create_task(read_on(state, call, response, left))
        state.reading_on.add(task)  # finished by the app's shutdown, never dropped
        task.add_done_callback(state.reading_on.discard)
        return
    if response is not None:
        response.release()
    if call.meta.status:  # 0: the client left before vLLM answered; nothing to count
        record(state, call)


async def read_on(state: ProxyState, call: Call, response: UpstreamResponse, torn: bytes) -> None:
    """A budgeted stream the client left: read what vLLM sends for up to DRAIN_S, unrelayed,
    for its newest counts (proxy/stream_usage.py), then close it and record the exchange,
    charged what vLLM generated. ``torn``: the start of an event the client never got."""
    usage = call.usage
    assert usage is not None
    usage.read_on(torn)
    try:
        async with asyncio.timeout(DRAIN_S):
            async for chunk in response.iter_any():
                usage.read_on(chunk)
    except Exception:  # the deadline, or vLLM broke off: what was read counts
        pass
    finally:
        response.release()
        record(state, call)


def record(state: ProxyState, call: Call) -> None:
    """Count the exchange in the metrics and hand it to the log worker, unparsed; for a stream
    cut short, what the client did receive is logged with the error."""
    now = time.perf_counter()
    total = now - call.started
    upstream = (call.upstream_done or now) - call.upstream_started
    meta, metrics = call.meta, state.metrics
    metrics.count_request(call.labels, meta.client_api or meta.endpoint, meta.status)
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
    head = call.head if meta.stream else answer
    if head:  # who got it, so only that key may rate it (written later, off this path)
        state.completions.remember(head, meta.api_key_hash, meta.source)
    if call.reserved:
        state.rate_limiter.charge(meta.api_key_hash, call.reserved, tokens_used(call, answer))
    state.traffic_log.submit_exchange(orjson.dumps(meta), call.body, answer)


def tokens_used(call: Call, answer: bytes) -> int:
    """The tokens a budgeted request is charged: vLLM's counts when a stream gave them (the
    last, read on after the client left: proxy/stream_usage.py); vLLM's usage when the answer
    carries it; none
    when vLLM answered it with an error (read whole) or was never reached; for a stream cut
    short (the client left, vLLM broke off or ran past its deadline), its prompt as estimated
    and a token per choice event relayed; else (a 504, an answer too large to read: vLLM
    generated unseen) all it reserved."""
    if call.usage is not None and call.usage.seen:  # what vLLM said it generated
        return call.usage.generated
    used = total_tokens(answer)
    if used:
        return used
    error = call.meta.error
    if error is not None and (
        call.upstream_done is not None or error.get("code") == "upstream_unavailable"
    ):
        return 0
    if call.meta.stream:
        return call.prompt_tokens + call.dropped_events + choice_events(answer)
    return call.reserved

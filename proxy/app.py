"""The OpenAI-compatible proxy: aliases in, adapter versions out, every exchange logged.

Hot path of a generation request, and nothing more: check the key, read and check the body,
pick the version from the cached routing table, swap ``model`` for the served name, forward the
bytes to vLLM and stream the bytes back. The request and answer bytes then go, unparsed, down a
pipe to the log worker process (proxy/log/pipe.py), which makes the TrafficRecord and talks to
Kafka: logging never slows or fails a request.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.errors import ProxyError, bad_request, install_handlers
from proxy.log.pipe import TrafficLog
from proxy.log.worker import ExchangeMeta, WorkerConfig
from proxy.metrics import ProxyMetrics
from proxy.routing import RoutingCache
from proxy.upstream import Upstream, upstream_error
from proxy.validation import (
    check_alias,
    check_chat,
    check_completion,
    check_feedback,
    unknown_alias,
)
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, hash_api_key
from ratchet.registry import served_name
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

STICKY_HEADER = "x-ratchet-sticky-key"
VERSION_HEADER = "x-ratchet-version"


class ProxyState:
    """Everything the handlers share, built once per app from the settings."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self.metrics = ProxyMetrics()
        self.routing = RoutingCache(
            settings.redis_url, settings.aliases, settings.proxy.registry_refresh_s
        )
        self.upstream = Upstream(
            settings.vllm_url,
            settings.proxy.upstream_connect_timeout_s,
            settings.proxy.upstream_timeout_s,
        )
        worker = WorkerConfig(
            bootstrap=settings.kafka_bootstrap_servers,
            kafka=settings.kafka,
            # One spool per proxy address, so proxies sharing a state dir never share a file.
            spool_dir=settings.spool_dir / f"proxy-{settings.proxy.port}",
            topics=[TRAFFIC_TOPIC, FEEDBACK_TOPIC],
            queue_size=settings.proxy.log_queue_size,
            redact_patterns=settings.proxy.redact_patterns,
        )
        self.traffic_log = TrafficLog(
            worker,
            on_tokens=lambda *labels_n: self.metrics.tokens.labels(*labels_n[:4]).inc(labels_n[4]),
            on_state=lambda up: self.metrics.kafka_up.set(1 if up else 0),
        )
        keys = [k.get_secret_value() for k in settings.proxy.api_keys]
        if settings.proxy.admin_key:
            keys.append(settings.proxy.admin_key.get_secret_value())
        self.key_hashes = frozenset(hash_api_key(k) for k in keys)
        self.log_rates = {name: cfg.log_rate for name, cfg in settings.aliases.items()}
        self.metrics.watch_log(self.traffic_log, lambda: min(self.routing.age_s, 1e9))

    def authenticate(self, request: Request) -> str | None:
        """Return the hash of the caller's key; 401 when keys are required and this one isn't."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        key_hash = hash_api_key(key)
        if self.key_hashes and key_hash not in self.key_hashes:
            raise ProxyError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        return key_hash


async def read_json(request: Request, limit: int) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object, and its bytes as sent; 413 past `limit`, 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProxyError(
            413, f"request body is larger than {limit} bytes", code="request_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise ProxyError(
                413, f"request body is larger than {limit} bytes", code="request_too_large"
            )
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc.msg}", None, "invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    return payload, body


def create_app(settings: RatchetSettings) -> FastAPI:
    settings.check_proxy_exposure()
    state = ProxyState(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.traffic_log.start()
        await state.routing.start()
        await state.upstream.start(settings.proxy.upstream_health_interval_s)
        if not settings.auth_enabled:
            log.warning(
                "auth is off (no proxy.api_keys) - allowed because the proxy is bound to %s; "
                "set proxy.api_keys or RATCHET_PROXY__API_KEYS to require keys",
                settings.proxy.host,
            )
        yield
        await state.upstream.close()
        await state.routing.close()
        # The worker sends what it holds to Kafka, or to the disk spool if the broker is away.
        await state.traffic_log.close()

    app = FastAPI(title="Ratchet proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ratchet = state
    install_handlers(app)

    async def chat_completions(request: Request) -> Response:
        return await generate(state, request, "chat.completions")

    async def completions(request: Request) -> Response:
        return await generate(state, request, "completions")

    # The two hot routes are plain Starlette routes: they read the raw body themselves, so
    # FastAPI's dependency and body machinery would only add latency to every request.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        state.authenticate(request)
        return Response(
            orjson.dumps(
                {
                    "object": "list",
                    "data": [
                        _model_card(route)
                        for route in sorted(state.routing.routes.values(), key=lambda r: r.alias)
                    ],
                }
            ),
            media_type="application/json",
        )

    @app.get("/v1/models/{alias}")
    async def get_model(alias: str, request: Request) -> Response:
        state.authenticate(request)
        route = state.routing.routes.get(alias)
        if route is None:
            raise unknown_alias(alias)
        return Response(orjson.dumps(_model_card(route)), media_type="application/json")

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        key_hash = state.authenticate(request)
        payload, _ = await read_json(request, settings.proxy.max_body_bytes)
        completion_id, score, thumbs, comment = check_feedback(payload)
        record = FeedbackRecord(
            completion_id=completion_id,
            score=score,
            thumbs=thumbs,
            comment=comment,
            api_key_hash=key_hash,
        )
        if not state.traffic_log.submit(record, key=completion_id):
            raise ProxyError(
                503,
                "feedback queue is full; retry shortly",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return Response(
            orjson.dumps(
                {
                    "object": "feedback",
                    "completion_id": completion_id,
                    "score": score,
                    "status": "accepted",
                }
            ),
            media_type="application/json",
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        body = {
            "ready": state.upstream.ready,
            "vllm": state.upstream.ready,
            "kafka": state.traffic_log.connected,
            "registry": state.routing.connected,
            "registry_age_s": round(min(state.routing.age_s, 1e9), 3),
            "log_queue_depth": state.traffic_log.depth,
            "spooled": state.traffic_log.spooled,
        }
        return Response(
            orjson.dumps(body),
            status_code=200 if state.upstream.ready else 503,
            media_type="application/json",
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.upstream_up.set(1 if state.upstream.ready else 0)
        state.metrics.registry_up.set(1 if state.routing.connected else 0)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _model_card(route: Any) -> dict[str, Any]:
    return {
        "id": route.alias,
        "object": "model",
        "created": 0,
        "owned_by": "ratchet",
        "ratchet": {
            "active_version": route.active,
            "served_name": served_name(route.alias, route.active, route.base_model),
            "canary_version": route.canary,
            "canary_weight": route.canary_weight,
            "base_model": route.base_model,
        },
    }


@dataclass(slots=True)
class Call:
    """One generation request on its way through: what its metrics and its log entry need."""

    meta: ExchangeMeta  # completed by _finish, then written to the log worker as it is
    body: bytes  # as the client sent it
    labels: tuple[str, str, str]  # alias, version, arm
    started: float  # perf_counter


async def generate(state: ProxyState, request: Request, endpoint: str) -> Response:
    started, started_at = time.perf_counter(), time.time()
    key_hash = state.authenticate(request)
    payload, body = await read_json(request, state.settings.proxy.max_body_bytes)
    alias = check_alias(payload)
    (check_chat if endpoint == "chat.completions" else check_completion)(payload)
    route = state.routing.routes.get(alias)
    if route is None:
        raise unknown_alias(alias)
    sticky = request.headers.get(STICKY_HEADER) or payload.get("user")
    version, arm = route.pick(sticky)
    served = served_name(alias, version, route.base_model)
    stream = bool(payload.get("stream"))

    upstream_payload = dict(payload)
    upstream_payload["model"] = served
    client_wants_usage = False
    if stream:
        # Usage is always asked of vLLM so the record has token counts; the extra usage chunk
        # is removed again for clients that did not ask for it.
        options = dict(payload.get("stream_options") or {})
        client_wants_usage = bool(options.get("include_usage"))
        options["include_usage"] = True
        upstream_payload["stream_options"] = options

    request_id = (request.headers.get("x-request-id") or uuid.uuid4().hex)[:128]
    log_rate = state.log_rates.get(alias, 1.0)
    meta = ExchangeMeta(
        request_id=request_id,
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
    call = Call(meta=meta, body=body, labels=(alias, str(version), arm), started=started)
    headers = {
        VERSION_HEADER: str(version),
        "x-request-id": request_id,
        "x-ratchet-served-name": served,
        "x-ratchet-canary-arm": arm,
    }
    metrics = state.metrics
    metrics.in_flight.inc()
    upstream_started = time.perf_counter()
    try:
        resp = await state.upstream.post(endpoint, orjson.dumps(upstream_payload))
    except ProxyError as exc:
        metrics.in_flight.dec()
        _finish(state, call, exc.status, upstream_started, error=exc.body()["error"])
        raise

    if resp.status != 200 or not stream:
        try:
            answer = await resp.read()
        except (OSError, TimeoutError) as exc:  # dropped or stalled mid-body
            metrics.in_flight.dec()
            if isinstance(exc, TimeoutError):
                err = ProxyError(
                    504,
                    "the model server did not finish its answer in time",
                    type="server_error",
                    code="upstream_timeout",
                )
            else:
                err = ProxyError(
                    502,
                    f"the model server dropped the answer: {exc}",
                    type="server_error",
                    code="upstream_error",
                )
            _finish(state, call, err.status, upstream_started, error=err.body()["error"])
            raise err from None
        metrics.in_flight.dec()
        upstream_done = time.perf_counter()
        if resp.status != 200:
            err = upstream_error(resp.status, answer, served)
            _finish(
                state, call, err.status, upstream_started, upstream_done, error=err.body()["error"]
            )
            raise err
        _finish(state, call, 200, upstream_started, upstream_done, answer=answer)
        return Response(answer, media_type="application/json", headers=headers)

    async def relay() -> AsyncIterator[bytes]:
        chunks: list[bytes] = []
        first_at: float | None = None
        status = 200
        error: dict[str, Any] | None = None
        pending = b""
        try:
            async for chunk in resp.iter_any():
                if first_at is None:
                    first_at = time.perf_counter()
                chunks.append(chunk)
                if client_wants_usage:
                    yield chunk
                    continue
                # Forward whole SSE events so the usage-only one can be left out.
                pending += chunk
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                ready, pending = pending[: cut + 2], pending[cut + 2 :]
                yield _strip_usage_events(ready)
            if pending:
                yield _strip_usage_events(pending)
        except Exception as exc:  # vLLM died mid-stream: tell the client in-band, then end
            status = 502
            error = {
                "message": f"the model server dropped the stream: {exc}",
                "type": "server_error",
                "param": None,
                "code": "upstream_error",
            }
            yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
        finally:
            resp.release()
            metrics.in_flight.dec()
            ttft_ms = None
            if first_at is not None:
                metrics.call(call.labels).ttft.observe(first_at - started)
                ttft_ms = (first_at - started) * 1000
            # Also for a stream cut short: what the client did receive is logged with the error.
            _finish(
                state,
                call,
                status,
                upstream_started,
                error=error,
                answer=b"".join(chunks),
                ttft_ms=ttft_ms,
            )

    return StreamingResponse(
        relay(), media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
    )


def _strip_usage_events(block: bytes) -> bytes:
    if b'"choices":[]' not in block:
        return block
    events = block.split(b"\n\n")
    return b"\n\n".join(e for e in events if b'"choices":[]' not in e)


def _finish(
    state: ProxyState,
    call: Call,
    status: int,
    upstream_started: float,
    upstream_done: float | None = None,
    error: dict[str, Any] | None = None,
    answer: bytes = b"",
    ttft_ms: float | None = None,
) -> None:
    """Count the exchange in the metrics and hand it to the log worker, unparsed."""
    now = time.perf_counter()
    total = now - call.started
    upstream = (upstream_done or now) - upstream_started
    metrics = state.metrics
    metrics.count_request(call.labels, call.meta.endpoint, status)
    children = metrics.call(call.labels)
    children.latency.observe(total)
    children.upstream_latency.observe(upstream)
    children.added_latency.observe(max(0.0, total - upstream))
    if error is not None:
        metrics.errors.labels(str(error.get("code"))).inc()
    meta = call.meta
    meta.status, meta.error = status, error
    meta.latency_ms = round(total * 1000, 3)
    meta.ttft_ms = None if ttft_ms is None else round(ttft_ms, 3)
    state.traffic_log.submit_exchange(orjson.dumps(meta), call.body, answer)

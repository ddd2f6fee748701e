"""The OpenAI-compatible proxy: aliases in, adapter versions out, every exchange logged.

The generation routes are proxy/generation.py; the rest are small and live here.

Who may call what (keys are checked only when proxy.api_keys or proxy.admin_key is set; the
admin key is accepted wherever a client key is):

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
  ``POST /v1/responses/input_tokens``, ``GET /v1/models[/{alias}]``: a client key. ``GET``
  and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``: the key that made
  that response. A model card names the
  canary's version and weight only to the admin key (or with ``proxy.expose_arm``): a client
  that knew a canary was running could tell the arms apart and rate only one.
- ``POST /v1/feedback``, the one state a client changes (a rating of its own completion): the
  key that got the completion.
- ``GET /metrics``: the admin key when ``proxy.metrics_auth`` is on, which it is by default
  unless the proxy listens on loopback only (it counts requests per version and canary arm).
- ``GET /healthz``, ``GET /readyz`` (probes): nothing.

Anything else that changes state (routing, promotion, adapters) is not a route of the proxy;
one added later must call :meth:`ProxyState.require_admin`. There are no trailing-slash
redirects, no ``/docs`` and no ``/openapi.json``: an unknown path is a 404 envelope.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.errors import install_handler
from proxy.feedback import rate
from proxy.generation import generate
from proxy.inflight import InFlightBound
from proxy.messages_route import create_message
from proxy.responses_route import (
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from proxy.responses_tokens import count_input_tokens
from proxy.state import ProxyState
from proxy.validation import unknown_alias
from ratchet.registry import AliasRoute, served_name
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)


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
        if settings.proxy.metrics_need_admin_key and settings.proxy.admin_key is None:
            log.warning(
                "/metrics is refused to everyone: proxy.host %s is not loopback and "
                "proxy.admin_key is not set; set proxy.admin_key (Prometheus sends it as a "
                "bearer token), or proxy.metrics_auth: false to serve it to anyone who reaches "
                "the port",
                settings.proxy.host,
            )
        yield
        # Streams read on after their clients left: recorded and charged before what they
        # use (vLLM's connections, the limiter, the log pipe) closes.
        await state.finish_reading_on()
        await state.upstream.close()
        await state.routing.close()
        await state.rate_limiter.close()  # sends the token charges still pending
        await state.completions.close()  # writes the completion owners still pending
        await state.redis.aclose()  # the routing table's and the stored responses'
        # The worker sends what it holds to Kafka, or to the disk spool if the broker is away.
        await state.traffic_log.close()

    app = FastAPI(
        title="Ratchet proxy",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # A redirect would point at the client's own Host header; a 404 envelope says more.
        redirect_slashes=False,
    )
    app.state.ratchet = state
    install_handler(app)
    _add_in_flight_bound(app, state)
    _add_generation_routes(app, state)
    _add_model_routes(app, state)
    _add_feedback_route(app, state)
    _add_health_routes(app, state)
    return app


def _add_in_flight_bound(app: FastAPI, state: ProxyState) -> None:
    """Per key and replica: requests in flight and their bodies' memory (proxy/inflight.py)."""
    proxy = state.settings.proxy
    refused = state.metrics.ratelimit_refused
    app.add_middleware(
        InFlightBound,
        max_in_flight=proxy.rate_limit.max_in_flight,
        max_parse_bytes=proxy.rate_limit.max_parse_bytes,
        replica_max_parse_bytes=proxy.rate_limit.replica_max_parse_bytes,
        max_body_bytes=proxy.max_body_bytes,
        max_json_items=proxy.max_json_items,
        auth=bool(state.key_hashes),
        on_refused=lambda bound: refused.labels(bound).inc(),
    )


def _add_generation_routes(app: FastAPI, state: ProxyState) -> None:
    async def chat_completions(request: Request) -> Response:
        return await generate(state, request, "chat.completions")

    async def completions(request: Request) -> Response:
        return await generate(state, request, "completions")

    # Plain Starlette routes: they read the raw body themselves, so FastAPI's dependency and
    # body machinery would only add latency to every request.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    async def responses(request: Request) -> Response:
        return await create_response(state, request)

    async def stored_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return await delete_response(state, request, response_id)
        return await get_response(state, request, response_id)

    app.add_route("/v1/responses", responses, methods=["POST"])

    async def input_tokens(request: Request) -> Response:
        return await count_input_tokens(state, request)

    # Before the stored response's route, whose path it also matches.
    app.add_route("/v1/responses/input_tokens", input_tokens, methods=["POST"])
    app.add_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])

    async def input_items(request: Request) -> Response:
        return await list_input_items(state, request, request.path_params["response_id"])

    app.add_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])

    async def messages(request: Request) -> Response:  # the Anthropic Messages API
        return await create_message(state, request)

    app.add_route("/v1/messages", messages, methods=["POST"])


def _add_model_routes(app: FastAPI, state: ProxyState) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        detail = _shows_canary(state, request)
        routes = sorted(state.routing.routes.values(), key=lambda r: r.alias)
        body = {"object": "list", "data": [_model_card(route, detail) for route in routes]}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/v1/models/{alias}")
    async def get_model(alias: str, request: Request) -> Response:
        detail = _shows_canary(state, request)
        route = state.routing.routes.get(alias)
        if route is None:
            raise unknown_alias(alias)
        return Response(orjson.dumps(_model_card(route, detail)), media_type="application/json")


def _shows_canary(state: ProxyState, request: Request) -> bool:
    """Authenticates the caller; whether its model cards may name the canary."""
    key_hash = state.authenticate(request)
    admin = state.admin_key_hash is not None and key_hash == state.admin_key_hash
    return admin or state.settings.proxy.expose_arm


def _model_card(route: AliasRoute, canary: bool) -> dict[str, Any]:
    """The alias as an OpenAI model; with ``canary``, also its canary's version and weight."""
    card: dict[str, Any] = {
        "id": route.alias,
        "object": "model",
        "created": 0,
        "owned_by": "ratchet",
        "ratchet": {
            "active_version": route.active,
            "served_name": served_name(route.alias, route.active, route.base_model),
            "base_model": route.base_model,
        },
    }
    if canary:
        card["ratchet"] |= {"canary_version": route.canary, "canary_weight": route.canary_weight}
    return card


def _add_feedback_route(app: FastAPI, state: ProxyState) -> None:
    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        # Once per completion, only from the key that got it (proxy/completions.py).
        return await rate(state, state.completions, request)


def _add_health_routes(app: FastAPI, state: ProxyState) -> None:
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
            # Served from anyway; stale or invalid means routing changes are not arriving.
            "registry_stale": state.routing.stale,
            "routing_invalid": sorted(state.routing.invalid.now),
            "log_queue_depth": state.traffic_log.depth,
            "spooled": state.traffic_log.spooled,
        }
        return Response(
            orjson.dumps(body),
            status_code=200 if state.upstream.ready else 503,
            media_type="application/json",
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if state.settings.proxy.metrics_need_admin_key:
            state.require_admin(request)
        state.metrics.upstream_up.set(1 if state.upstream.ready else 0)
        state.metrics.show_endpoints(
            {url: (e.outstanding, e.healthy) for url, e in state.upstream.endpoints.items()}
        )
        state.metrics.registry_up.set(1 if state.routing.connected else 0)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

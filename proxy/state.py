"""What every proxy handler shares, and the two steps every request starts with: authenticate
the caller, parse the body."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import redis.asyncio as aioredis
from fastapi import Request

from proxy.completions import CompletionOwners, owner_ttl_s
from proxy.errors import ProxyError, bad_request
from proxy.fleet_metrics import FleetFaults
from proxy.log.pipe import TrafficLog
from proxy.log.worker import WorkerConfig
from proxy.metrics import ProxyMetrics
from proxy.ratelimit import RateLimiter
from proxy.response_store import ResponseStore
from proxy.routing import ExcludedReplicas, RoutingCache
from proxy.upstream import Upstream, fault_policy
from proxy.validation import RequestLimits, check_depth, json_too_deep
from ratchet.records import ANONYMOUS_CLIENT, DEADLETTER_TOPIC, FEEDBACK_TOPIC, TRAFFIC_TOPIC
from ratchet.secrets import (
    client_source,
    hash_api_key,
    redis_connection_url,
    server_secret,
    vllm_api_key,
)
from ratchet.settings import RatchetSettings


def shared_redis(redis_url: str) -> aioredis.Redis:
    """The proxy's redis.asyncio client, shared by the routing table and the stored responses.
    Two others stay apart: the completion owners' (proxy/completions.py), whose 1 s timeout and
    no retry keep a rating's answer fast while Redis is away, and the rate limiter's RESP client
    (proxy/ratelimit.py), pipelined by hand on the request path."""
    return aioredis.Redis.from_url(
        redis_url, socket_timeout=2, socket_connect_timeout=1, health_check_interval=5
    )


class ProxyState:
    """Everything the handlers share, built once per app from the settings."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self.metrics = ProxyMetrics()
        # Derived once: with the embedded Redis's password it reads the secret and hashes.
        redis_url = redis_connection_url(settings)
        self.redis = shared_redis(redis_url)  # closed by the app, after what uses it
        self.routing = RoutingCache(self.redis, settings.aliases, settings.proxy.registry_refresh_s)
        self.upstream = Upstream(
            settings.vllm_endpoints or settings.vllm_url,
            settings.proxy.upstream_connect_timeout_s,
            settings.proxy.upstream_timeout_s,
            vllm_api_key(settings),
            resolve=bool(settings.vllm_endpoints),
            balance=settings.proxy.balance,
            faults=fault_policy(settings.proxy),
        )
        worker = WorkerConfig(
            bootstrap=settings.kafka_bootstrap_servers,
            kafka=settings.kafka,
            # One spool per proxy address, so proxies sharing a state dir never share a file.
            spool_dir=settings.spool_dir / f"proxy-{settings.proxy.port}",
            topics=[TRAFFIC_TOPIC, FEEDBACK_TOPIC, DEADLETTER_TOPIC],
            queue_size=settings.proxy.log_queue_size,
            max_record_bytes=settings.proxy.max_record_bytes,
            spool_max_bytes=settings.proxy.spool_max_bytes,
            redact_patterns=settings.proxy.redact_patterns,
            redact_budget_s=settings.proxy.redact_budget_s,
            stuck_after_s=settings.proxy.log_worker_stuck_s,
        )
        self.traffic_log = TrafficLog(
            worker,
            on_tokens=lambda *labels_n: self.metrics.tokens.labels(*labels_n[:4]).inc(labels_n[4]),
            on_state=lambda up: self.metrics.kafka_up.set(1 if up else 0),
            max_bytes=settings.proxy.log_queue_bytes,
        )
        # Keys the key hashes and the canary draw: what a client cannot compute.
        self.secret = server_secret(settings)
        keys = [k.get_secret_value() for k in settings.proxy.api_keys]
        admin_key = settings.proxy.admin_key
        self.admin_key_hash = hash_api_key(
            self.secret, admin_key.get_secret_value() if admin_key else None
        )
        self.key_hashes = frozenset(hash_api_key(self.secret, k) for k in keys)
        if self.admin_key_hash is not None:
            self.key_hashes |= {self.admin_key_hash}
        self.vouching_key_hashes = frozenset(
            hash_api_key(self.secret, k.get_secret_value())
            for k in settings.proxy.user_vouching_keys
        )
        self.limits = RequestLimits.from_settings(settings.proxy, settings.aliases)
        self.upstream.on_model_context = self.limits.set_model_context
        self.upstream.on_choice = self.metrics.count_endpoint_request
        self.metrics.registry.register(FleetFaults(self.upstream))
        # The choice of replica never sends a version to a replica out of its rotation.
        self.upstream.exclusions = self.routing.exclusions
        self.metrics.registry.register(ExcludedReplicas(self.routing))
        # Per key only when keys are required: without auth a client could invent one per request.
        self.rate_limiter = RateLimiter(
            settings.proxy.rate_limit,
            redis_url,
            self.metrics,
            bool(self.key_hashes),
        )
        self.log_rates = {name: cfg.log_rate for name, cfg in settings.aliases.items()}
        # Who got each completion, so only that key may rate it, once (proxy/completions.py).
        self.completions = CompletionOwners(redis_url, self.metrics.registry, owner_ttl_s(settings))
        self.responses = ResponseStore(self.redis, self.metrics.registry, settings.proxy)
        self.metrics.watch_log(self.traffic_log, self.routing)
        # Streams their clients left, read on for vLLM's counts (proxy/generation.py read_on):
        # held here so the app's shutdown finishes them, recording and charging each.
        self.reading_on: set[asyncio.Task[None]] = set()

    async def finish_reading_on(self) -> None:
        """Wait for the streams read on after their clients left (each ends within
        proxy/stream_usage.py's DRAIN_S, then records its exchange)."""
        while self.reading_on:
            await asyncio.gather(*self.reading_on, return_exceptions=True)

    def authenticate(self, request: Request) -> str | None:
        """Return the hash of the caller's key; 401 when keys are required and this one isn't.
        The key is the bearer token, or else ``x-api-key`` (how Anthropic's clients send it)."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        if key is None:
            key = request.headers.get("x-api-key") or None
        key_hash = hash_api_key(self.secret, key)  # one HMAC; the configured keys' are made once
        if self.key_hashes and key_hash not in self.key_hashes:
            raise ProxyError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        return key_hash

    def authenticate_client(self, request: Request) -> str | None:
        """:meth:`authenticate` for the routes that answer and rate (what the loop learns from):
        403 for the admin key, which reads and steers the proxy and is no client (audit L-6)."""
        key_hash = self.authenticate(request)
        if key_hash is not None and key_hash == self.admin_key_hash:
            raise ProxyError(
                403,
                "the admin key (proxy.admin_key) is for admin routes; send a client key "
                "(proxy.api_keys) to generate or rate",
                type="permission_error",
                code="admin_key_not_a_client_key",
            )
        return key_hash

    def source(self, key_hash: str | None, payload: dict[str, Any]) -> str | None:
        """The client a request counts as (ratchet.secrets.client_source): its key, or, for a
        key in proxy.user_vouching_keys, that key and the body's `user`. Without auth, every
        request is one client (ANONYMOUS_CLIENT): a bearer token nobody checks is no identity,
        and a client could send a new one with each rating to escape the caps."""
        if not self.key_hashes:
            return ANONYMOUS_CLIENT
        user = payload.get("user")
        vouched = key_hash in self.vouching_key_hashes and isinstance(user, str) and bool(user)
        return client_source(self.secret, key_hash, user if vouched else None)

    def require_admin(self, request: Request) -> None:
        """For routes that need proxy.admin_key: 401 without a valid key, 403 for a client key."""
        key_hash = self.authenticate(request)
        if self.admin_key_hash is not None and key_hash == self.admin_key_hash:
            return
        if key_hash is None or key_hash not in self.key_hashes:
            raise ProxyError(
                401,
                "this route needs the admin key; send 'Authorization: Bearer <admin key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        raise ProxyError(
            403,
            "this route needs the admin key (proxy.admin_key), not a client key",
            type="permission_error",
            code="admin_key_required",
        )


async def read_json(request: Request, limits: RequestLimits) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object, and its bytes as sent: 415 unless sent as application/json,
    413 past proxy.max_body_bytes, 400 if not a JSON object, nested deeper than
    proxy.max_json_depth or holding more than proxy.max_json_items values.

    The 415 is what keeps web pages out of a keyless proxy on loopback: a page may POST
    text/plain, a form or an untyped body to any address without asking (a CORS "simple"
    request), never application/json. Every OpenAI client sends it.

    A body that arrives too slowly is cut off by the server (proxy/connection.py), not here: a
    deadline here would cost a timer on every request, most of whose bodies came with their
    headers.
    """
    headers = request.headers
    if not _is_json(headers.get("content-type")):
        raise _not_json(headers.get("content-type"))
    limit = limits.max_body_bytes
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth" in exc.msg:  # orjson's own limit (1024 levels), far past ours
            raise json_too_deep(limits.max_json_depth) from None
        raise bad_request(
            f"request body is not valid JSON: {exc.msg}", None, "invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    check_depth(payload, limits.max_json_depth, limits.max_json_items)
    return payload, body


def _is_json(content_type: str | None) -> bool:
    """application/json, any case, with or without parameters (``; charset=utf-8``)."""
    if content_type is None:
        return False
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _not_json(content_type: str | None) -> ProxyError:
    sent = "no Content-Type" if content_type is None else f"Content-Type {content_type[:64]!r}"
    return ProxyError(
        415,
        f"the request body must be JSON sent with 'Content-Type: application/json' ({sent} "
        "was sent)",
        param="content-type",
        code="unsupported_media_type",
    )


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"request body is larger than proxy.max_body_bytes ({limit} bytes)",
        code="request_too_large",
    )

"""What every proxy handler shares, and the two steps every request starts with: authenticate
the caller, parse the body."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

from proxy.errors import ProxyError, bad_request
from proxy.log.pipe import TrafficLog
from proxy.log.worker import WorkerConfig
from proxy.metrics import ProxyMetrics
from proxy.routing import RoutingCache
from proxy.upstream import Upstream
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, hash_api_key
from ratchet.settings import RatchetSettings


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
        raise bad_request(
            f"request body is not valid JSON: {exc.msg}", None, "invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    return payload, body


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body is larger than {limit} bytes", code="request_too_large")

"""vLLM as the proxy sees it: forwarded calls, readiness, and its failures as ProxyErrors.

Only the paths in FORWARDED_PATHS (and /health) are ever called: vLLM's adapter admin routes
share its port and must stay unreachable through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from proxy.errors import ProxyError
from proxy.http1 import UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

# The whole list of upstream paths the proxy ever calls.
FORWARDED_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}


class Upstream:
    """vLLM as the proxy sees it: forwarded calls, readiness, and errors as ProxyErrors."""

    def __init__(self, base_url: str, connect_timeout_s: float, total_timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.pool = UpstreamPool(base_url, connect_timeout_s, total_timeout_s)
        self.ready = False
        self._health_task: asyncio.Task[None] | None = None

    async def start(self, health_interval_s: float) -> None:
        await self.check_health()
        self._health_task = asyncio.create_task(self._watch(health_interval_s), name="vllm-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        self.pool.close()

    async def check_health(self) -> bool:
        try:
            response = await self.pool.request(b"GET", "/health", timeout_s=2.0)
            await response.read()
            self.ready = response.status == 200
        except (OSError, TimeoutError):  # UpstreamClosed is an OSError
            self.ready = False
        return self.ready

    async def _watch(self, interval_s: float) -> None:
        while True:
            was_ready = self.ready
            self.pool.prune()
            await self.check_health()
            if was_ready != self.ready:
                log.warning("vLLM at %s is %s", self.base_url, "up" if self.ready else "DOWN")
            await asyncio.sleep(interval_s if self.ready else min(interval_s, 0.5))

    async def post(self, endpoint: str, body: bytes) -> UpstreamResponse:
        """POST to vLLM; a refused or broken connection is a 503, no answer in time a 504."""
        try:
            return await self.pool.request(b"POST", FORWARDED_PATHS[endpoint], body)
        except TimeoutError:
            raise ProxyError(
                504,
                "the model server did not answer in time",
                type="server_error",
                code="upstream_timeout",
            ) from None
        except OSError as exc:
            raise self._unavailable(exc) from None

    @staticmethod
    async def read(response: UpstreamResponse) -> bytes:
        """The whole answer; a connection dropped mid-body is a 502, a stalled one a 504."""
        try:
            return await response.read()
        except TimeoutError:
            raise ProxyError(
                504,
                "the model server did not finish its answer in time",
                type="server_error",
                code="upstream_timeout",
            ) from None
        except OSError as exc:
            raise ProxyError(
                502,
                f"the model server dropped the answer: {exc}",
                type="server_error",
                code="upstream_error",
            ) from None

    def _unavailable(self, exc: Exception) -> ProxyError:
        self.ready = False
        log.warning("vLLM unreachable: %s", exc)
        return ProxyError(
            503,
            "the model server is unavailable; retry shortly",
            type="server_error",
            code="upstream_unavailable",
            headers={"Retry-After": "1"},
        )


def stream_dropped(exc: BaseException) -> ProxyError:
    """vLLM broke off a stream whose 200 the client already has: told in-band, as an event."""
    return ProxyError(
        502,
        f"the model server dropped the stream: {exc}",
        type="server_error",
        code="upstream_error",
    )


def upstream_error(status: int, body: bytes, served_name: str) -> ProxyError:
    """Re-shape a vLLM error answer into our envelope with a fitting status."""
    message, param = f"the model server answered {status}", None
    try:
        data: Any = orjson.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            param = err.get("param") if isinstance(err.get("param"), str) else None
    except orjson.JSONDecodeError:
        pass
    if status == 404:
        # The route exists, so a 404 means vLLM could not find or load the adapter we chose.
        return ProxyError(
            502,
            f"the model server could not load {served_name}: {message}",
            type="server_error",
            code="adapter_unavailable",
        )
    if 400 <= status < 500:
        return ProxyError(status, message, param=param, code="upstream_rejected")
    return ProxyError(
        502, f"the model server failed: {message}", type="server_error", code="upstream_error"
    )

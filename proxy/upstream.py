"""Talking to vLLM: one pooled aiohttp session, error mapping, and a health watcher.

aiohttp rather than httpx because the proxy's added latency is the product: aiohttp's client costs
a fraction of httpx's per request (see bench/proxy_overhead.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
import orjson

from proxy.errors import ProxyError

log = logging.getLogger(__name__)

# vLLM's adapter admin routes share its inference port; the proxy forwards none of them. This
# is the whole list of upstream paths the proxy ever calls.
FORWARDED_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}


class Upstream:
    def __init__(self, base_url: str, connect_timeout_s: float, total_timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=total_timeout_s, sock_connect=connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.ready = False
        self._health_task: asyncio.Task[None] | None = None

    async def start(self, health_interval_s: float) -> None:
        self.session = aiohttp.ClientSession(
            # vLLM's uvicorn drops idle connections after 5 s; let ours go first.
            connector=aiohttp.TCPConnector(limit=1024, ttl_dns_cache=300, keepalive_timeout=4),
            timeout=self.timeout,
            json_serialize=lambda o: orjson.dumps(o).decode(),
            skip_auto_headers=("User-Agent",),
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._watch(health_interval_s), name="vllm-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session:
            await self.session.close()

    async def check_health(self) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(
                self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                self.ready = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.ready = False
        return self.ready

    async def _watch(self, interval_s: float) -> None:
        while True:
            was_ready = self.ready
            await self.check_health()
            if was_ready != self.ready:
                log.warning("vLLM at %s is %s", self.base_url, "up" if self.ready else "DOWN")
            await asyncio.sleep(interval_s if self.ready else min(interval_s, 0.5))

    async def post(self, endpoint: str, body: bytes) -> aiohttp.ClientResponse:
        """POST to vLLM; connection failures become 503/504 ProxyErrors.

        A request that fails on a pooled connection vLLM already closed (it restarted) is sent
        once more on a fresh one: nothing reached vLLM, so repeating it is safe.
        """
        assert self.session is not None
        url = self.base_url + FORWARDED_PATHS[endpoint]
        for attempt in (1, 2):
            try:
                return await self.session.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2 or isinstance(exc, aiohttp.ClientConnectorError):
                    raise self._unavailable(exc) from None
            except aiohttp.ClientConnectorError as exc:
                raise self._unavailable(exc) from None
            except TimeoutError:
                raise ProxyError(
                    504,
                    "the model server did not answer in time",
                    type="server_error",
                    code="upstream_timeout",
                ) from None
            except aiohttp.ClientError as exc:
                raise self._unavailable(exc) from None
        raise AssertionError("unreachable")

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

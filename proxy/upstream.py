"""vLLM as the proxy sees it: forwarded calls, readiness, and its failures as ProxyErrors.

Only the paths in FORWARDED_PATHS, /health and ``GET /v1/models`` (once, for the model's context
length) are ever called: vLLM's adapter admin routes share its port and must stay unreachable
through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson

from proxy.errors import ProxyError
from proxy.http1 import AnswerTooLarge, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

# /v1/models is small; more than this is not vLLM's answer.
MODELS_ANSWER_MAX = 1 << 20
# The whole list of upstream paths the proxy forwards to.
FORWARDED_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}


class Upstream:
    """vLLM as the proxy sees it: forwarded calls, readiness, and errors as ProxyErrors."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float,
        total_timeout_s: float,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # vLLM's key on every call; the client's own key never reaches vLLM.
        self.pool = UpstreamPool(base_url, connect_timeout_s, total_timeout_s, api_key)
        self.ready = False
        # vLLM's max_model_len, read from /v1/models once it answers; told to this listener.
        self.model_context: int | None = None
        self.on_model_context: Callable[[int], None] | None = None
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
        if self.ready and self.model_context is None:
            await self._read_model_context()
        return self.ready

    async def _read_model_context(self) -> None:
        """The longest max_model_len vLLM lists (a LoRA adapter has its base model's), for the
        default max_tokens limit; left unknown if the answer has none, and asked again later."""
        try:
            response = await self.pool.request(b"GET", "/v1/models", timeout_s=2.0)
            answer = await response.read(MODELS_ANSWER_MAX)
            if response.status != 200:
                return
            models = orjson.loads(answer).get("data") or []
            lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)]
            context = max((n for n in lengths if isinstance(n, int) and n > 0), default=None)
        except (OSError, TimeoutError, AnswerTooLarge, orjson.JSONDecodeError, AttributeError):
            return
        if context is not None:
            self.model_context = context
            log.info("vLLM's context length is %d tokens", context)
            if self.on_model_context is not None:
                self.on_model_context(context)

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
    async def read(response: UpstreamResponse, max_bytes: int | None = None) -> bytes:
        """The whole answer; a connection dropped mid-body is a 502, a stalled one a 504, and one
        longer than ``max_bytes`` (proxy.max_answer_bytes) a 400: the client asked for it."""
        try:
            return await response.read(max_bytes)
        except AnswerTooLarge:
            raise ProxyError(
                400,
                f"the answer is larger than proxy.max_answer_bytes ({max_bytes} bytes); "
                "lower max_tokens or n, or stream it (stream: true)",
                param="max_tokens",
                code="answer_too_large",
            ) from None
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
    """vLLM broke off a stream whose 200 the client already has: told in-band, as an event.
    A stream that outlived proxy.upstream_timeout_s is a timeout, as a whole answer's is (504
    upstream_timeout): a client provokes it at will, with a long max_tokens or by reading
    slowly, so the canary does not count it against the version (learner/canary.py)."""
    if isinstance(exc, TimeoutError):
        return ProxyError(
            504,
            "the stream did not finish within proxy.upstream_timeout_s",
            type="server_error",
            code="upstream_timeout",
        )
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
    if status in (401, 403):
        # vLLM refused the proxy's own key (vllm_api_key): a server fault, never the client's.
        log.error("vLLM refused the proxy's key (%d): check vllm_api_key / RATCHET_SECRET", status)
        return ProxyError(
            502,
            "the model server refused the proxy's credentials",
            type="server_error",
            code="upstream_auth",
        )
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

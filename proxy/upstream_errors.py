"""vLLM's failures as the client's errors: a stream broken off or gone silent, an error answer
re-shaped into our envelope (proxy/upstream.py's, apart to keep that module short)."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from proxy.errors import ProxyError
from proxy.stall import Stalled

log = logging.getLogger("proxy.upstream")


def stream_dropped(exc: BaseException) -> ProxyError:
    """vLLM broke off a stream whose 200 the client already has: told in-band, as an event.
    A stream that outlived proxy.upstream_timeout_s is a timeout, as a whole answer's is (504
    upstream_timeout): a client provokes it at will, with a long max_tokens or by reading
    slowly, so the canary does not count it against the version (learner/canary.py). One
    vLLM went silent in, its probe too, is the replica's fault: 504 upstream_stalled."""
    if isinstance(exc, Stalled):
        return body_stalled(exc)
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


def body_stalled(exc: Stalled) -> ProxyError:
    return ProxyError(
        504, f"{exc} mid-answer (its engine stalled)", type="server_error", code="upstream_stalled"
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

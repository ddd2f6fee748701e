"""vLLM middleware: every route needs vLLM's API key, except the health and metrics probes.

vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) guards only paths under /v1, /v2, /inference and
/cohere. With runtime LoRA updating on, which the filesystem resolver needs, vLLM 0.32 also
mounts SageMaker's adapter routes, ``POST /adapters`` (load an adapter from any path the server
can read) and ``DELETE /adapters/{name}``, beside /invocations, /tokenize, /scale_elastic_ep and
more: none under those prefixes, so none behind the key. This middleware puts every path behind
it; only OPEN_PATHS (probes, Prometheus) stay open. vLLM loads it with
``--middleware <module>.RequireApiKey`` and builds it with no arguments, so the key comes from
the same variable vLLM reads, VLLM_API_KEY, and a missing key stops vLLM at start (fail closed).

Standard library only, on purpose: the chart mounts this same file (helm/ratchet/files/
ratchet_vllm_guard.py, kept identical by a test) into the upstream vLLM image, which has no
Ratchet installed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_VARIABLE = "VLLM_API_KEY"
# Kubernetes probes and Prometheus ask these without a key; both only read.
OPEN_PATHS = frozenset({"/health", "/metrics"})
_REFUSAL = json.dumps(
    {
        "error": {
            "message": "missing or invalid API key; send 'Authorization: Bearer <key>'",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()
# 1008: policy violation, the WebSocket close code for a refused handshake.
_WEBSOCKET_POLICY_VIOLATION = 1008


class RequireApiKey:
    """Pure ASGI: a request without ``Authorization: Bearer <VLLM_API_KEY>`` gets a 401."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(KEY_VARIABLE, "").strip()
        if not key:
            raise RuntimeError(
                f"{KEY_VARIABLE} is not set: vLLM would serve every route without a key"
            )
        self.app = app
        # Compared as digests, in constant time: the length of the key leaks nothing either.
        self._key_digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
                return hmac.compare_digest(digest, self._key_digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            # Closing before accepting refuses the handshake (the server answers 403).
            await send({"type": "websocket.close", "code": _WEBSOCKET_POLICY_VIOLATION})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_REFUSAL)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _REFUSAL})

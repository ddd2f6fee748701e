"""What stands between the network and the console's routes.

- :class:`Guard` (ASGI): a ``Host`` allow-list, so a page whose name rebinds to the console's
  address (DNS rebinding) gets 400 and reads nothing; the body read whole before any route or
  auth check, at most :data:`MAX_BODY_BYTES` within :data:`BODY_TIMEOUT_S` (413, 408); and
  headers that keep pages out of frames and caches; and the answer to a wrong admin key held
  back for the delay console/auth.py left on the request's state (:data:`WRONG_KEY_DELAY`) or
  its turn in the console's one bucket of wrong keys, whichever is later (console/wrong_keys.py:
  many guessers in parallel answered as slowly as one), at most ``wrong_keys.QUEUE`` at a time,
  so that held answers never take the connection slots an admin needs (past it a wrong key is
  answered 429 with Retry-After; it was checked, so no right one waits).
- :class:`ConsoleProtocol` (uvicorn's h11 protocol): a request's head must arrive within
  :data:`HEAD_TIMEOUT_S` of the connection or of the previous answer, else the connection is
  closed; uvicorn's own timer stops at the first byte, so a trickled head held it forever.
  Heads are capped by h11 (``h11_max_incomplete_event_size``), connections and requests in
  flight by ``limit_concurrency`` (console/service.py).

The probes (``/healthz``, ``/metrics``) skip the Host check: kubelet and Prometheus send the pod's
address, and neither shows users' data.

Why not Starlette's ``TrustedHostMiddleware``: it has no exemption for the probes, no rule for
loopback addresses as a class, reads the first of two Host headers, and answers text/plain. Why a
subclass of uvicorn's h11 protocol: no public uvicorn option bounds how long a head may take (its
cost per request: docs/results/benchmarks.md, "HTTP protocols").
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from console.wrong_keys import WrongKeys

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 16 * 1024  # the largest form is a reason of 200 characters
BODY_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 16 * 1024
WRONG_KEY_DELAY = "wrong_key_delay"  # the request state's entry: seconds to hold the answer
PROBES = frozenset({"/healthz", "/metrics"})
LOOPBACK_NAMES = frozenset({"localhost"})
PAGE_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]
NO_STORE = (b"cache-control", b"no-store")  # pages show users' prompts: no cache keeps them


class BodyTooLarge(Exception):
    pass


def host_allowed(host_header: str, allowed: list[str]) -> bool:
    """The Host names a loopback address or name, or one of ``allowed`` ("*" any,
    "*.example.com" its subdomains)."""
    try:
        name = urlsplit("//" + host_header).hostname
    except ValueError:
        return False
    if not name:
        return False
    name = name.rstrip(".")
    if name in LOOPBACK_NAMES or _loopback_ip(name):
        return True
    for pattern in allowed:
        pattern = pattern.rstrip(".")
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def _loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.wrong_keys = WrongKeys()  # answers to wrong keys, paced and held back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        # One Host, allowed: with two, the check and the app could each read another.
        hosts = [value.decode("latin-1") for name, value in scope["headers"] if name == b"host"]
        allowed = len(hosts) == 1 and host_allowed(hosts[0], self.allowed_hosts)
        if path not in PROBES and not allowed:
            await refuse(send, 400, "this console is not served under that Host name", "bad_host")
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
            await refuse(
                send, 413, f"a request body is at most {MAX_BODY_BYTES} bytes", "too_large"
            )
            return
        try:
            body = await asyncio.wait_for(read_body(receive), BODY_TIMEOUT_S)
        except BodyTooLarge:
            await refuse(
                send, 413, f"a request body is at most {MAX_BODY_BYTES} bytes", "too_large"
            )
            return
        except TimeoutError:
            await refuse(send, 408, "the request body came too slowly", "timeout")
            return
        state = scope.setdefault("state", {})  # request.state's storage, shared with routes
        sending = self.held_back(send, path, state)
        await self.app(scope, replay(body, receive), sending)

    def held_back(self, send: Send, path: str, state: dict[str, Any]) -> Send:
        """``send`` with the page headers, holding a wrong key's answer back by the delay the
        route left in ``state`` or its turn (console/wrong_keys.py); past the queue the route's
        answer is replaced by a 429."""
        paged = with_headers(send, path)
        replaced = False

        async def sending(message: Message) -> None:
            nonlocal replaced
            if replaced:
                return  # the route's answer, after the 429 that replaced it
            if message["type"] == "http.response.start" and WRONG_KEY_DELAY in state:
                hold_s = self.wrong_keys.turn(float(state.pop(WRONG_KEY_DELAY)))
                if hold_s is None:
                    replaced = True
                    await too_many_wrong_keys(send, self.wrong_keys.retry_after_s())
                    return
                await self.wrong_keys.wait(hold_s)
            await paged(message)

        return sending


async def read_body(receive: Receive) -> bytes:
    """The whole body, refused past MAX_BODY_BYTES (a chunked one has no Content-Length)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the route sees it too
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def again() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # what comes after the body: a disconnect
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


def with_headers(send: Send, path: str) -> Send:
    extra = PAGE_HEADERS if path.startswith("/static/") else [*PAGE_HEADERS, NO_STORE]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return sending


async def too_many_wrong_keys(send: Send, retry_after_s: int) -> None:
    await refuse(
        send,
        429,
        "too many wrong admin keys are being answered; retry after the time given",
        "too_many_wrong_keys",
        ((b"retry-after", str(retry_after_s).encode()),),
    )


async def refuse(
    send: Send, status: int, message: str, code: str, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """The error envelope, and the connection closed (its unread body is not waited for)."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *PAGE_HEADERS,
        NO_STORE,
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ConsoleProtocol(H11Protocol):
    """h11 with a deadline on each request's head (see the module docstring)."""

    head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        self.head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_overdue)

    def _head_overdue(self) -> None:
        # IDLE: no whole request head since the deadline was armed (a request being answered,
        # or whose body is coming, is past it: the body has its own deadline in Guard).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

"""Per-key bounds on what one key's requests hold in a replica at once (security audit M-2): how
many are in flight (429 past ``proxy.rate_limit.max_in_flight``) and how much memory their bodies
take parsed (413 past ``proxy.rate_limit.max_parse_bytes``); and the same memory for every key
together (503 with retry-after past ``proxy.rate_limit.replica_max_parse_bytes``), since keys
each within their bound could still take a replica past its memory limit together.

A request is charged when it arrives, from its declared ``Content-Length`` and before any byte of
its body is read (a body without one is charged as ``proxy.max_body_bytes``), and the charge is
given back in one ``finally`` when its answer is done, a stream's last byte included. What a body
costs parsed, :func:`parse_charge`, is an upper bound measured on the proxy itself
(bench/parse_memory.py): the bytes as sent and as forwarded, plus the parsed tree, which costs up
to about 22 bytes of RSS per byte of body (tiny values: ``{}``, ``"a"``) and, with at most
``proxy.max_json_items`` values, no more than :data:`PARSED_BYTES_PER_ITEM` each (an object of
that many distinct keys: each key is a string of its own and a slot in the object's table).

Which key: the bearer token (else ``x-api-key``) as sent when the proxy checks keys (a wrong one
is refused before its body is read, so it holds nothing for long); without keys every request is
one client, as in :meth:`proxy.state.ProxyState.source`. The bounds are per replica, as memory
is: nothing in Redis.

Why an ASGI middleware: it sees a request before any route reads its body, and its end after the
route's answer has been sent whole, in one place for every route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.errors import ProxyError, response_for

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_COPIES = 2  # the body as the client sent it and as vLLM gets it (and the log's view of both)
PARSE_AMPLIFICATION = 24  # RSS per body byte of a tree of the tiniest values: 22 for [{},{},...]
PARSED_BYTES_PER_ITEM = 200  # RSS per value in an object of distinct keys (187), the costliest
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def parse_charge(body_bytes: int, max_json_items: int) -> int:
    """The most RSS a request with a body of ``body_bytes`` can hold while in flight."""
    parsed = min(body_bytes * PARSE_AMPLIFICATION, max_json_items * PARSED_BYTES_PER_ITEM)
    return body_bytes * BODY_COPIES + parsed


class KeyLoad:
    """What one key's requests hold now."""

    __slots__ = ("parse_bytes", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.parse_bytes = 0


class InFlightBound:
    """The middleware; ``auth``: whether the proxy checks keys (else one client)."""

    def __init__(
        self,
        app: ASGIApp,
        max_in_flight: int,
        max_parse_bytes: int,
        max_body_bytes: int,
        max_json_items: int,
        auth: bool,
        on_refused: Callable[[str], None] = lambda bound: None,
        replica_max_parse_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.max_parse_bytes = max_parse_bytes
        self.replica_max_parse_bytes = replica_max_parse_bytes or 1 << 62
        self.all = KeyLoad()  # every key's requests together
        self.max_body_bytes = max_body_bytes
        self.max_json_items = max_json_items
        self.auth = auth
        self.on_refused = on_refused
        self.loads: dict[bytes, KeyLoad] = {}  # by the Authorization header as sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        key, declared = b"", None
        for name, value in scope["headers"]:  # one pass, on every request: kept lean
            if name == b"authorization":
                key = value
            elif name == b"x-api-key" and not key:  # the key as Anthropic's clients send it
                key = b"x-api-key " + value
            elif name == b"content-length":
                declared = value
        if not self.auth:
            key = b""
        charge = self.charge_of(scope["method"], declared)
        load = self.loads.get(key)
        if load is None:
            load = self.loads[key] = KeyLoad()
        refusal = self.refused(load, charge)
        if refusal is not None:
            if not load.requests:
                del self.loads[key]
            await response_for(scope["path"], refusal)(scope, receive, send)
            return
        everyone = self.all
        load.requests += 1
        load.parse_bytes += charge
        everyone.requests += 1
        everyone.parse_bytes += charge
        try:
            await self.app(scope, receive, send)
        finally:
            load.requests -= 1
            load.parse_bytes -= charge
            everyone.requests -= 1
            everyone.parse_bytes -= charge
            if not load.requests:
                del self.loads[key]

    def charge_of(self, method: str, declared: bytes | None) -> int:
        if method in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return 0  # no body read (one sent is never parsed)
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is None:  # chunked: the most it may be
            size = self.max_body_bytes
        elif size > self.max_body_bytes:  # refused 413 before it is read
            size = 0
        return parse_charge(size, self.max_json_items)

    def refused(self, load: KeyLoad, charge: int) -> ProxyError | None:
        """The refusal (counted) of a request past one of the bounds; None: let it in."""
        if load.requests >= self.max_in_flight:
            return self.refusal(load, charge)
        # A key with nothing in flight is always let in: max_body_bytes is the one bound on a
        # single body, so a max_parse_bytes below one body's charge refuses no lone request;
        # nor is a replica with nothing in flight. Nor is a request without a body refused
        # for memory it does not take.
        if not charge:
            return None
        if load.requests and load.parse_bytes + charge > self.max_parse_bytes:
            return self.refusal(load, charge)
        everyone = self.all
        if everyone.requests and everyone.parse_bytes + charge > self.replica_max_parse_bytes:
            return self.busy(everyone)
        return None

    def refusal(self, load: KeyLoad, charge: int) -> ProxyError:
        """The 429 or 413 for a request past one of the key's bounds, counted."""
        if load.requests >= self.max_in_flight:
            self.on_refused("max_in_flight")
            return ProxyError(
                429,
                f"this key already has {load.requests} in flight on this replica, the most "
                "proxy.rate_limit.max_in_flight allows; send more when some are answered",
                type="rate_limit_error",
                code="too_many_requests_in_flight",
                headers={"retry-after": "1"},  # in-flight requests end; no bucket to refill
            )
        self.on_refused("max_parse_bytes")
        held = load.parse_bytes // 2**20
        return ProxyError(
            413,
            f"this key's requests in flight hold up to {held} MiB parsed on this replica; "
            f"this body would pass proxy.rate_limit.max_parse_bytes "
            f"({self.max_parse_bytes // 2**20} MiB): send it when some are answered, or "
            "send smaller bodies",
            code="parse_memory_exceeded",
        )

    def busy(self, everyone: KeyLoad) -> ProxyError:
        """The 503 for a request past the replica's bound, every key together, counted: not
        this client's doing, so a server error to retry (elsewhere, or soon), not a 4xx."""
        self.on_refused("replica_max_parse_bytes")
        return ProxyError(
            503,
            f"this replica's requests in flight hold up to {everyone.parse_bytes // 2**20} MiB "
            f"parsed; this body would pass proxy.rate_limit.replica_max_parse_bytes "
            f"({self.replica_max_parse_bytes // 2**20} MiB): retry shortly",
            type="server_error",
            code="replica_parse_memory_exceeded",
            headers={"retry-after": "1"},  # requests in flight end within seconds
        )

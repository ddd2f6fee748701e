"""The proxy's HTTP/1.1 connections: uvicorn's httptools protocol plus the limits it lacks.

What uvicorn (httptools) does on its own, and what this subclass changes:

- An idle keep-alive connection is closed after ``timeout_keep_alive`` (proxy.keepalive_timeout_s),
  but that timer starts only after a response, and any byte cancels it. So a connection that never
  sends anything, sends half a request line, or sends headers a byte at a time, is held forever.
  Here the request line and headers must be complete within proxy.header_timeout_s of the
  connection (first request) or of the read that began them (later ones); else 408, or a plain
  close when nothing at all was sent.
- llhttp has no limit on the size of the request line and headers: past proxy.max_header_bytes,
  431 (measured on the bytes read while the head is incomplete, and on the parsed head when one
  read could hold more than the limit).
- Nothing bounds how long a body takes. From the end of the headers, the whole body must arrive
  within proxy.body_timeout_s: else 408 if no answer was started, and the connection ends in any
  case (that also bounds a body the app never read, e.g. after a 401 or 413, which uvicorn would
  otherwise read and discard for as long as the client sends it).
- Parser errors (a malformed request line, header, or body framing) get uvicorn's text/plain 400;
  here the OpenAI envelope. The 503 of ``limit_concurrency`` (proxy.max_concurrency) too.
- Keyless (no proxy.api_keys nor admin_key, so on loopback only), a request whose ``Host`` is not a
  loopback name or address gets 421: a web page that rebinds its own DNS name to 127.0.0.1 sends
  its name as Host, and would otherwise read and write the local proxy (DNS rebinding). A request
  with no Host at all is served: no browser sends one.
- uvicorn wrote that 400 at once and closed, even when requests pipelined before the bad bytes
  (in the same read) were still being answered: the client read the 400 as the answer to its
  valid request, and the late answer failed with a traceback (a log flood at will). Here every
  refusal waits for the answers to the requests before it: answers go out in request order.
- A client that stops reading its answer made uvicorn wait on it for good (flow control), holding
  the stream and its upstream call: when nothing could be written for proxy.body_timeout_s, the
  connection is closed.

Deadlines cost a timer only when a read leaves a head or body incomplete: a request that comes
whole in one read, the usual case, costs none. Every answer written here ends the connection:
our side once the answers to earlier requests are written, then what the client still sends is
dropped for up to LINGER_S, so that it reads the answer rather than a reset. Not answered with
the envelope: an idle connection with no byte sent (closed, as after a keep-alive timeout), a
connection the kernel refuses (listen backlog full), and TLS errors (TLS ends in front of the
proxy).

Why a subclass of uvicorn's internals (hence uvicorn's upper pin in pyproject.toml): no public
uvicorn option sets a deadline on a request's head or body, nor a head size with httptools. h11
has that one (``h11_max_incomplete_event_size``), but no deadlines either, and costs more per
request than httptools; the subclass's own cost is within noise (both figures:
docs/results/benchmarks.md, "HTTP protocols").
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any, ClassVar

import orjson
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.errors import ProxyError
from ratchet.settings import ProxySettings


def error_response(error: ProxyError, extra_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response carrying the envelope, ending the connection."""
    body = orjson.dumps(error.body())
    head = [STATUS_LINE[error.status]]
    for name, value in extra_headers:
        head += [name, b": ", value, b"\r\n"]
    for header, text in (error.headers or {}).items():
        head += [header.lower().encode(), b": ", text.encode(), b"\r\n"]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


OVERLOADED = ProxyError(
    503,
    "the proxy is at its limit of connections and requests in progress (proxy.max_concurrency); "
    "retry shortly",
    type="server_error",
    code="overloaded",
    headers={"Retry-After": "1"},
)


async def _overloaded(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """uvicorn's ``service_unavailable``, with the envelope."""
    body = orjson.dumps(OVERLOADED.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# After a refusal, what the client still sends is read and dropped for up to this long before the
# connection closes: closing with unread bytes would make the kernel send a reset, and a client
# still sending would then lose the answer instead of reading it.
LINGER_S = 2.0


class Refused(Exception):
    """Raised from a parser callback to stop parsing a request already refused (431, 421)."""


# Host values (port stripped) always on this machine: the usual ones, matched without parsing.
LOOPBACK_HOSTS = frozenset({b"localhost", b"127.0.0.1", b"[::1]"})


def is_loopback_host(host: bytes) -> bool:
    """Whether a Host header names this machine: localhost (or a name under .localhost, which
    browsers never resolve through DNS), or a loopback address, with or without a port."""
    name = host.lower()
    # "[v6]" or "[v6]:port" keeps its brackets; "name:port" loses its port.
    bracketed = name.startswith(b"[")
    name = name[: name.find(b"]") + 1] if bracketed else name.partition(b":")[0]
    if name in LOOPBACK_HOSTS or name.endswith(b".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip(b"[]").decode("ascii")).is_loopback
    except (UnicodeDecodeError, ValueError):
        return False


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One client connection; the class attributes come from :func:`guarded_protocol`."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    max_header_bytes: ClassVar[int] = 32 * 1024
    loopback_hosts_only: ClassVar[bool] = False  # keyless: refuse other Host values (rebinding)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # the next bytes belong to a request line or headers
        self._head_started = False  # and some of them have come
        self._completed = 0  # requests received whole on this connection
        self._head_bytes = 0  # of the request being read, in reads before the current one
        self._read_size = 0  # of the current read
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False  # we answered ourselves: the rest of the connection is discarded
        self._refusal: bytes | None = None  # that answer, while earlier answers are still going
        self._running: Any = None  # the cycle whose app was started last

    # ---- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, then arm a deadline only for what is still incomplete: a request
        that came whole in one read (the usual case) costs no timer."""
        if self._refused or self.transport.is_closing():
            return  # answered and closing: what comes now is dropped
        if self._awaiting_head:
            self._head_started = True
        completed_before = self._completed
        self._read_size = len(data)
        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        if self._awaiting_head:
            # A read in which no request ended holds only head bytes. One in which a pipelined
            # request ended is not counted (it holds that request too): the bound is then
            # max_header_bytes plus one read.
            if self._completed == completed_before:
                self._head_bytes += len(data)
            elif self.cycle is not None and self.scope is not self.cycle.scope:
                self._head_started = True  # the next request began right after that one
            if self._head_bytes > self.max_header_bytes:
                self._refuse_large_head()
            elif self._head_started and self._head_timer is None:
                self._arm_head_timer()
        elif self._body_timer is None and self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(
                self.body_timeout_s, self._body_timed_out, self.cycle
            )

    # ---- llhttp callbacks ---------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._cancel(self._head_timer)
        self._head_timer = None
        if self._head_bytes + self._read_size > self.max_header_bytes and self._head_size() > (
            self.max_header_bytes
        ):
            self._refuse_large_head()
            # Stops the parser: uvicorn then calls send_400_response, which sees the refusal
            # and writes nothing more.
            raise Refused
        if self.loopback_hosts_only and not self._host_is_loopback():
            self._refuse(
                421,
                "this proxy runs without keys and only answers requests addressed to this "
                "machine (Host: localhost, 127.0.0.1 or [::1]); to serve other names, set "
                "proxy.api_keys",
                "misdirected_request",
            )
            raise Refused
        super().on_headers_complete()

    def _host_is_loopback(self) -> bool:
        for name, value in self.headers:
            if name == b"host":
                return is_loopback_host(value)
        return True  # no Host: not a browser, so no rebinding

    def _head_size(self) -> int:
        """The request line and headers as parsed (only measured when the reads could hold more
        than max_header_bytes of them)."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._completed += 1
        self._awaiting_head, self._head_started, self._head_bytes = True, False, 0
        self._cancel(self._body_timer)
        self._body_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.body_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._write_timer)
        self._write_timer = None

    def _write_timed_out(self) -> None:
        # The client read nothing of its answer for body_timeout_s: the stream it holds ends.
        self._write_timer = None
        self.transport.close()

    # ---- uvicorn's own answers ----------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refuse(
            400,
            "malformed HTTP request: the request line, a header or the body framing could not "
            "be parsed",
            "invalid_http",
        )

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, _overloaded if app is service_unavailable else app)

    def on_response_complete(self) -> None:
        # Starts the next pipelined request, if any; a refusal waiting for this answer goes next.
        super().on_response_complete()
        if self._refusal is not None and not self._answers_pending():
            self._send_refusal()

    def _unsupported_upgrade_warning(self) -> None:
        # An Upgrade header (h2c, websocket) is served as a plain request: no warning per request,
        # which a client could use to flood the log.
        pass

    # ---- deadlines ----------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing() or not self._awaiting_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The next request's head came early (pipelining) while an answer is still going:
            # it cannot be answered before that one; look again later.
            self._arm_head_timer()
            return
        if not self._head_started:
            self.transport.close()  # nothing was sent: closed without a word
            return
        self._refuse(
            408,
            "the request line and headers did not arrive within proxy.header_timeout_s "
            f"({self.header_timeout_s:g} s)",
            "request_timeout",
        )

    def _body_timed_out(self, cycle: Any) -> None:
        self._body_timer = None
        if self._refused or self.transport.is_closing():
            return
        if cycle is not self.cycle or not cycle.more_body:
            return
        if cycle.response_complete:
            self._end()  # answered without reading the body: stop reading it
            return
        if cycle.response_started:
            self.transport.close()
            return
        # The app may be waiting for the body: it now reads a disconnect, and what it sends
        # after this goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(
            408,
            f"the request body did not arrive within proxy.body_timeout_s "
            f"({self.body_timeout_s:g} s)",
            "request_timeout",
        )

    def _refuse_large_head(self) -> None:
        self._refuse(
            431,
            "the request line and headers are larger than proxy.max_header_bytes "
            f"({self.max_header_bytes} bytes)",
            "headers_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer with the envelope and end the connection: our side (FIN) once the requests
        before the refused one are answered, the rest after LINGER_S or when the client closes
        its side, whichever comes first. What the client sends from now on is dropped."""
        error = ProxyError(status, message, code=code)
        self._refused = True
        self._refusal = error_response(error, self.server_state.default_headers)
        for timer in (self._head_timer, self._body_timer):
            self._cancel(timer)  # the write timer stays: earlier answers may still be going
        self._head_timer = self._body_timer = None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            # The refused request is this one (its body broke or came too slowly): its app, if
            # started, now reads a disconnect and what it sends goes nowhere; if queued behind
            # an earlier request, it never starts.
            cycle.disconnected = True
            cycle.message_event.set()
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()
            elif cycle.response_started:
                self.transport.close()  # its answer is cut short: no room for ours
                return
        if not self._answers_pending():
            self._send_refusal()
        # else on_response_complete sends it after the last earlier answer

    def _answers_pending(self) -> bool:
        """Whether a request before the refused one is still to be answered (queued, or its
        app running)."""
        running = self._running
        return bool(self.pipeline) or (
            running is not None and not running.response_complete and not running.disconnected
        )

    def _send_refusal(self) -> None:
        refusal, self._refusal = self._refusal, None
        if refusal is None or self.transport.is_closing():
            return
        self.transport.write(refusal)
        self._end()

    def _end(self) -> None:
        self._refused = True
        self._cancel_timers()
        self._unset_keepalive_if_required()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()  # keep draining what the client sends
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            self._cancel(timer)
        self._head_timer = self._body_timer = self._write_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def guarded_protocol(proxy: ProxySettings) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn builds each connection from, with these settings' limits."""
    return type(
        "ProxyHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "header_timeout_s": proxy.header_timeout_s,
            "body_timeout_s": proxy.body_timeout_s,
            "max_header_bytes": proxy.max_header_bytes,
            # Keyless means loopback-only (proxy/server.py refuses anything else).
            "loopback_hosts_only": not proxy.api_keys and proxy.admin_key is None,
        },
    )

"""A small pooled HTTP/1.1 client for the one upstream the proxy talks to (vLLM).

The proxy's added latency is the product, and the client was most of it: aiohttp's request
machinery (request and response objects, header multidicts, tracing, timers) cost about 0.15 ms
of Python per call on the bench machine, against 0.05 ms for the whole round trip here. The proxy
needs little of it: one upstream, POST with a JSON body or GET, a status, the body whole or as it
arrives. So this is an asyncio protocol with llhttp (httptools, which uvicorn also parses with)
and a LIFO pool of keep-alive connections; llhttp undoes chunked transfer encoding.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools

# vLLM's uvicorn drops idle connections after 5 s; ours go first.
KEEPALIVE_S = 4.0
# Past this much unread answer, stop reading from the socket until the relay catches up.
READ_HIGH_WATER = 1 << 20


class UpstreamClosed(ConnectionError):
    """The connection ended before the answer did."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # False: nothing came back, so the request may be sent again


class ConnectFailed(ConnectionError):
    """No connection was made (refused, unreachable, or not within the connect timeout): the
    request never left, so it is safe to send elsewhere."""


class AnswerTooLarge(Exception):
    """The answer was longer than the reader allowed; the connection is closed, not reused."""


class UpstreamResponse:
    """One answer: ``status`` at once, the body with :meth:`read` or :meth:`iter_any`, then
    :meth:`release` (after ``read`` it is released already)."""

    def __init__(self, connection: _Connection, deadline: float) -> None:
        self.status = 0
        self._connection = connection
        self._deadline = deadline
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        # Called once, when released: the upstream's count of requests in flight on its replica.
        self.on_release: Callable[[], None] | None = None

    # ---- fed by the connection ----
    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > READ_HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._complete:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- read by the proxy ----
    @property
    def complete(self) -> bool:
        """The whole body arrived."""
        return self._complete and self._error is None

    @property
    def broken(self) -> bool:
        """The server broke the answer off (not the reader leaving, nor a deadline)."""
        return self._error is not None

    @property
    def awaited(self) -> asyncio.Future[None] | None:
        """The reader's pending wait for more body, with nothing left to read (None: it has
        bytes to read, or is elsewhere, such as writing to a client who reads slowly):
        proxy/stall.py tells vLLM's silence from the proxy's by it, with no timer per chunk."""
        waiter = self._waiter
        return None if waiter is None or waiter.done() else waiter

    def abort(self, error: BaseException) -> None:
        """End the body with ``error``, raised to its reader (proxy/stall.py: vLLM went
        silent); the connection is then closed, not reused."""
        self._fail(error)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        timeout = self._deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError
        async with asyncio.timeout(timeout):
            await self._waiter

    @property
    def begun(self) -> bool:
        """The body's first byte (or its end) is in: :meth:`first_byte` has nothing to wait
        for (a whole answer's body comes with its headers)."""
        return bool(self._chunks) or self._complete or self._error is not None

    async def first_byte(self, timeout_s: float | None = None) -> bool:
        """Whether the body's first byte (or its end) came within ``timeout_s`` (None: by the
        answer's own deadline): a stream's headers come at once, so a stalled engine shows
        only here."""
        if self.begun:
            return True
        if timeout_s is None:
            timeout_s = max(0.0, self._deadline - time.monotonic())
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._waiter
        except TimeoutError:
            return False
        return True

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in whatever pieces the socket gives."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered <= READ_HIGH_WATER // 2:
                    self._connection.resume()
                yield chunk
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; AnswerTooLarge as soon as it passes ``max_bytes``."""
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in self.iter_any():
                parts.append(chunk)
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise AnswerTooLarge(f"more than {max_bytes} bytes")
        finally:
            self.release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Give the connection back to the pool when the answer was read whole, else close it."""
        if self._released:
            return
        self._released = True
        self._connection.finish_response(reusable=self._complete and self._error is None)
        if self.on_release is not None:
            self.on_release()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; llhttp parses what comes back."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.headers_done: asyncio.Future[None] | None = None
        self.received = False  # any byte of the current answer
        self.closed = False
        self.keep_alive = True
        self.idle_since = 0.0
        self.paused = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # never asked for
            self._broken(UpstreamClosed("the model server switched protocols", answered=True))
        except httptools.HttpParserError as exc:
            error = f"malformed answer from the model server: {exc}"
            self._broken(UpstreamClosed(error, answered=True))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._broken(
            UpstreamClosed(
                f"the model server closed the connection{f': {exc}' if exc else ''}",
                answered=self.received,
            )
        )

    # ---- llhttp callbacks ----
    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._finish()

    # ---- used by the pool and the response ----
    def send(self, request: bytes, response: UpstreamResponse) -> asyncio.Future[None]:
        assert self.transport is not None
        self.response = response
        self.received = False
        self.headers_done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.headers_done

    def finish_response(self, reusable: bool) -> None:
        self.response = None
        self.headers_done = None
        self.resume()
        if reusable and self.keep_alive and not self.closed:
            self.idle_since = time.monotonic()
            self.pool.put(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _broken(self, error: UpstreamClosed) -> None:
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(error)
        if self.response is not None:
            self.response._fail(error)
        if not self.closed:
            self.close()


def _authorization(api_key: str | None) -> bytes:
    """vLLM's key, sent on every request (built once: no per-request cost). The client's own
    Authorization header is never forwarded: requests to vLLM are built here from scratch."""
    if api_key is None:
        return b""
    if not api_key or not all(33 <= ord(c) <= 126 for c in api_key):
        # A space, CR or LF would let the key end the header early (and is no token anyway).
        raise ValueError("vllm_api_key must be printable ASCII without spaces")
    return b"Authorization: Bearer " + api_key.encode() + b"\r\n"


class UpstreamPool:
    """Connections to one upstream (``http://`` or ``https://`` base URL, with an optional path
    prefix), most recently used first so idle ones age out."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float,
        total_timeout_s: float,
        api_key: str | None = None,
    ) -> None:
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"vllm_url must be http(s)://host[:port][/prefix], not {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.encode()
        netloc = url.netloc.rsplit("@", 1)[-1].encode()
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self._idle: list[_Connection] = []
        self._head = b" HTTP/1.1\r\nHost: " + netloc + b"\r\n" + _authorization(api_key)

    def put(self, connection: _Connection) -> None:
        self._idle.append(connection)

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        return connection

    async def request(
        self, method: bytes, path: str, body: bytes = b"", timeout_s: float | None = None
    ) -> UpstreamResponse:
        """Send one request and wait for the answer's status line and headers.

        A pooled connection the server closed just before we used it fails with nothing
        answered: the request is then sent once more on a fresh connection (the server never
        saw it, so repeating is safe). Raises ConnectFailed (nothing sent), UpstreamClosed, other
        OSErrors, or TimeoutError.
        """
        deadline = time.monotonic() + (timeout_s or self.total_timeout_s)
        head = method + b" " + self.prefix + path.encode() + self._head
        if body or method == b"POST":
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        request = head + b"\r\n" + body
        while True:
            connection = self._take_idle()
            reused = connection is not None
            if connection is None:
                connection = await self._connect()
            response = UpstreamResponse(connection, deadline)
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await connection.send(request, response)
            except UpstreamClosed as exc:
                connection.close()
                if reused and not exc.answered:
                    continue
                raise
            except BaseException:
                connection.close()
                raise
            return response

    def prune(self) -> None:
        """Drop idle connections that closed or aged out (only the newest are looked at per
        request)."""
        now = time.monotonic()
        keep = [c for c in self._idle if not c.closed and now - c.idle_since < KEEPALIVE_S]
        for connection in self._idle:
            if connection not in keep:
                connection.close()
        self._idle = keep

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

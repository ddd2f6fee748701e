"""A small Redis client for the rate limiter: one pipelined connection, RESP2, a deadline a call.

The limiter's check is on every request's path. redis-py's asyncio client cost about 75 µs a
call on the bench machine (connection pool, stream reader, timeout machinery) against about
30 µs here, where a command is bytes packed once and written straight to the socket. Every
caller shares the one connection: commands are written as they come and replies matched to
them in order (pipelining, which is also what Redis serves fastest). A call that outlives its
deadline fails alone: its reply, when it comes, is skipped, and the others' keep their pairing.
Only a connection that has answered nothing for STALLED_S while commands waited is dropped (the
next call connects again), so one slow reply costs only the callers waiting on it. URLs are
redis-py's: ``redis://``, ``rediss://`` and ``unix://``, with an optional user, password and
database.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any, cast

from redis.connection import parse_url

# Commands waiting for a reply on the one connection; past this, calls fail at once.
MAX_WAITING = 10_000
# A connection that answered nothing this long (and four deadlines) while commands waited is
# hung: dropped, failing them all. Redis stalls of a fork or a slow script are shorter.
STALLED_S = 1.0


class RedisReplyError(Exception):
    """An error reply from Redis (``-ERR ...``, ``-NOSCRIPT ...``)."""


def pack(*args: bytes | str | int | float) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(arg) for arg in args)


def bulk(arg: bytes | str | int | float) -> bytes:
    """One argument of a command; a packed command ends with its last arguments' bulks."""
    data = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def parse(buffer: bytes, at: int) -> tuple[Any, int] | None:
    """The reply that starts at ``at`` and where the next one starts; None if not all here."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return None
    kind, line, after = buffer[at], buffer[at + 1 : end], end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), after
    if kind == 0x2B:  # '+' simple string
        return line.decode(), after
    if kind == 0x2D:  # '-' error
        return RedisReplyError(line.decode(errors="replace")), after
    if kind == 0x24:  # '$' bulk string
        size = int(line)
        if size < 0:
            return None, after
        if len(buffer) < after + size + 2:
            return None
        return buffer[after : after + size], after + size + 2
    if kind == 0x2A:  # '*' array
        items: list[Any] = []
        for _ in range(max(0, int(line))):
            item = parse(buffer, after)
            if item is None:
                return None
            items.append(item[0])
            after = item[1]
        return (items if int(line) >= 0 else None), after
    raise ConnectionError(f"not a RESP reply from Redis: {buffer[at : at + 20]!r}")


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.buffer = b""
        self.closed = False
        self.progress_at = 0.0  # loop time of the last reply, or of a send to an idle connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        at = 0
        self.progress_at = asyncio.get_running_loop().time()
        try:
            while at < len(buffer):
                reply = parse(buffer, at)
                if reply is None:
                    break
                value, at = reply
                if not self.waiting:
                    raise ConnectionError("Redis replied to no command")
                waiter = self.waiting.popleft()
                if waiter.done():  # its caller gave up, or the connection is being dropped
                    continue
                if isinstance(value, RedisReplyError):
                    waiter.set_exception(value)
                else:
                    waiter.set_result(value)
        except (ConnectionError, ValueError) as exc:
            self.abort(ConnectionError(f"bad reply from Redis: {exc}"))
            return
        self.buffer = buffer[at:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.abort(ConnectionError(f"Redis connection lost: {exc or 'closed'}"))

    def send(self, command: bytes) -> asyncio.Future[Any]:
        if self.closed or self.transport is None:
            raise ConnectionError("Redis connection closed")
        if len(self.waiting) >= MAX_WAITING:
            raise ConnectionError("too many Redis commands waiting")
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        # A caller may never look (its request failed first): no "never retrieved" warning.
        waiter.add_done_callback(_retrieved)
        if not self.waiting:
            self.progress_at = loop.time()
        self.waiting.append(waiter)
        self.transport.write(command)
        return waiter

    def abort(self, error: Exception) -> None:
        """Close at once and fail every command still waiting."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)


class RedisClient:
    """``await call(pack(...))``: the reply, or an exception within ``timeout_s``. Or in two
    steps, so the caller can work while Redis does: ``send`` now, ``await reply(...)`` later."""

    def __init__(self, url: str, timeout_s: float, setup: tuple[bytes, ...] = ()) -> None:
        self.timeout_s = timeout_s
        self.stalled_s = max(STALLED_S, 4 * timeout_s)
        options = parse_url(url)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        self._path: str | None = options.get("path")
        self._host = options.get("host", "localhost")
        self._port = int(options.get("port", 6379))
        self._tls = _tls_context(options) if url.startswith("rediss://") else None
        self._setup = []  # sent first on every new connection
        if options.get("password"):
            user = options.get("username")
            auth = ("AUTH", user, options["password"]) if user else ("AUTH", options["password"])
            self._setup.append(pack(*auth))
        if int(options.get("db") or 0):
            self._setup.append(pack("SELECT", int(options["db"])))
        self._setup.extend(setup)  # the caller's own, e.g. SCRIPT LOAD
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None

    def send(self, command: bytes) -> asyncio.Future[Any] | None:
        """Write the command now and return where its reply will be; None while there is no
        open connection (:meth:`call` opens one)."""
        connection = self._connection
        if connection is None or connection.closed:
            return None
        return connection.send(command)

    async def reply(self, waiter: asyncio.Future[Any], deadline: float | None = None) -> Any:
        """The reply :meth:`send` promised; TimeoutError when it takes over ``timeout_s`` more
        (or past ``deadline``, loop time)."""
        if waiter.done():
            return waiter.result()
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except TimeoutError:
            # The waiter is cancelled: its reply, when it comes, is skipped. A connection that
            # has not answered for long is hung, and dropped.
            connection = self._connection
            if (
                connection is not None
                and connection.waiting
                and asyncio.get_running_loop().time() - connection.progress_at > self.stalled_s
            ):
                connection.abort(ConnectionError("Redis stopped answering"))
            raise

    async def call(self, command: bytes) -> Any:
        """The reply to one packed command, connecting first if need be; TimeoutError past
        ``timeout_s``, the connecting included."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        waiter = self.send(command)
        if waiter is None:
            async with asyncio.timeout_at(deadline):
                connection = await self._connected()
            waiter = connection.send(command)
        return await self.reply(waiter, deadline)

    async def _connected(self) -> _Connection:
        """The connection, opened once for every caller waiting on it."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)
        return await asyncio.shield(self._connecting)

    def _opened(self, task: asyncio.Task[_Connection]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._connection = task.result()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            if self._path is not None:
                _, connection = await loop.create_unix_connection(_Connection, self._path)
            else:
                _, connection = await loop.create_connection(
                    _Connection, self._host, self._port, ssl=self._tls
                )
            try:
                # Pipelined: one round trip for all of them.
                for waiter in [connection.send(command) for command in self._setup]:
                    await waiter
            except BaseException:
                connection.abort(ConnectionError("Redis refused the connection's setup"))
                raise
        return connection

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._connection is not None:
            self._connection.abort(ConnectionError("client closed"))
            self._connection = None


def _retrieved(waiter: asyncio.Future[Any]) -> None:
    if not waiter.cancelled():
        waiter.exception()


def _tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """rediss://: verified against the system's CAs (or ``ssl_ca_certs``) unless
    ``ssl_cert_reqs=none``, as redis-py reads the same URL."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    if str(options.get("ssl_cert_reqs", "required")).lower() in ("none", "0"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context

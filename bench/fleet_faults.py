"""bench/fleet_routing.py's ``faults`` mix: a fleet of three where one replica is real (embedded
vLLM), one is hung (its ``/health`` answers, its engine does not: a stream gets its headers and
then nothing, a request not streamed gets nothing) and one goes dark mid-run (a forwarder to the
real replica that stops relaying what it holds and stops taking connections: a blackhole, as a
node that drops off the network). Two proxies in front of the same three: one with outlier
ejection, connect retries and the first-byte deadline (proxy.outlier_ejection,
upstream_retries, upstream_first_byte_timeout_s), one with all three off, in the order
A B B A on the same conversations per position.

The fakes run on an event loop of their own, in a thread: these faults cannot be had from vLLM
on demand. The real replica answers every request that reaches an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from embedded.processes import Part, free_port
from embedded.stack import proxy_part
from ratchet.settings import load_settings

ARMS = ("ejection", "no_ejection")
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
FAULT_COUNTERS = (
    "ejections",
    "retries",
    "connect_failures",
    "first_byte_timeouts",
)


def arm_settings(arm: str, upstream_timeout_s: float, first_byte_s: float) -> dict[str, Any]:
    """The proxy settings of an arm; both give up on an answer after ``upstream_timeout_s``
    (300 s by default: shortened, or the arm without ejection would take hours)."""
    common: dict[str, Any] = {"upstream_timeout_s": upstream_timeout_s, "expose_arm": True}
    if arm == "ejection":
        return {**common, "upstream_first_byte_timeout_s": first_byte_s}
    return {
        **common,
        "upstream_first_byte_timeout_s": None,
        "upstream_retries": 0,
        "outlier_ejection": {"consecutive_failures": 0},
    }


class FaultyReplicas:
    """The hung replica and the one that goes dark, served from a thread's event loop."""

    def __init__(self, real_url: str) -> None:
        self.real = httpx.URL(real_url)
        self.hung_port, self.dark_port = free_port(), free_port()
        self.hung_url = f"http://127.0.0.1:{self.hung_port}"
        self.dark_url = f"http://127.0.0.1:{self.dark_port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.dark = False
        self._servers: list[asyncio.Server] = []
        self._forwarder: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._hole: list[socket.socket] = []

    def start(self) -> None:
        self.thread.start()
        self._call(self._start)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()

    def go_dark(self, cut: bool = False) -> None:
        """Stop taking connections; what it holds goes nowhere, or with ``cut`` is reset (a
        client then meets the blackhole on its very next request)."""
        self._call(self._go_dark)
        if cut:
            self._call(self._cut)

    def come_back(self) -> None:
        self._call(self._come_back)

    def _call(self, make: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout=30)

    async def _start(self) -> None:
        hung = await asyncio.start_server(self._hung, "127.0.0.1", self.hung_port)
        self._servers.append(hung)
        await self._come_back()

    async def _stop(self) -> None:
        for server in [*self._servers, *([self._forwarder] if self._forwarder else [])]:
            server.close()
        self._drop_pipes()
        self._close_hole()
        held = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in held:  # the hung replica's requests, held forever otherwise
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)

    # ---- the hung replica ----
    async def _hung(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, body = await read_request(reader)
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                elif head.startswith(b"GET /v1/models"):
                    answer = b'{"object":"list","data":[]}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer))
                    writer.write(answer)
                else:  # the API server takes it; the engine never steps
                    if re.search(rb'"stream"\s*:\s*true', body):
                        writer.write(SSE_HEAD)
                    await writer.drain()
                    await asyncio.Event().wait()  # hung: never answers
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # Cancelled at stop: ended here, as asyncio 3.11's server callback would raise it.
            writer.close()

    # ---- the replica that goes dark ----
    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.real.host, self.real.port)
        except OSError:
            writer.close()
            return
        self._pipes |= {writer, up_writer}
        with contextlib.suppress(asyncio.CancelledError):  # at stop, as in _hung
            await asyncio.gather(
                self._pipe(reader, up_writer),
                self._pipe(up_reader, writer),
                return_exceptions=True,
            )
        for end in (writer, up_writer):
            self._pipes.discard(end)
            end.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            while self.dark:  # what it holds goes nowhere while it is dark
                await asyncio.sleep(0.1)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _go_dark(self) -> None:
        self.dark = True
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None
        self._hole = blackhole(self.dark_port)

    async def _cut(self) -> None:
        self._drop_pipes()

    async def _come_back(self) -> None:
        self._close_hole()
        self._drop_pipes()
        self.dark = False
        self._forwarder = await asyncio.start_server(
            self._forward, "127.0.0.1", self.dark_port, reuse_address=True
        )

    def _drop_pipes(self) -> None:
        for end in list(self._pipes):
            end.transport.abort()
        self._pipes.clear()

    def _close_hole(self) -> None:
        for opened in self._hole:
            opened.close()
        self._hole = []


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    found = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    return head, await reader.readexactly(int(found.group(1)) if found else 0)


def blackhole(port: int) -> list[socket.socket]:
    """A listener on ``port`` that never accepts, its accept queue full: a connect there gets
    no SYN-ACK and times out, as to a host that dropped off the network."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    fillers = []
    for _ in range(2):  # the accept queue holds backlog + 1
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    return [listener, *fillers]


def fault_proxies(
    home: Path, base: dict[str, Any], faulty: FaultyReplicas, args: Any
) -> tuple[list[Part], dict[str, str]]:
    """A proxy per arm in front of the real replica, the hung one and the one that goes dark."""
    parts, urls = [], {}
    endpoints = [base["vllm_endpoints"][0], faulty.hung_url, faulty.dark_url]
    for arm in ARMS:
        proxy = {"port": free_port(), **arm_settings(arm, args.fault_timeout_s, args.first_byte_s)}
        config = {**base, "vllm_endpoints": endpoints, "proxy": proxy}
        path = home / f"proxy-{arm}.yaml"
        path.write_text(yaml.safe_dump(config))
        settings = load_settings(path)
        part = proxy_part(settings, path)
        part.name = f"proxy-{arm}"
        parts.append(part)
        urls[arm] = f"http://127.0.0.1:{settings.proxy.port}"
    return parts, urls


def fault_counts(proxy: str, replicas: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each fault counter of the proxy's scrape for the replicas named in ``replicas``
    (name -> URL)."""
    text = httpx.get(f"{proxy}/metrics", timeout=10).text
    counts: dict[str, dict[str, float]] = {}
    for name, url in replicas.items():
        counts[name] = {}
        for counter in FAULT_COUNTERS:
            found = re.search(
                rf'^ratchet_proxy_endpoint_{counter}_total{{endpoint="{re.escape(url)}"}} (\S+)$',
                text,
                re.M,
            )
            counts[name][counter] = float(found.group(1)) if found else 0.0
    return counts


def error_counts(proxy: str) -> dict[str, float]:
    """The proxy's errors returned to clients so far, by code."""
    text = httpx.get(f"{proxy}/metrics", timeout=10).text
    return {
        code: float(value)
        for code, value in re.findall(
            r'^ratchet_proxy_errors_total{code="([^"]+)"} (\S+)$', text, re.M
        )
    }


def endpoint_up(proxy: str, url: str) -> bool:
    text = httpx.get(f"{proxy}/metrics", timeout=10).text
    return f'ratchet_proxy_endpoint_up{{endpoint="{url}"}} 1.0' in text


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)

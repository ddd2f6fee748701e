"""bench/fleet_routing.py's ``faults`` mix: a fleet of three where one replica is real (embedded
vLLM), one is hung (its ``/health`` answers, its engine wedges on every request it takes: a
stream after two events, a request not streamed at once, and sends nothing more to anyone, a
probe included, until the wedged ones are dropped) and one goes dark mid-run (a forwarder to the
real replica that stops relaying what it holds and stops taking connections: a blackhole, as a
node that drops off the network). Two proxies in front of the same three: one with outlier
ejection, connect retries, the first-byte deadline and the deadline between a stream's events
(proxy.outlier_ejection, upstream_retries, upstream_first_byte_timeout_s,
upstream_stream_gap_timeout_s), one with all four off, in the order A B B A on the same
conversations per position; a share of the conversations is streamed.

The fakes run on an event loop of their own, in a thread: these faults cannot be had from vLLM
on demand. The real replica answers every request that reaches an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from rich.console import Console
from rich.table import Table

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
    "stream_stalls",
)
console = Console()
# (proxy URL, conversations, how many at a time, streamed) -> (latencies, failures)
Traffic = Callable[[str, list[Any], int, bool], tuple[list[float], int]]


def arm_settings(
    arm: str, upstream_timeout_s: float, first_byte_s: float, stream_gap_s: float
) -> dict[str, Any]:
    """The proxy settings of an arm; both give up on an answer after ``upstream_timeout_s``
    (300 s by default: shortened, or the arm without ejection would take hours)."""
    common: dict[str, Any] = {"upstream_timeout_s": upstream_timeout_s, "expose_arm": True}
    if arm == "ejection":
        return {
            **common,
            "upstream_first_byte_timeout_s": first_byte_s,
            "upstream_stream_gap_timeout_s": stream_gap_s,
        }
    return {
        **common,
        "upstream_first_byte_timeout_s": None,
        "upstream_stream_gap_timeout_s": None,
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
        self.wedged = 0  # the hung replica's requests held: its engine sends nothing meanwhile
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
                else:  # the API server takes it; the engine wedges on it
                    await self._wedge(body, reader, writer)
                    writer.close()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # Cancelled at stop: ended here, as asyncio 3.11's server callback would raise it.
            writer.close()

    async def _wedge(
        self, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A stream gets its headers at once (vLLM's API server sends them) and, if the engine
        is not wedged yet, two events; then nothing, for it and anyone else, until the proxy
        drops it (vLLM aborts a request whose client left)."""
        if re.search(rb'"stream"\s*:\s*true', body):
            writer.write(SSE_HEAD)
            if not self.wedged:
                model = re.search(rb'"model"\s*:\s*"([^"]*)"', body)
                writer.write(b"".join(sse_chunk(model.group(1) if model else b"", t) for t in "ab"))
        self.wedged += 1
        try:
            await writer.drain()
            while await reader.read(65536):  # until the proxy closes it
                pass
        finally:
            self.wedged -= 1

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


def sse_chunk(model: bytes, text: str) -> bytes:
    """One chat-completion stream event, as HTTP/1.1 chunked encoding sends it."""
    event = {
        "id": "chatcmpl-hung",
        "object": "chat.completion.chunk",
        "model": model.decode(),
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    data = b"data: " + orjson.dumps(event) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def ask(
    client: httpx.AsyncClient, proxy: str, body: dict[str, Any], stream: bool
) -> str | None:
    """One chat request through ``proxy``: the answer's text, or None if it failed (an error
    status, or for a stream an error event or no ``[DONE]``)."""
    url = f"{proxy}/v1/chat/completions"
    try:
        if not stream:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                return None
            return str(response.json()["choices"][0]["message"].get("content") or "")
        parts, done = [], False
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = orjson.loads(data)
                    if "error" in event:
                        return None
                    for choice in event.get("choices") or []:
                        parts.append((choice.get("delta") or {}).get("content") or "")
        return "".join(parts) if done else None
    except httpx.HTTPError:
        return None


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
        timeouts = (args.fault_timeout_s, args.first_byte_s, args.stream_gap_s)
        proxy = {"port": free_port(), **arm_settings(arm, *timeouts)}
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


def run_faults(
    fleet: dict[str, Any],
    args: Any,
    talks_for: Callable[[int], list[Any]],
    traffic: Traffic,
) -> dict[str, Any]:
    """Each arm twice, A B B A, on the same conversations per position (``talks_for(seed)``),
    ``--stream-share`` of them streamed (as many of the clients at a time): the third replica
    goes dark ``--dark-after-s`` into each round and comes back after it."""
    faulty: FaultyReplicas = fleet["faulty"]
    named = {"hung": faulty.hung_url, "dark": faulty.dark_url}
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for i, arm in enumerate([*ARMS, *reversed(ARMS)]):
        proxy = fleet["fault_proxies"][arm]
        wait_for(functools.partial(endpoint_up, proxy, faulty.dark_url), 60, "the dark one back")
        talks = talks_for(500 + 100 * i)
        cut = round(len(talks) * args.stream_share)
        streamed_at_once = max(1, round(args.concurrency * args.stream_share)) if cut else 0
        before, errors_before = fault_counts(proxy, named), error_counts(proxy)
        dark = threading.Timer(args.dark_after_s, faulty.go_dark)
        started = time.perf_counter()
        with console.status(f"faults: round {i + 1}/4: {arm}"):
            dark.start()
            with ThreadPoolExecutor(2) as pool:  # both kinds of traffic at once
                streamed = pool.submit(traffic, proxy, talks[:cut], streamed_at_once, True)
                plain_at_once = max(1, args.concurrency - streamed_at_once)
                plain = pool.submit(traffic, proxy, talks[cut:], plain_at_once, False)
                (s_latencies, s_failures), (latencies, failures) = streamed.result(), plain.result()
            dark.cancel()
            faulty.come_back()
        after, errors_after = fault_counts(proxy, named), error_counts(proxy)
        rounds[arm].append(
            {
                "latencies": latencies + s_latencies,
                "failures": failures + s_failures,
                "streamed": {"latencies": s_latencies, "failures": s_failures},
                "wall_s": time.perf_counter() - started,
                "faults": {
                    name: {k: after[name][k] - before[name][k] for k in after[name]}
                    for name in named
                },
                "errors": {
                    code: n - errors_before.get(code, 0.0)
                    for code, n in errors_after.items()
                    if n > errors_before.get(code, 0.0)
                },
            }
        )
    return {arm: summarise_arm(arm_rounds, named) for arm, arm_rounds in rounds.items()}


def summarise_arm(arm_rounds: list[dict[str, Any]], named: dict[str, str]) -> dict[str, Any]:
    latencies = [x for r in arm_rounds for x in r["latencies"]]
    streamed = [x for r in arm_rounds for x in r["streamed"]["latencies"]]
    return {
        "answered": len(latencies),
        "failed": sum(r["failures"] for r in arm_rounds),
        "p50_ms": pct(latencies, 0.5),
        "p99_ms": pct(latencies, 0.99),
        "streamed": {
            "answered": len(streamed),
            "failed": sum(r["streamed"]["failures"] for r in arm_rounds),
            "p50_ms": pct(streamed, 0.5),
            "p99_ms": pct(streamed, 0.99),
        },
        "wall_s": sum(r["wall_s"] for r in arm_rounds),
        "faults": {
            name: {k: sum(r["faults"][name][k] for r in arm_rounds) for k in FAULT_COUNTERS}
            for name in named
        },
        "errors": {
            code: sum(r["errors"].get(code, 0.0) for r in arm_rounds)
            for code in sorted({c for r in arm_rounds for c in r["errors"]})
        },
    }


def print_faults(summary: dict[str, Any], args: Any) -> None:
    table = Table(
        title=(
            "A real replica, a hung one and one that goes dark; with outlier ejection and "
            f"without (both give up after {args.fault_timeout_s:g} s); "
            f"{args.stream_share:.0%} of conversations streamed"
        )
    )
    columns = ["proxy", "answered", "failed", "p50 ms", "p99 ms", "streamed: answered / failed"]
    columns += ["streamed p99 ms", "wall s", "hung: first-byte timeouts / stream stalls / "]
    columns[-1] += "ejections"
    columns += ["dark: connect failures / retries"]
    for column in columns:
        table.add_column(column)
    for arm, row in summary.items():
        hung, dark, streamed = row["faults"]["hung"], row["faults"]["dark"], row["streamed"]
        table.add_row(
            arm,
            str(row["answered"]),
            str(row["failed"]),
            f"{row['p50_ms']:.0f}",
            f"{row['p99_ms']:.0f}",
            f"{streamed['answered']} / {streamed['failed']}",
            f"{streamed['p99_ms']:.0f}",
            f"{row['wall_s']:.0f}",
            f"{hung['first_byte_timeouts']:.0f} / {hung['stream_stalls']:.0f} / "
            f"{hung['ejections']:.0f}",
            f"{dark['connect_failures']:.0f} / {dark['retries']:.0f}",
        )
    console.print(table)
    for arm, row in summary.items():
        errors = ", ".join(f"{code} {n:.0f}" for code, n in row["errors"].items())
        console.print(f"{arm}: errors by code: {errors or 'none'}")
    on, off = summary["ejection"], summary["no_ejection"]
    console.print(
        f"faults: with ejection / without: p99 {on['p99_ms'] / off['p99_ms']:.2f}, "
        f"failed {on['failed']} against {off['failed']}"
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")

"""A fleet that heals itself (proxy/upstream.py over ratchet/ejection.py): a blackholed replica
costs a retry, not a request; a hung one (its /health answers, its engine does not) ends its
requests in 504 upstream_stalled at the first-byte deadline and is ejected, after which its
requests go elsewhere; a client that stops reading counts against no one; a DNS lookup that
hangs holds up neither the health checks nor the fleet. Replicas here are raw sockets: these
faults cannot be had from vLLM on demand."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from embedded.processes import wait_until_async
from proxy.errors import ProxyError
from proxy.fleet_metrics import FleetFaults
from proxy.upstream import FaultPolicy, Upstream
from ratchet.ejection import EjectionPolicy
from ratchet.fleet import choose

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = b"data: {}\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def replica(post: Handler, up: list[bool] | None = None) -> tuple[asyncio.Server, str]:
    """A stand-in vLLM whose /health answers 200 (503 once ``up[0]`` is False) and whose POSTs
    ``post`` answers."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await read_request(reader)
                if head.startswith(b"GET /health"):
                    status = b"200 OK" if up is None or up[0] else b"503 Unavailable"
                    writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
                else:
                    await post(head, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def answers(_: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(STREAM_HEAD + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def stalls(request: bytes, writer: asyncio.StreamWriter) -> None:
    """A hung engine: a stream's headers at once (vLLM's API server sends them), then nothing;
    a request not streamed, nothing at all."""
    if b'"stream":true' in request:
        writer.write(STREAM_HEAD)
    await asyncio.Event().wait()  # hung: never answers


async def slow_answers(request: bytes, writer: asyncio.StreamWriter) -> None:
    """A working engine and a long answer: a stream starts at once, a whole answer takes 1 s."""
    if b'"stream":true' not in request:
        await asyncio.sleep(1.0)
    await answers(request, writer)


async def talks_on(_: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(STREAM_HEAD)
    for _turn in range(200):
        writer.write(chunk(EVENT * 50))
        await writer.drain()
        await asyncio.sleep(0.01)


def blackhole() -> tuple[socket.socket, list[socket.socket], str]:
    """An address whose SYNs go unanswered: a listener that never accepts, its queue full."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(2):  # the accept queue holds backlog + 1
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    return listener, fillers, f"http://127.0.0.1:{port}"


def names_on(url: str, fleet: list[str], n: int = 4) -> list[str]:
    """Served names whose first choice is ``url``."""
    return [k for k in (f"m{i}" for i in range(500)) if choose(k, fleet, {}) == url][:n]


@pytest.fixture
async def servers() -> AsyncIterator[list[asyncio.Server]]:
    started: list[asyncio.Server] = []
    yield started
    for server in started:
        server.close()


def fleet(urls: list[str], **faults: Any) -> Upstream:
    upstream = Upstream(urls, 0.3, 10.0, faults=FaultPolicy(**faults))
    for endpoint in upstream.endpoints.values():
        endpoint.healthy = True  # as if their health checks had passed (the hung one's does)
    return upstream


async def drain(upstream: Upstream, name: str, stream: bool = False) -> bytes:
    body = b'{"stream":true}' if stream else b"{}"
    response = await upstream.post("chat.completions", body, key=name)
    return await upstream.read(response)


async def test_a_blackholed_replica_costs_a_retry_not_a_request(
    servers: list[asyncio.Server],
) -> None:
    good, good_url = await replica(answers)
    servers.append(good)
    listener, fillers, hole = blackhole()
    urls = [good_url, hole]
    upstream = fleet(urls, ejection=EjectionPolicy(1), retries=1)
    try:
        for name in names_on(hole, urls, 2):
            started = time.monotonic()
            assert b"[DONE]" in await drain(upstream, name)  # answered by the other replica
            assert time.monotonic() - started < 2.0  # one connect timeout, not a hang
            upstream.endpoints[hole].healthy = True  # its health check has not run yet
        assert upstream.endpoints[hole].connect_failures >= 1
        assert upstream.endpoints[hole].retries >= 1
        assert upstream.outliers.is_ejected(hole, time.monotonic())
        # With no retries left, the client hears 503: it was not a stall.
        lone = fleet(urls, retries=0)
        with pytest.raises(ProxyError) as caught:
            await drain(lone, names_on(hole, urls, 1)[0])
        assert caught.value.status == 503
    finally:
        await upstream.close()
        listener.close()
        for filler in fillers:
            filler.close()


async def test_a_hung_replica_stalls_into_504s_then_is_ejected_and_skipped(
    servers: list[asyncio.Server],
) -> None:
    good, good_url = await replica(answers)
    hung, hung_url = await replica(stalls)
    servers += [good, hung]
    urls = [good_url, hung_url]
    upstream = fleet(urls, ejection=EjectionPolicy(2, base_s=60.0), first_byte_timeout_s=0.3)
    name = names_on(hung_url, urls, 1)[0]
    try:
        for _ in range(2):
            with pytest.raises(ProxyError) as caught:
                await drain(upstream, name, stream=True)
            assert caught.value.status == 504
            assert caught.value.body()["error"]["code"] == "upstream_stalled"
        assert upstream.outliers.is_ejected(hung_url, time.monotonic())
        assert b"[DONE]" in await drain(upstream, name)  # its name now goes elsewhere
        assert all(e.outstanding == 0 for e in upstream.endpoints.values())

        registry = CollectorRegistry()
        registry.register(FleetFaults(upstream))
        scrape = generate_latest(registry).decode()
        at = f'{{endpoint="{hung_url}"}}'
        assert f"ratchet_proxy_endpoint_first_byte_timeouts_total{at} 2.0" in scrape
        assert f"ratchet_proxy_endpoint_ejections_total{at} 1.0" in scrape
        assert f"ratchet_proxy_endpoint_ejected{at} 1.0" in scrape
        assert "ratchet_proxy_fleet_ejected_ratio 0.5" in scrape
    finally:
        await upstream.close()


async def test_a_whole_answer_waits_on_a_working_engine_and_not_on_a_hung_one(
    servers: list[asyncio.Server],
) -> None:
    slow, slow_url = await replica(slow_answers)
    hung, hung_url = await replica(stalls)
    servers += [slow, hung]
    urls = [slow_url, hung_url]
    upstream = fleet(urls, ejection=EjectionPolicy(1), first_byte_timeout_s=0.3)
    assert upstream.stall_watch is not None
    try:
        # Not streamed, so its headers come with the whole answer, past the deadline: the
        # probes find the engine working and the request waits on.
        started = time.monotonic()
        assert b"[DONE]" in await drain(upstream, names_on(slow_url, urls, 1)[0])
        assert time.monotonic() - started >= 1.0 and upstream.stall_watch.probes >= 2
        assert not upstream.outliers.is_ejected(slow_url, time.monotonic())

        # The hung engine's probe sends nothing either: a 504 at about twice the deadline.
        started = time.monotonic()
        with pytest.raises(ProxyError) as caught:
            await drain(upstream, names_on(hung_url, urls, 1)[0])
        assert caught.value.body()["error"]["code"] == "upstream_stalled"
        assert time.monotonic() - started < 2.0
        assert upstream.endpoints[hung_url].first_byte_timeouts == 1
        assert upstream.outliers.is_ejected(hung_url, time.monotonic())
    finally:
        await upstream.close()


async def test_a_stream_slow_to_its_first_byte_on_a_working_engine_is_waited_on(
    servers: list[asyncio.Server],
) -> None:
    """A long prompt's prefill (or a queue under load): the stream's headers at once, its first
    byte after 1 s, while the engine answers a probe at once. The stream waits on, and the
    replica is charged nothing (ejection after one failure would show it)."""

    async def prefills(request: bytes, writer: asyncio.StreamWriter) -> None:
        if b'"max_tokens":1' in request:  # the probe: a short prompt, answered at once
            await answers(request, writer)
            return
        writer.write(STREAM_HEAD)
        await asyncio.sleep(1.0)
        writer.write(chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    busy, busy_url = await replica(prefills)
    servers.append(busy)
    upstream = fleet([busy_url], ejection=EjectionPolicy(1), first_byte_timeout_s=0.3)
    assert upstream.stall_watch is not None
    try:
        assert b"[DONE]" in await drain(upstream, "m0", stream=True)
        assert upstream.stall_watch.probes >= 2
        assert upstream.endpoints[busy_url].first_byte_timeouts == 0
        assert not upstream.outliers.is_ejected(busy_url, time.monotonic())
    finally:
        await upstream.close()


async def test_requests_held_by_a_replica_that_dropped_off_the_network_end_as_stalled(
    servers: list[asyncio.Server],
) -> None:
    """It took the request, then went dark: nothing comes back, and its probe finds no
    connection (here, refused: its listener closed)."""
    taken = asyncio.Event()

    async def takes_then_goes(request: bytes, writer: asyncio.StreamWriter) -> None:
        taken.set()
        await stalls(request, writer)

    dark, dark_url = await replica(takes_then_goes)
    servers.append(dark)
    upstream = fleet(
        [dark_url, "http://127.0.0.1:9"], ejection=EjectionPolicy(5), first_byte_timeout_s=0.3
    )
    waiting = asyncio.create_task(drain(upstream, names_on(dark_url, list(upstream.endpoints))[0]))
    await taken.wait()
    dark.close()  # no new connections from now on
    with pytest.raises(ProxyError) as caught:
        await waiting
    assert caught.value.body()["error"]["code"] == "upstream_stalled"
    assert upstream.endpoints[dark_url].first_byte_timeouts == 1
    await upstream.close()


async def test_a_client_that_leaves_while_a_replica_is_silent_frees_it_and_blames_no_one(
    servers: list[asyncio.Server],
) -> None:
    hung, hung_url = await replica(stalls)
    servers.append(hung)
    upstream = fleet(
        [hung_url, "http://127.0.0.1:9"], ejection=EjectionPolicy(1), first_byte_timeout_s=30.0
    )
    name = names_on(hung_url, list(upstream.endpoints), 1)[0]
    for body in (b'{"stream":true}', b"{}"):  # waiting for the first byte, for the headers
        waiting = asyncio.create_task(upstream.post("chat.completions", body, key=name))
        await wait_until_async(
            lambda: upstream.endpoints[hung_url].outstanding == 1, 5, "the request in flight"
        )
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert upstream.endpoints[hung_url].outstanding == 0
    assert upstream.endpoints[hung_url].first_byte_timeouts == 0
    assert not upstream.outliers.is_ejected(hung_url, time.monotonic())
    await upstream.close()


async def test_a_client_that_stops_reading_counts_against_no_replica_a_cut_answer_does(
    servers: list[asyncio.Server],
) -> None:
    talker, talker_url = await replica(talks_on)
    servers.append(talker)
    upstream = fleet([talker_url, "http://127.0.0.1:9"], ejection=EjectionPolicy(1))
    name = names_on(talker_url, list(upstream.endpoints), 1)[0]
    for _ in range(3):  # the client reads the first event and leaves
        response = await upstream.post("chat.completions", b"{}", key=name)
        async for _ in response.iter_any():
            break
        response.release()
    assert not upstream.outliers.is_ejected(talker_url, time.monotonic())
    assert upstream.outliers.record(talker_url).consecutive == 0

    async def cuts(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + chunk(EVENT))
        await writer.drain()
        writer.transport.abort()  # the replica dies mid-answer

    cutter, cutter_url = await replica(cuts)
    servers.append(cutter)
    upstream = fleet([cutter_url, talker_url], ejection=EjectionPolicy(1))
    name = names_on(cutter_url, list(upstream.endpoints), 1)[0]
    with pytest.raises(ProxyError) as caught:
        await drain(upstream, name)
    assert caught.value.status == 502
    assert upstream.outliers.is_ejected(cutter_url, time.monotonic())
    await upstream.close()


async def test_a_hanging_dns_lookup_holds_up_neither_health_nor_the_fleet(
    servers: list[asyncio.Server], monkeypatch: Any
) -> None:
    up = [True]
    good, good_url = await replica(answers, up)
    servers.append(good)
    port = int(good_url.rsplit(":", 1)[1])
    lookups = 0

    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        nonlocal lookups
        lookups += 1
        if lookups > 1:
            await asyncio.Event().wait()  # the DNS server stopped answering: never again
        return [(2, 1, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    upstream = Upstream(
        [f"http://vllm-headless.ml.svc:{port}"],
        0.3,
        10.0,
        resolve=True,
        faults=FaultPolicy(resolve_timeout_s=0.1),
    )
    await upstream.start(0.05)
    try:
        assert upstream.ready and list(upstream.endpoints) == [good_url]
        await wait_until_async(lambda: lookups >= 2, 5, "the lookup that hangs")
        up[0] = False  # the replica goes down while the lookup hangs
        await wait_until_async(lambda: not upstream.ready, 5, "the health check to see it down")
        assert list(upstream.endpoints) == [good_url]  # the last answer stands
        assert lookups == 2  # later rounds waited on the hung lookup rather than pile up more
    finally:
        await upstream.close()


def test_the_blackhole_really_drops_connections() -> None:
    """What the first test's blackhole rests on: a connect there does not complete."""
    listener, fillers, url = blackhole()
    sock = socket.socket()
    sock.settimeout(0.3)
    try:
        with pytest.raises(TimeoutError):
            sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    finally:
        for opened in (sock, listener, *fillers):
            opened.close()

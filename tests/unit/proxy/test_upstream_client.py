"""The proxy's HTTP client to vLLM (proxy/http1.py, proxy/upstream.py) against real HTTP
servers: aiohttp's for well-behaved answers, raw asyncio servers for the faults a real server
only makes by accident (closing a kept-alive connection just as it is reused, cutting an answer
short)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from embedded.processes import free_port as closed_port
from proxy.errors import ProxyError
from proxy.http1 import READ_HIGH_WATER, UpstreamClosed, UpstreamPool
from proxy.upstream import Upstream

BIG = bytes(range(256)) * (4 * 4096)  # 4 MiB: past the read high-water mark


@pytest.fixture
async def server() -> AsyncIterator[dict[str, Any]]:
    seen: dict[str, Any] = {"peers": [], "paths": [], "bodies": [], "release": asyncio.Event()}

    async def record(request: web.Request) -> None:
        seen["peers"].append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        seen["paths"].append(request.path)
        seen["bodies"].append(await request.read())

    async def echo(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"ok": True})

    async def big(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(body=BIG)

    async def stream(request: web.Request) -> web.StreamResponse:
        await record(request)
        response = web.StreamResponse()  # chunked
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await seen["release"].wait()  # the client must see the first event before the rest
        await response.write(b"data: 2\n\n")
        await response.write_eof()
        return response

    async def close(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(text="bye", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_post("/prefix/v1/chat/completions", echo)
    app.router.add_post("/v1/chat/completions", echo)
    app.router.add_post("/v1/completions", stream)
    app.router.add_get("/big", big)
    app.router.add_get("/close", close)
    runner = web.AppRunner(app)
    await runner.setup()
    port = closed_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    seen["url"] = f"http://127.0.0.1:{port}"
    yield seen
    await runner.cleanup()


async def raw_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, str]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))


async def test_a_connection_is_kept_alive_and_reused(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"], 2.0, 10.0)
    for body in (b'{"a":1}', b'{"a":2}'):
        response = await pool.request(b"POST", "/v1/chat/completions", body)
        assert response.status == 200 and await response.read() == b'{"ok": true}'
    assert server["bodies"] == [b'{"a":1}', b'{"a":2}']
    assert server["peers"][0] == server["peers"][1]  # one connection for both
    pool.close()


async def test_a_path_prefix_in_the_base_url_is_kept(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"] + "/prefix/", 2.0, 10.0)
    response = await pool.request(b"POST", "/v1/chat/completions", b"{}")
    assert response.status == 200 and await response.read() == b'{"ok": true}'
    assert server["paths"] == ["/prefix/v1/chat/completions"]
    pool.close()


async def test_a_chunked_stream_arrives_as_it_is_sent(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"], 2.0, 10.0)
    response = await pool.request(b"POST", "/v1/completions", b"{}")
    chunks = []
    async for chunk in response.iter_any():
        chunks.append(chunk)
        server["release"].set()  # only now does the server send the rest
    response.release()
    assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\n"
    assert chunks[0] == b"data: 1\n\n"  # de-chunked by llhttp
    assert len(pool._idle) == 1  # read whole: back in the pool
    pool.close()


async def test_a_large_answer_is_read_whole(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"], 2.0, 10.0)
    response = await pool.request(b"GET", "/big")
    assert await response.read() == BIG
    pool.close()


async def test_a_slow_reader_pauses_the_socket_and_bounds_what_is_buffered() -> None:
    """Back-pressure: a relay that does not read (a slow client) must not make the proxy read
    a long answer into memory; past READ_HIGH_WATER it stops reading the socket."""
    body = bytes(range(256)) * (64 * 1024)  # 16 MiB: more than the kernel's buffers hold
    server_writers: list[asyncio.StreamWriter] = []

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        server_writers.append(writer)
        await writer.drain()

    srv, url = await raw_server(large)
    pool = UpstreamPool(url, 2.0, 30.0)
    response = await pool.request(b"GET", "/large")
    # One read from the socket adds at most this (asyncio's selector transports read 256 KiB).
    bound = READ_HIGH_WATER + 256 * 1024
    deadline = asyncio.get_running_loop().time() + 20
    # Until the stream stalls: the client stopped reading and the server still holds unsent
    # bytes (the kernel's buffers in between are full). Without the pause the client reads on
    # and its buffer passes the bound instead.
    while not (
        response._connection.paused
        and server_writers
        and server_writers[0].transport.get_write_buffer_size() > 0
    ):
        assert response._buffered <= bound, f"{response._buffered} bytes buffered unread"
        assert asyncio.get_running_loop().time() < deadline, "the stream never stalled"
        await asyncio.sleep(0.01)
    assert response._buffered <= bound, f"{response._buffered} bytes buffered unread"
    # Reading on resumes the socket, and the whole answer arrives.
    assert await response.read() == body
    pool.close()
    srv.close()


async def test_connection_close_answers_are_not_pooled(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"], 2.0, 10.0)
    response = await pool.request(b"GET", "/close")
    assert await response.read() == b"bye"
    assert pool._idle == []
    pool.close()


async def test_an_answer_released_unread_closes_its_connection(server: dict[str, Any]) -> None:
    pool = UpstreamPool(server["url"], 2.0, 10.0)
    response = await pool.request(b"GET", "/big")
    response.release()
    assert pool._idle == []
    pool.close()


async def test_a_pooled_connection_the_server_closed_is_retried_on_a_fresh_one() -> None:
    connections = 0

    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # Keep-alive promised, then the server drops it: the next request finds it dead.
        await reader.read(1)
        writer.close()

    srv, url = await raw_server(once_then_close)
    pool = UpstreamPool(url, 2.0, 10.0)
    for _ in range(2):
        response = await pool.request(b"POST", "/v1/chat/completions", b"{}")
        assert await response.read() == b"ok"
    assert connections == 2
    pool.close()
    srv.close()


async def test_a_fresh_connection_closed_unanswered_is_not_retried_forever() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    srv, url = await raw_server(hang_up)
    upstream = Upstream(url, 2.0, 10.0)
    with pytest.raises(ProxyError) as caught:
        await upstream.post("chat.completions", b"{}")
    assert caught.value.status == 503
    assert caught.value.body()["error"]["code"] == "upstream_unavailable"
    srv.close()


async def test_an_answer_cut_short_fails_the_read() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial')
        await writer.drain()
        writer.close()

    srv, url = await raw_server(cut)
    pool = UpstreamPool(url, 2.0, 10.0)
    response = await pool.request(b"POST", "/v1/chat/completions", b"{}")
    assert response.status == 200
    with pytest.raises(UpstreamClosed):
        await response.read()
    pool.close()
    srv.close()


async def test_refused_is_a_503_and_not_ready() -> None:
    upstream = Upstream(f"http://127.0.0.1:{closed_port()}", 2.0, 10.0)
    assert not await upstream.check_health()
    with pytest.raises(ProxyError) as caught:
        await upstream.post("completions", b"{}")
    assert caught.value.status == 503 and not upstream.ready


async def test_no_answer_in_time_is_a_504() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    srv, url = await raw_server(silent)
    upstream = Upstream(url, 2.0, 0.3)
    with pytest.raises(ProxyError) as caught:
        await upstream.post("chat.completions", b"{}")
    assert caught.value.status == 504
    srv.close()


@pytest.mark.parametrize("url", ["127.0.0.1:8401", "ftp://host/", "http://"])
def test_a_base_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="vllm_url"):
        UpstreamPool(url, 2.0, 10.0)

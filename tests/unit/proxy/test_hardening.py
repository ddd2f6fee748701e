"""The proxy as uvicorn serves it (proxy/server.py, proxy/connection.py), attacked over raw
sockets: what an HTTP client library would refuse to send or would normalise away.

One server per module with short deadlines (0.5 s); the fake vLLM of conftest.py is not needed,
every case is answered before a request would reach it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from embedded.processes import free_port
from proxy.app import create_app
from proxy.server import ProxyServer, exposure_refusal, server_config
from ratchet.settings import RatchetSettings

DEADLINE_S = 0.5
SLACK_S = 5.0  # how much later than a deadline an answer may come on a loaded machine
HEAD_LIMIT = 4096


@dataclass
class Served:
    port: int
    state: Any
    server: ProxyServer


def settings_for(home: Path, **proxy: Any) -> RatchetSettings:
    return RatchetSettings(
        home=home,
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        vllm_url=f"http://127.0.0.1:{free_port()}",
        proxy={
            "port": free_port(),
            "header_timeout_s": DEADLINE_S,
            "body_timeout_s": DEADLINE_S,
            "keepalive_timeout_s": DEADLINE_S,
            "max_header_bytes": HEAD_LIMIT,
            **proxy,
        },
    )


@asynccontextmanager
async def serving(settings: RatchetSettings, host: str | None = None) -> AsyncIterator[Served]:
    app = create_app(settings)
    config = server_config(app, settings)
    config.timeout_graceful_shutdown = 1
    if host is not None:
        config.host = host
    server = ProxyServer(config, settings)
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 30
    while not server.started and not task.done():
        assert time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.02)
    try:
        yield Served(settings.proxy.port, app.state.ratchet, server)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("hardening")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("RATCHET_"):
                mp.delenv(name)
        mp.chdir(home)  # no ./ratchet.yaml here
        yield home


@pytest_asyncio.fixture(scope="module")
async def served(module_home: Path) -> AsyncIterator[Served]:
    async with serving(settings_for(module_home)) as running:
        yield running


async def talk(port: int, raw: bytes, trickle: bytes = b"", every_s: float = 0.05) -> bytes:
    """Send `raw`, then `trickle` a byte at a time; everything the server sends until it ends
    its side of the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def dribble() -> None:
        for byte in trickle:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)

    writer.write(raw)
    sender = asyncio.create_task(dribble())
    try:
        return await asyncio.wait_for(reader.read(), DEADLINE_S + SLACK_S)
    finally:
        sender.cancel()
        writer.close()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def assert_envelope(raw: bytes, status: int, code: str, closes: bool = True) -> dict[str, Any]:
    got, headers, body = parse(raw)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    assert "server" not in headers  # no software banner
    if closes:
        assert headers.get("connection") == "close"
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert "Traceback" not in error["message"] and "/" not in error["message"].split(" ")[0]
    return error


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

MALFORMED = {
    "not-http": b"GARBAGE\r\n\r\n",
    "space-in-header-name": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: y\r\n\r\n",
    "nul-in-header-value": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX: a\x00b\r\n\r\n",
    "folded-header": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n folded\r\n\r\n",
    "bare-lf": b"GET /healthz HTTP/1.1\nHost: 127.0.0.1\n\n",
    "bad-version": b"GET /healthz HTTP/7.1\r\nHost: 127.0.0.1\r\n\r\n",
    "nul-in-method": b"G\x00T /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "byte-ff-in-path": b"GET /\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "del-in-path": b"GET /h\x7fz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "http2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "cl-and-te": (
        b"POST /v1/feedback HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    ),
    "two-content-lengths": (
        b"POST /v1/feedback HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n"
    ),
    "content-length-abc": (
        b"POST /v1/feedback HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n"
    ),
    "bad-chunk-size": (
        b"POST /v1/feedback HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "te-gzip-only": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
}


def split_answers(raw: bytes) -> list[bytes]:
    """Responses written one after another (each with a Content-Length), in order."""
    answers = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw
        length = int(parse(head + sep)[1]["content-length"])
        answers.append(head + sep + rest[:length])
        raw = rest[length:]
    return answers


GARBAGE = b"GARBAGE\r\n\r\n"
PIPELINED = {
    "request-then-garbage": (HEALTHZ + GARBAGE, [(200, None)]),
    "two-requests-then-garbage": (HEALTHZ + HEALTHZ + GARBAGE, [(200, None), (200, None)]),
    # The body is longer than its Content-Length: the rest is read as the next request line.
    "body-longer-than-content-length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: 4\r\n\r\nnopeJUNK-JUNK\r\n\r\n",
        [(400, "invalid_json")],
    ),
    # The next request's body framing breaks: that request never reaches the app.
    "request-then-broken-body": (
        HEALTHZ + MALFORMED["bad-chunk-size"],
        [(200, None)],
    ),
}


@pytest.mark.parametrize(("raw", "first"), PIPELINED.values(), ids=PIPELINED.keys())
async def test_pipelined_requests_are_answered_before_the_400(
    served: Served, caplog: pytest.LogCaptureFixture, raw: bytes, first: list[Any]
) -> None:
    """Valid requests and bad bytes in one read: the valid ones are answered first, in order,
    then the 400 envelope, then the connection ends; no traceback (uvicorn wrote the 400 at
    once, the client took it for the answer to its valid request, and the late answer failed
    with "Cannot call write() after write_eof()", twice logged)."""
    uvicorn_error = logging.getLogger("uvicorn.error")  # does not propagate to the root logger
    uvicorn_error.addHandler(caplog.handler)
    try:
        answers = split_answers(await talk(served.port, raw))  # up to the end of the connection
        # A late answer fails (and logs) in its request task: wait until the server has no
        # connection and no request task left, so every answer it would write has been tried.
        state = served.server.server_state
        deadline = time.monotonic() + 10
        while state.connections or state.tasks:
            assert time.monotonic() < deadline, (state.connections, state.tasks)
            await asyncio.sleep(0.01)
    finally:
        uvicorn_error.removeHandler(caplog.handler)
    assert len(answers) == len(first) + 1, answers
    for answer, (status, code) in zip(answers, first, strict=False):
        if code is None:
            assert parse(answer)[0] == status, answer
        else:
            assert_envelope(answer, status, code, closes=False)
    assert_envelope(answers[-1], 400, "invalid_http")
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert not tracebacks, caplog.text
    assert "write_eof" not in caplog.text


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_parser_errors_get_the_envelope(served: Served, raw: bytes) -> None:
    assert_envelope(await talk(served.port, raw), 400, "invalid_http")


async def test_head_larger_than_the_limit_in_one_read_is_431(served: Served) -> None:
    raw = (
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 2 * HEAD_LIMIT + b"\r\n\r\n"
    )
    error = assert_envelope(await talk(served.port, raw), 431, "headers_too_large")
    assert "proxy.max_header_bytes" in error["message"]


async def test_endless_head_is_431_before_it_ends(served: Served) -> None:
    """Header bytes keep coming and never end: refused once past the limit, not buffered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
    answer = asyncio.create_task(reader.read())  # ends when the server ends its side
    sent = 0
    try:
        while not answer.done() and sent < 64 << 20:
            writer.write(b"a" * 8192)
            await writer.drain()
            sent += 8192
    except ConnectionError:
        pass  # the server stopped reading: fine, its answer is what counts
    assert_envelope(await asyncio.wait_for(answer, SLACK_S), 431, "headers_too_large")
    writer.close()
    assert sent < 16 << 20


@pytest.mark.parametrize(
    ("raw", "trickle"),
    [
        (b"GET /heal", b""),  # half a request line, then nothing
        (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n", b""),  # headers never end
        (b"", b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400),  # byte by byte
    ],
    ids=["half-line", "unfinished-headers", "trickled-headers"],
)
async def test_slow_head_gets_408(served: Served, raw: bytes, trickle: bytes) -> None:
    started = time.monotonic()
    error = assert_envelope(await talk(served.port, raw, trickle), 408, "request_timeout")
    assert "proxy.header_timeout_s" in error["message"]
    assert DEADLINE_S * 0.8 <= time.monotonic() - started < DEADLINE_S + SLACK_S


async def test_idle_connection_is_closed(served: Served) -> None:
    started = time.monotonic()
    assert await talk(served.port, b"") == b""  # closed without a word
    assert time.monotonic() - started >= DEADLINE_S * 0.8


async def test_idle_keepalive_connection_is_closed(served: Served) -> None:
    answer = await talk(served.port, HEALTHZ)
    assert parse(answer)[0] == 200
    # The next request's first bytes, then nothing: 408 after the 200.
    answer = await talk(served.port, HEALTHZ + b"GET /hea")
    first, _, rest = answer.partition(b"HTTP/1.1 408")
    assert parse(first)[0] == 200 and rest


async def test_trickled_body_gets_408_and_nothing_leaks(served: Served) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n{"
    )
    started = time.monotonic()
    error = assert_envelope(await talk(served.port, head, b" " * 400), 408, "request_timeout")
    assert "proxy.body_timeout_s" in error["message"]
    assert time.monotonic() - started < DEADLINE_S + SLACK_S
    assert served.state.metrics.in_flight._value.get() == 0
    assert parse(await talk(served.port, HEALTHZ))[0] == 200


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999\r\n\r\nab", 200),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b"\r\nContent-Length: 99999999\r\n\r\nab",
            413,
        ),
    ],
    ids=["answered-without-reading", "declared-too-large"],
)
async def test_unread_body_is_cut_off(served: Served, head: bytes, status: int) -> None:
    """The app answered at once; the body it never read still trickles: the connection ends
    after the body deadline instead of discarding it for ever."""
    started = time.monotonic()
    answer = await talk(served.port, head, b" " * 400)
    assert parse(answer)[0] == status
    assert time.monotonic() - started < DEADLINE_S + SLACK_S


@pytest.mark.parametrize("path", ["/v1/models/", "/healthz/", "/openapi.json", "/docs", "/redoc"])
async def test_no_redirects_and_no_docs(served: Served, path: str) -> None:
    raw = f"GET {path} HTTP/1.1\r\nHost: evil.localhost\r\n\r\n".encode()
    answer = await talk(served.port, raw)
    assert_envelope(answer, 404, "not_found", closes=False)
    assert b"location" not in answer.lower() and b"evil" not in answer


@pytest.mark.parametrize("depth", [65, 300, 2000])
async def test_deep_json_is_400_never_500(served: Served, depth: int) -> None:
    body = b'{"model":"support","messages":' + b"[" * depth + b"]" * depth + b"}"
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    error = assert_envelope(await talk(served.port, raw), 400, "json_too_deep")
    assert "proxy.max_json_depth" in error["message"]
    assert served.state.metrics.in_flight._value.get() == 0


async def test_websocket_upgrade_is_served_as_plain_http(served: Served) -> None:
    raw = (
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    assert parse(await talk(served.port, raw))[0] == 200


# ---- Host, without keys: DNS rebinding ----------------------------------------------------------

# Names a web page can point at 127.0.0.1 after it loaded, and send as Host.
REBOUND_HOSTS = [
    b"evil.example",
    b"evil.example:8400",
    b"127.0.0.1.nip.io",
    b"localhost.evil.example",
    b"0.0.0.0:8400",
    b"[::ffff:127.0.0.1]",
    b"",
]


def get_healthz(host: bytes | None) -> bytes:
    line = b"" if host is None else b"Host: " + host + b"\r\n"
    return b"GET /healthz HTTP/1.1\r\n" + line + b"\r\n"


@pytest.mark.parametrize("host", REBOUND_HOSTS, ids=[h.decode() or "empty" for h in REBOUND_HOSTS])
async def test_keyless_proxy_refuses_other_hosts(served: Served, host: bytes) -> None:
    error = assert_envelope(await talk(served.port, get_healthz(host)), 421, "misdirected_request")
    assert "proxy.api_keys" in error["message"]


async def test_keyless_proxy_refuses_a_rebound_post_before_its_body(served: Served) -> None:
    raw = (
        b"POST /v1/feedback HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999\r\n\r\n{"
    )
    assert_envelope(await talk(served.port, raw), 421, "misdirected_request")
    assert served.state.metrics.in_flight._value.get() == 0


@pytest.mark.parametrize(
    "host",
    [
        b"localhost",
        b"LocalHost:8400",
        b"127.0.0.1:1",
        b"127.1.2.3",
        b"[::1]:8400",
        b"app.localhost",
    ],
)
async def test_keyless_proxy_serves_loopback_hosts(served: Served, host: bytes) -> None:
    assert parse(await talk(served.port, get_healthz(host)))[0] == 200


async def test_keyless_proxy_serves_a_request_without_host(served: Served) -> None:
    # HTTP/1.0 probes send none; no browser does.
    assert parse(await talk(served.port, b"GET /healthz HTTP/1.0\r\n\r\n"))[0] == 200


async def test_a_rebound_request_after_a_good_one_gets_421_after_its_200(served: Served) -> None:
    answers = split_answers(await talk(served.port, HEALTHZ + get_healthz(b"evil.example")))
    assert [parse(a)[0] for a in answers] == [200, 421]


async def test_a_proxy_with_keys_serves_any_host(tmp_path: Path) -> None:
    async with serving(settings_for(tmp_path, api_keys=["sk-1"])) as running:
        assert parse(await talk(running.port, get_healthz(b"api.example.com")))[0] == 200


async def test_over_the_concurrency_limit_is_a_503_envelope(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, max_concurrency=2, header_timeout_s=30)
    async with serving(settings) as running:
        idle = [await asyncio.open_connection("127.0.0.1", running.port) for _ in range(2)]
        try:
            error = assert_envelope(await talk(running.port, HEALTHZ), 503, "overloaded")
            assert "proxy.max_concurrency" in error["message"]
        finally:
            for _, writer in idle:
                writer.close()


# ---- the loopback rule, on the sockets actually bound -------------------------------------------


def bound(family: socket.AddressFamily, host: str) -> Any:
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()


def test_exposure_refusal_reads_bound_addresses(tmp_path: Path) -> None:
    no_keys = settings_for(tmp_path)
    refusal = exposure_refusal(no_keys, [bound(socket.AF_INET, "0.0.0.0")])
    assert refusal is not None
    assert "proxy.api_keys" in refusal and "proxy.host" in refusal and "0.0.0.0" in refusal
    assert exposure_refusal(no_keys, [bound(socket.AF_INET, "127.0.0.1")]) is None
    assert exposure_refusal(no_keys, [("::1", 8400, 0, 0), ("::ffff:127.0.0.1", 1, 0, 0)]) is None
    assert exposure_refusal(no_keys, [("127.0.0.1", 1), ("10.1.2.3", 1)]) is not None
    with_keys = settings_for(tmp_path, api_keys=["sk-1"])
    assert exposure_refusal(with_keys, [bound(socket.AF_INET, "0.0.0.0")]) is None


async def test_server_bound_to_a_public_address_without_keys_refuses(tmp_path: Path) -> None:
    # The settings say loopback (so the settings check passes); the socket says otherwise.
    settings = settings_for(tmp_path)
    async with serving(settings, host="0.0.0.0") as running:
        assert running.server.refusal is not None
        assert "proxy.api_keys" in running.server.refusal
        assert running.server.should_exit
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", running.port)

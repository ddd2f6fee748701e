"""A raw-socket HTTP/1.1 client for hostile-client tests: it sends exactly the bytes it is given
(an HTTP library would fix a bad request line, refuse a header byte, or add Host and
Content-Length on its own) and reads back every answer on the connection, however it ends."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

# What no answer of the proxy may contain: a Python traceback, or the paths of its code.
LEAK_MARKERS = (b"Traceback", b"/work/", b'.py"', b".py:", b"site-packages", b'File "')
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@dataclass
class Answer:
    """One HTTP response as read from the socket."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Exchange:
    """Everything one connection gave back: its answers, the bytes it sent, and how it ended."""

    answers: list[Answer] = field(default_factory=list)
    raw: bytes = b""
    closed: bool = False  # the server ended the connection (else: our read deadline passed)
    elapsed_s: float = 0.0
    first_byte_s: float | None = None  # when the first byte of an answer came

    @property
    def first(self) -> Answer:
        assert self.answers, f"no answer; the connection gave {self.raw[:200]!r}"
        return self.answers[0]


def request_bytes(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
    host: str = "127.0.0.1",
) -> bytes:
    """A well-formed HTTP/1.1 request (Host, and Content-Length for a body) with extra headers."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    items = headers.items() if isinstance(headers, dict) else headers or []
    lines += [f"{name}: {value}" for name, value in items]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def exchange(
    port: int,
    parts: list[bytes | float],
    read_timeout_s: float = 30.0,
    expect: int = 1,
    head: bool = False,
) -> Exchange:
    """Send ``parts`` on one connection (a float is a pause, in seconds, between sends), then read
    until ``expect`` whole answers came, the server closed, or ``read_timeout_s`` passed. What
    arrives during the pauses is read as it comes (its time is ``first_byte_s``), and sending
    stops once the server has answered or closed. ``head``: answers to HEAD requests, which have
    no body."""
    result = Exchange()
    started = time.monotonic()
    deadline = started + read_timeout_s
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        for part in parts:
            if result.closed or len(list(parse_answers(result.raw, head))) >= expect:
                break
            if isinstance(part, float):
                time.sleep(part)
                _read_ready(sock, result, started)
            else:
                try:
                    sock.sendall(part)
                except OSError:  # the server answered and closed while we were still sending
                    result.closed = True
        while not result.closed:
            result.answers = list(parse_answers(result.raw, head))
            remaining = deadline - time.monotonic()
            if len(result.answers) >= expect or remaining <= 0:
                break
            sock.settimeout(remaining)
            _receive(sock, result, started)
    result.answers = list(parse_answers(result.raw, head))
    result.elapsed_s = time.monotonic() - started
    return result


def _read_ready(sock: socket.socket, result: Exchange, started: float) -> None:
    """Whatever the server sent so far, without waiting."""
    while not result.closed and select.select([sock], [], [], 0)[0]:
        _receive(sock, result, started)


def _receive(sock: socket.socket, result: Exchange, started: float) -> None:
    try:
        chunk = sock.recv(65536)
    except TimeoutError:
        return
    except ConnectionResetError:
        result.closed = True
        return
    if not chunk:
        result.closed = True
        return
    if result.first_byte_s is None:
        result.first_byte_s = time.monotonic() - started
    result.raw += chunk


def parse_answers(raw: bytes, head: bool = False) -> Iterator[Answer]:
    """The whole responses in ``raw``, in order (a trailing incomplete one is left out)."""
    at = 0
    while True:
        end = raw.find(b"\r\n\r\n", at)
        if end < 0:
            return
        lines = raw[at:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = [
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in lines[1:])
        ]
        at = end + 4
        found = dict(headers)
        if head or status in (100, 204, 304):
            yield Answer(status, headers, b"")
            continue
        if found.get("transfer-encoding", "").lower() == "chunked":
            body, at_after = _dechunk(raw, at)
            if at_after is None:
                return
            at = at_after
        else:
            length = int(found.get("content-length", "0"))
            if len(raw) < at + length:
                return
            body, at = raw[at : at + length], at + length
        yield Answer(status, headers, body)


def _dechunk(raw: bytes, at: int) -> tuple[bytes, int | None]:
    body = b""
    while True:
        line_end = raw.find(b"\r\n", at)
        if line_end < 0:
            return body, None
        size = int(raw[at:line_end].split(b";")[0], 16)
        at = line_end + 2
        if len(raw) < at + size + 2:
            return body, None
        body += raw[at : at + size]
        at += size + 2
        if size == 0:
            return body, at


def envelope_problems(answer: Answer) -> list[str]:
    """Why this non-2xx answer is not the OpenAI error envelope (empty: it is)."""
    if not answer.body:
        return ["empty body"]
    if not (answer.header("content-type") or "").startswith("application/json"):
        return [f"content-type {answer.header('content-type')!r}"]
    try:
        body = answer.json()
    except orjson.JSONDecodeError:
        return [f"not JSON: {answer.body[:200]!r}"]
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(error, dict):
        return [f"not an envelope: {body!r}"[:300]]
    problems = []
    if set(error) != ENVELOPE_KEYS:
        problems.append(f"error keys {sorted(error)}")
    if not isinstance(error.get("message"), str) or not error["message"]:
        problems.append("no message")
    if not isinstance(error.get("type"), str):
        problems.append("no type")
    for name in ("param", "code"):
        if error.get(name) is not None and not isinstance(error[name], str):
            problems.append(f"{name} is {error[name]!r}")
    return problems


def leaks(raw: bytes) -> list[bytes]:
    return [marker for marker in LEAK_MARKERS if marker in raw]


# ---- requests as cases send them ----------------------------------------------------------------


@dataclass(frozen=True)
class Proxy:
    """One proxy under test: its port, the client key cases send unless they say otherwise, and
    the key of its normal request."""

    name: str
    port: int
    key: str | None
    admin_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


USE_PROXY_KEY = "\0proxy key"  # a case's key unless it names one (None: send no key)
OMIT = object()  # a field a case leaves out of the normal body
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ALIAS = "support"
MESSAGES = [{"role": "user", "content": "Say hi."}]

Send = Callable[[Any, Proxy], Exchange]  # (the test's environment, the proxy) -> what came back


def auth_headers(proxy: Proxy, key: str | None) -> dict[str, str]:
    key = proxy.key if key == USE_PROXY_KEY else key
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def raw(
    *parts: bytes | float, expect: int = 1, timeout_s: float = 15.0, head: bool = False
) -> Send:
    """Exactly these bytes (floats: pauses)."""
    return lambda env, proxy: exchange(proxy.port, list(parts), timeout_s, expect, head)


def http(
    method: str,
    path: str,
    body: bytes | None = None,
    key: str | None = USE_PROXY_KEY,
    headers: dict[str, str] | None = None,
    head: bool = False,
) -> Send:
    """A well-formed request with the proxy's key (or ``key``)."""

    def send(env: Any, proxy: Proxy) -> Exchange:
        all_headers = {**auth_headers(proxy, key), **(headers or {})}
        return exchange(proxy.port, [request_bytes(method, path, body, all_headers)], head=head)

    return send


def post(path: str, body: Any, key: str | None = USE_PROXY_KEY, **headers: str) -> Send:
    """POST a JSON body (bytes are sent as they are)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return http("POST", path, data, key, {"Content-Type": "application/json", **headers})


def chat_body(**fields: Any) -> dict[str, Any]:
    body = {"model": ALIAS, "max_tokens": 1, "messages": MESSAGES, **fields}
    return {name: value for name, value in body.items() if value is not OMIT}


OK_BODY = orjson.dumps(chat_body())


def swap(old: bytes, new: bytes) -> bytes:
    """OK_BODY with one piece replaced (for bytes no JSON encoder would write)."""
    assert old in OK_BODY
    return OK_BODY.replace(old, new)


def chat(key: str | None = USE_PROXY_KEY, **fields: Any) -> Send:
    """A small chat request with ``fields`` changed (OMIT removes one)."""
    return post(CHAT, chat_body(**fields), key)


def completion(**fields: Any) -> Send:
    body = {"model": ALIAS, "max_tokens": 1, "prompt": "Say hi.", **fields}
    return post(COMPLETIONS, {k: v for k, v in body.items() if v is not OMIT})


def nested(levels: int, closed: bool = True) -> bytes:
    """A chat body whose ``metadata`` field nests ``levels`` lists deep (the body itself is 1)."""
    inner = b"[" * (levels - 1) + (b"]" * (levels - 1) if closed else b"")
    return b'{"model":"support","messages":[],"metadata":' + inner + (b"}" if closed else b"")


def head(method: str, path: str, *lines: bytes) -> bytes:
    """A request head with exactly these header lines after Host (this machine's: the open
    proxy refuses any other), and nothing added."""
    request_line = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    return request_line + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def authorized(authorization: bytes, path: str = "/v1/models") -> Send:
    """GET ``path`` with exactly this Authorization header value."""
    return raw(head("GET", path, b"Authorization: " + authorization))


def post_head(path: str, length: int | None, *lines: bytes, key: str) -> bytes:
    """A JSON POST head with the key, Content-Length ``length`` (None: none) and ``lines``."""
    framing = [b"Content-Length: %d" % length] if length is not None else []
    auth = b"Authorization: Bearer " + key.encode()
    return head("POST", path, auth, b"Content-Type: application/json", *framing, *lines)


def chunked(key: str, *pieces: bytes, end: bool = True) -> bytes:
    """A chat request whose body comes in these chunks (``end``: then the last chunk)."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    framing = post_head(CHAT, None, b"Transfer-Encoding: chunked", key=key)
    return framing + body + (b"0\r\n\r\n" if end else b"")


def trickled(data: bytes, pause_s: float = 0.25) -> list[bytes | float]:
    """``data`` one byte at a time."""
    return [part for byte in data for part in (bytes([byte]), pause_s)]


def left_early(stream: bool) -> Send:
    """A client that leaves before its answer is whole (``stream``: after its first bytes), then
    the proxy's next answer on a new connection: nothing of the first may be left in flight."""

    def send(env: Any, proxy: Proxy) -> Exchange:
        body = orjson.dumps(chat_body(max_tokens=48, stream=stream))
        headers = {"Content-Type": "application/json", **auth_headers(proxy, USE_PROXY_KEY)}
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(request_bytes("POST", CHAT, body, headers))
            if stream:
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        return exchange(proxy.port, [request_bytes("GET", "/v1/models", None, headers)])

    return send

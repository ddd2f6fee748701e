"""One key's requests in flight and their parse memory, bounded per replica (proxy/inflight.py,
security audit M-2), against the real stack: a proxy beside the session's with small bounds, and
streams the real vLLM is still generating holding the key's slots."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import ALIAS, Embedded
from tests.integration.side_proxy import side_proxy

pytestmark = pytest.mark.integration

KEY, OTHER = "sk-inflight-a", "sk-inflight-b"
BOUNDS = {"max_in_flight": 2, "max_parse_bytes": 1024 * 1024}
# Long enough that the streams outlast the checks made while they run, on any host.
LONG: dict[str, Any] = {"max_tokens": 1800, "ignore_eos": True, "stream": True}
# A receive window of a few KB that the test never reads: once the pipe between them is full
# the proxy waits to write (uvicorn's flow control), so the stream stays in flight until the
# client leaves, however fast vLLM generates.
SMALL_WINDOW = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]


def chat(content: str = "Say hi.", **fields: Any) -> dict[str, Any]:
    return {"model": ALIAS, "messages": [{"role": "user", "content": content}], **fields}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@contextlib.contextmanager
def streaming(url: str, key: str) -> Iterator[None]:
    """A stream of the key's that vLLM is generating: in flight until the block ends, when the
    client leaves it."""
    transport = httpx.HTTPTransport(socket_options=SMALL_WINDOW)
    with (
        httpx.Client(base_url=url, timeout=60, transport=transport) as client,
        client.stream("POST", "/v1/chat/completions", json=chat(**LONG), headers=auth(key)) as s,
    ):
        assert s.status_code == 200
        events = s.iter_raw()  # kept: a dropped iterator closes the response, and the stream
        next(events)  # its first event: the proxy is relaying it
        yield


def refused(answer: httpx.Response, status: int, code: str, setting: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and setting in error["message"]


def test_a_key_past_its_bounds_gets_429_or_413_and_its_slots_come_back(
    base_route: Embedded, tmp_path: Path
) -> None:
    keys: dict[str, Any] = {"api_keys": [KEY, OTHER], "rate_limit": BOUNDS}
    with side_proxy(base_route, tmp_path, **keys) as url, httpx.Client(base_url=url) as client:
        with streaming(url, KEY):
            # A second body whose parse would pass the key's memory (100 KB: 2.6 MB charged).
            big = client.post("/v1/chat/completions", json=chat("x" * 100_000), headers=auth(KEY))
            refused(big, 413, "parse_memory_exceeded", "proxy.rate_limit.max_parse_bytes")
            with streaming(url, KEY):
                third = client.post("/v1/chat/completions", json=chat(), headers=auth(KEY))
                refused(third, 429, "too_many_requests_in_flight", "max_in_flight")
                assert third.headers["retry-after"] == "1"
                other = client.post(
                    "/v1/chat/completions", json=chat(max_tokens=2), headers=auth(OTHER)
                )
                assert other.status_code == 200, other.text  # per key
        metrics = client.get("/metrics").text
        for limit in ("max_in_flight", "max_parse_bytes"):
            assert f'ratchet_proxy_ratelimit_refused_total{{limit="{limit}"}} 1.0' in metrics
        # The streams' clients left: their slots come back (one `finally`), the key is served.
        deadline = time.monotonic() + 60
        while True:
            again = client.post(
                "/v1/chat/completions", json=chat(max_tokens=2), headers=auth(KEY), timeout=60
            )
            if again.status_code == 200:
                break
            assert again.status_code == 429 and time.monotonic() < deadline, again.text
            time.sleep(0.2)

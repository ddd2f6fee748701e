"""The overview's health line: the proxy and vLLM are asked at once (a part that hangs costs the
page one timeout, not one per part), only vLLM gets vLLM's key, and Kafka's state is what the
proxy's metrics say."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from console.app import create_app
from console.health import CHECK_TIMEOUT_S
from ratchet.settings import RatchetSettings


class Parts(ThreadingHTTPServer):
    """The proxy (/healthz, /metrics) and vLLM (/health) on one port. A health check is
    answered only once both have arrived: asked one after the other, the first times out."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), PartHandler)
        self.both_asked = threading.Barrier(2, timeout=10 * CHECK_TIMEOUT_S)
        self.authorization: dict[str, str | None] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class PartHandler(BaseHTTPRequestHandler):
    server: Parts

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self.answer(200, b"ratchet_proxy_kafka_up 1.0\n")
            return
        self.server.authorization[self.path] = self.headers.get("authorization")
        try:
            self.server.both_asked.wait()
        except threading.BrokenBarrierError:
            self.answer(503, b"alone")
            return
        self.answer(200, b"ok")

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def parts() -> Iterator[Parts]:
    server = Parts()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.both_asked.abort()  # a handler still waiting returns now
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_the_overview_asks_the_proxy_and_vllm_together(
    parts: Parts, redis_url: str, tmp_path: Path
) -> None:
    settings = RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        secret="a-test-secret",
        vllm_url=parts.url,
        console={"proxy_url": parts.url},
        aliases={"support": {}},
    )
    client = TestClient(create_app(settings, start_readers=False), base_url="http://127.0.0.1")
    html = client.get("/live").text
    for part in ("Redis", "proxy", "vLLM", "Kafka"):
        assert f"{part}: up" in html, (part, html[:600])
    # Neither needs a key, and the console sends vLLM's to nobody (it is not given one).
    assert parts.authorization == {"/healthz": None, "/health": None}

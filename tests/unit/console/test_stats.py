"""The overview's throughput: counters read from a metrics page, and their increase over a
window of samples (a restarted service's counter starting again from zero)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from console import stats
from console.stats import Counts, ThroughputReader, counts_of, increase, summed_increase
from ratchet.settings import RatchetSettings

PAGE = """# HELP ratchet_proxy_requests_total Requests
# TYPE ratchet_proxy_requests_total counter
ratchet_proxy_requests_total{alias="a",version="0",arm="active",endpoint="chat",status="200"} 7.0
ratchet_proxy_requests_total{alias="a",version="1",arm="canary",endpoint="chat",status="200"} 3.0
ratchet_proxy_requests_total{alias="b",version="0",arm="active",endpoint="chat",status="429"} 2.0
# HELP ratchet_proxy_other_total Other
# TYPE ratchet_proxy_other_total counter
ratchet_proxy_other_total{alias="a"} 100.0
"""


def test_counters_are_summed_per_alias_over_their_other_labels() -> None:
    counts = counts_of(PAGE, {"ratchet_proxy_requests_total": "requests"})
    assert counts == {("requests", "a", "-"): 10.0, ("requests", "b", "-"): 2.0}


def samples(*points: tuple[float, float]) -> deque[tuple[float, Counts]]:
    return deque((t, {("requests", "a", "-"): v}) for t, v in points)


@pytest.mark.parametrize(
    ("points", "window", "expected"),
    [
        (((0, 5), (30, 9), (60, 20)), 60, 15),  # the whole minute
        (((0, 5), (30, 9), (60, 20)), 30, 11),  # the last 30 s
        (((0, 5), (3000, 50), (3660, 70)), 3600, 20),  # older samples are outside the hour
        (((0, 50), (30, 4)), 60, 4),  # restarted: counted from zero
        (((0, 5),), 60, None),  # one sample: no increase yet
    ],
)
def test_increase_over_a_window(
    points: tuple[tuple[float, float], ...], window: float, expected: float | None
) -> None:
    assert increase(samples(*points), ("requests", "a", "-"), window) == expected


def test_a_counter_missing_from_the_last_scrape_is_unknown() -> None:
    kept = samples((0, 5), (30, 9))
    kept.append((60, {}))  # the proxy did not answer
    assert increase(kept, ("requests", "a", "-"), 60) is None


async def test_the_proxys_metrics_are_read_with_the_admin_key_and_a_refusal_is_no_count(
    tmp_path: Path,
) -> None:
    """Off loopback the proxy's /metrics needs the admin key: the console sends it, and an
    error page (a 401 envelope) is a missing sample, never parsed as counts."""
    seen: list[str | None] = []

    def answer(headers: Any, _: str) -> tuple[int, bytes]:
        seen.append(headers.get("authorization"))
        if headers.get("authorization") == "Bearer sk-admin-0123456789":
            return 200, PAGE.encode()
        return 401, b'{"error": {"message": "needs the admin key"}}'

    server = metrics_server("127.0.0.1", 0, answer)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        keyed = RatchetSettings(home=tmp_path, proxy={"admin_key": "sk-admin-0123456789"})
        assert (await ThroughputReader(keyed, url).scrape())[("requests", "a", url)] == 10.0
        assert await ThroughputReader(RatchetSettings(home=tmp_path), url).scrape() == {}
    finally:
        server.shutdown()
    assert seen == ["Bearer sk-admin-0123456789", None]


def test_replicas_restart_on_their_own_and_their_increases_add_up() -> None:
    """Two proxies: one restarts (its counter from zero) while the other goes on."""
    kept: deque[tuple[float, Counts]] = deque(
        [
            (0, {("requests", "a", "p1"): 100, ("requests", "a", "p2"): 40}),
            (60, {("requests", "a", "p1"): 5, ("requests", "a", "p2"): 70}),
        ]
    )
    # p1 restarted: 5 since; p2: 30. Summed over the pooled counter it would read 75 - 140 < 0.
    assert summed_increase(kept, "requests", "a", 60) == 35
    assert summed_increase(kept, "requests", "b", 60) is None


async def test_every_replica_a_name_resolves_to_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Kubernetes a headless Service's name resolves to every ready pod; each is read (a
    Service's one address would reach one replica per scrape, at random)."""
    pages = {"127.0.0.1": PAGE, "127.0.0.2": PAGE.replace(" 7.0", " 17.0")}

    def answer(_: Any, address: str) -> tuple[int, bytes]:
        return 200, pages[address].encode()

    first = metrics_server("127.0.0.1", 0, answer)
    port = first.server_address[1]
    second = metrics_server("127.0.0.2", port, answer)
    monkeypatch.setattr(
        stats, "addresses", lambda host, _: list(pages) if "replicas" in host else []
    )
    url = f"http://proxy-replicas.ml.svc:{port}"
    try:
        settings = RatchetSettings(home=tmp_path, console={"proxy_metrics_url": url})
        reader = ThroughputReader(settings, "http://unused:1")
        counts = await reader.scrape()
    finally:
        first.shutdown()
        second.shutdown()
    assert counts[("requests", "a", f"http://127.0.0.1:{port}")] == 10.0
    assert counts[("requests", "a", f"http://127.0.0.2:{port}")] == 20.0


def metrics_server(
    host: str, port: int, answer: Callable[[Any, str], tuple[int, bytes]]
) -> ThreadingHTTPServer:
    """A /metrics stand-in on ``host:port`` (0: any), serving in a thread: ``answer(request
    headers, the address it listens on)`` gives each reply's status and body."""

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answer(self.headers, host)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

"""Throughput for the overview: traffic per alias over the last minute and hour, the judge's
groups and failures, and each consumer's lag.

Counts come from the services' own /metrics (the proxy's requests, the judge's groups and
failures), sampled at most every :data:`SAMPLE_S` and kept for an hour, so a window is the
difference of two samples ("since the console started" while it is younger than the window).
Every address a service's name resolves to is read (on Kubernetes a headless Service names
every replica): each replica's counters grow on their own and restart from zero on their own,
so a window's increase is taken per replica and summed. Lag is asked of Kafka (ratchet/bus.py).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ratchet.bus import consumer_lag
from ratchet.records import GROUPS_TOPIC, TRAFFIC_TOPIC
from ratchet.settings import RatchetSettings

SAMPLE_S = 5.0
SCRAPE_TIMEOUT_S = 1.0
FIRST_GAP_S = 1.0
LAG_S = 15.0
KEPT_S = 3600.0

Counts = dict[tuple[str, str, str], float]  # (metric, alias, replica address) -> value


@dataclass(frozen=True)
class AliasThroughput:
    requests_minute: float | None
    requests_hour: float | None
    groups_per_minute: float | None
    failures_hour: float | None


@dataclass
class Throughput:
    aliases: dict[str, AliasThroughput] = field(default_factory=dict)
    window_s: float = 0.0  # how far back the samples reach
    judge_lag: int | None = None  # traffic records the judge has not committed
    learner_lag: int | None = None  # groups the learner has not committed


def reachable(host: str) -> str:
    """The address to ask a service bound to ``host`` on: loopback for a wildcard bind."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def counts_of(text: str, metrics: dict[str, str], replica: str = "-") -> Counts:
    """Sum each wanted counter's samples per alias. ``metrics``: sample name -> short name."""
    found: Counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            short = metrics.get(sample.name)
            if short is not None:
                key = (short, sample.labels.get("alias", "-"), replica)
                found[key] = found.get(key, 0.0) + sample.value
    return found


def replicas(url: str) -> list[str]:
    """The base URL of every address ``url``'s host resolves to (one for a plain name or an
    address; every ready pod for a headless Service); ``url`` itself if it does not resolve."""
    parts = urlsplit(url)
    port = parts.port or 80
    found = addresses(parts.hostname or "", port)
    if len(found) <= 1:
        return [url]  # one replica: asked by name, as configured
    return [
        f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}{parts.path.rstrip('/')}"
        for a in found
    ]


def addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, sorted; none if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


async def _page(session: aiohttp.ClientSession, replica: str) -> str | None:
    """``replica``'s /metrics page; None if it does not answer it with a 200."""
    try:
        async with session.get(f"{replica}/metrics") as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


def summed_increase(
    samples: deque[tuple[float, Counts]], metric: str, alias: str, window_s: float
) -> float | None:
    """:func:`increase` of ``metric`` for ``alias``, per replica of the latest sample, summed."""
    if not samples:
        return None
    keys = [k for k in samples[-1][1] if k[0] == metric and k[1] == alias]
    grown = [increase(samples, key, window_s) for key in keys]
    known = [g for g in grown if g is not None]
    return sum(known) if known else None


def increase(
    samples: deque[tuple[float, Counts]], key: tuple[str, str, str], window_s: float
) -> float | None:
    """How much a counter grew over the last ``window_s`` (or all samples kept, if fewer); a
    counter that went down (a restarted service) counts from zero."""
    if len(samples) < 2:
        return None
    now, latest = samples[-1]
    if key not in latest:
        return None  # the service that counts it did not answer the last scrape
    base = next((c for t, c in samples if now - t <= window_s), samples[0][1])
    start, end = base.get(key, 0.0), latest.get(key, 0.0)
    return end - start if end >= start else end


class ThroughputReader:
    def __init__(self, settings: RatchetSettings, proxy_url: str) -> None:
        self.settings = settings
        console, judge = settings.console, settings.judge
        self.proxy_url = (console.proxy_metrics_url or proxy_url).rstrip("/")
        self.judge_url = (
            console.judge_metrics_url
            or f"http://{reachable(judge.metrics_host)}:{judge.metrics_port}"
        ).rstrip("/")
        # Off loopback the proxy's /metrics needs the admin key (proxy.metrics_auth); the
        # judge's ignores it.
        admin = settings.proxy.admin_key
        self.auth = {"authorization": f"Bearer {admin.get_secret_value()}"} if admin else {}
        self.samples: deque[tuple[float, Counts]] = deque()
        self.lag_checked = 0.0
        self.lags: tuple[int | None, int | None] = (None, None)
        self.lag_thread: threading.Thread | None = None
        # The overview and the health line read at once: one scrape serves both.
        self.sampling = asyncio.Lock()

    async def read(self) -> Throughput:
        async with self.sampling:
            now = time.monotonic()
            # The second sample comes after FIRST_GAP_S, not SAMPLE_S: a console just opened
            # shows counts within a second or two, not "-" for five.
            gap = FIRST_GAP_S if len(self.samples) == 1 else SAMPLE_S
            if not self.samples or now - self.samples[-1][0] >= gap:
                self.samples.append((now, await self.scrape()))
                while now - self.samples[0][0] > KEPT_S + SAMPLE_S:
                    self.samples.popleft()
        if now - self.lag_checked >= LAG_S and not (self.lag_thread and self.lag_thread.is_alive()):
            # Off the page's request: Kafka may take seconds to answer, or not answer at all.
            self.lag_checked = now
            self.lag_thread = threading.Thread(target=self.update_lag, daemon=True)
            self.lag_thread.start()
        span = self.samples[-1][0] - self.samples[0][0]
        result = Throughput(window_s=span, judge_lag=self.lags[0], learner_lag=self.lags[1])
        for alias in self.settings.aliases:
            groups = summed_increase(self.samples, "groups", alias, 60.0)
            minute = min(span, 60.0)
            result.aliases[alias] = AliasThroughput(
                requests_minute=summed_increase(self.samples, "requests", alias, 60.0),
                requests_hour=summed_increase(self.samples, "requests", alias, KEPT_S),
                groups_per_minute=groups * 60.0 / minute if groups is not None and minute else None,
                failures_hour=summed_increase(self.samples, "failures", alias, KEPT_S),
            )
        return result

    async def scrape(self) -> Counts:
        """One sample: every replica of the proxy and the judge, asked at once."""
        asked: list[tuple[str, dict[str, str]]] = []
        for url, metrics in (
            (
                self.proxy_url,
                {"ratchet_proxy_requests_total": "requests", "ratchet_proxy_kafka_up": "kafka_up"},
            ),
            (
                self.judge_url,
                {
                    "ratchet_judge_groups_total": "groups",
                    "ratchet_judge_failures_total": "failures",
                },
            ),
        ):
            found = await asyncio.to_thread(replicas, url)  # DNS blocks: off the event loop
            asked += [(replica, metrics) for replica in found]
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.auth) as session:
            pages = await asyncio.gather(*(_page(session, replica) for replica, _ in asked))
        counts: Counts = {}
        for (replica, metrics), page in zip(asked, pages, strict=True):
            if page is None:
                continue  # that replica is away: its counts are missing from this sample
            try:
                counts |= counts_of(page, metrics, replica)
            except ValueError:
                continue  # not a metrics page
        return counts

    def kafka_up(self) -> bool | None:
        """Whether every proxy replica's producer reaches Kafka, as of the last scrape (None:
        unknown)."""
        if not self.samples:
            return None
        up = [v for k, v in self.samples[-1][1].items() if k[:2] == ("kafka_up", "-")]
        return all(v > 0 for v in up) if up else None

    def update_lag(self) -> None:
        s = self.settings
        self.lags = (
            consumer_lag(
                s.kafka_bootstrap_servers, s.kafka, s.judge.consumer_group, TRAFFIC_TOPIC, 2.0
            ),
            consumer_lag(
                s.kafka_bootstrap_servers, s.kafka, s.learner.consumer_group, GROUPS_TOPIC, 2.0
            ),
        )

"""The proxy's Prometheus metrics, on their own registry so each app instance counts alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.log.pipe import TrafficLog
from proxy.routing import RoutingCache

# Sub-millisecond buckets at the low end: the proxy's own overhead lives there.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class CallMetrics(NamedTuple):
    """The children of one (alias, version, arm): looked up once, not on every request."""

    latency: Any
    upstream_latency: Any
    added_latency: Any
    ttft: Any


class ProxyMetrics:
    def __init__(self) -> None:
        self._calls: dict[tuple[str, str, str], CallMetrics] = {}
        self._requests: dict[tuple[str, ...], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("alias", "version", "arm")
        self.requests = Counter(
            "ratchet_proxy_requests_total",
            "Requests by alias, version, canary arm and status",
            (*labels, "endpoint", "status"),
            registry=r,
        )

        def histogram(name: str, doc: str, label_names: tuple[str, ...] = labels) -> Histogram:
            return Histogram(name, doc, label_names, buckets=_LATENCY_BUCKETS, registry=r)

        self.latency = histogram(
            "ratchet_proxy_request_seconds", "Total request latency seen by the proxy"
        )
        self.upstream_latency = histogram(
            "ratchet_proxy_upstream_seconds", "Time spent waiting on vLLM"
        )
        self.added_latency = histogram(
            "ratchet_proxy_added_seconds", "Latency the proxy adds on top of vLLM", ("alias",)
        )
        self.ttft = histogram(
            "ratchet_proxy_time_to_first_token_seconds", "Time to first streamed chunk"
        )
        self.tokens = Counter(
            "ratchet_proxy_tokens_total",
            "Tokens by direction (input, output)",
            (*labels, "direction"),
            registry=r,
        )
        self.in_flight = Gauge(
            "ratchet_proxy_in_flight_requests", "Requests being served now", registry=r
        )
        self.errors = Counter(
            "ratchet_proxy_errors_total",
            "Errors returned to clients by code",
            ("code",),
            registry=r,
        )
        self.upstream_up = Gauge(
            "ratchet_proxy_upstream_up", "1 when vLLM answers its health check", registry=r
        )
        self._add_replica_metrics(r)
        self._add_ratelimit_metrics(r)

    def _add_replica_metrics(self, r: CollectorRegistry) -> None:
        """Per vLLM replica (vllm_endpoints): where requests went, what is in flight on each, and
        whether it passes its health check; and whether the broker and Redis are reachable."""
        self.endpoint_requests = Counter(
            "ratchet_proxy_endpoint_requests_total",
            "Requests sent to each vLLM replica",
            ("endpoint",),
            registry=r,
        )
        self.endpoint_outstanding = Gauge(
            "ratchet_proxy_endpoint_outstanding",
            "Requests in flight on each vLLM replica",
            ("endpoint",),
            registry=r,
        )
        self.endpoint_up = Gauge(
            "ratchet_proxy_endpoint_up",
            "1 when the vLLM replica answers its health check",
            ("endpoint",),
            registry=r,
        )
        self._endpoint_children: dict[str, Any] = {}  # the counter's child per replica
        self._shown_endpoints: set[str] = set()
        self.kafka_up = Gauge(
            "ratchet_proxy_kafka_up", "1 when the traffic producer reaches the broker", registry=r
        )
        self.registry_up = Gauge(
            "ratchet_proxy_registry_up",
            "1 when the routing registry (Redis) is reachable",
            registry=r,
        )

    def _add_ratelimit_metrics(self, r: CollectorRegistry) -> None:
        """proxy.rate_limit: who was refused, and what the limiter could not check in Redis."""
        self.ratelimit_refused = Counter(
            "ratchet_proxy_ratelimit_refused_total",
            "Requests refused by the proxy.rate_limit setting they reached (429; 413 past "
            "max_parse_bytes, 503 past replica_max_parse_bytes)",
            ("limit",),
            registry=r,
        )
        self.ratelimit_overshoot = Counter(
            "ratchet_proxy_ratelimit_overshoot_total",
            "Requests served without waiting for Redis (their key far from its limits) that Redis "
            "then found over a limit: other replicas drained the key within one round trip",
            ("limit",),
            registry=r,
        )
        self.ratelimit_unavailable = Counter(
            "ratchet_proxy_ratelimit_unavailable_total",
            "Rate-limit work Redis did not do: admit = a request checked by its replica alone "
            "(or refused: budgets_without_redis closed), charge = takes or settlements sent to "
            "a failing Redis that may not have applied them",
            ("call",),
            registry=r,
        )

    def count_endpoint_request(self, url: str) -> None:
        child = self._endpoint_children.get(url)
        if child is None:
            child = self._endpoint_children[url] = self.endpoint_requests.labels(url)
        child.inc()

    def show_endpoints(self, states: dict[str, tuple[int, bool]]) -> None:
        """Each replica's requests in flight and health, at a scrape; a replica that left is
        dropped from the series, so pods that come and go do not pile up."""
        for url in (set(self._endpoint_children) | self._shown_endpoints) - set(states):
            for metric in (self.endpoint_requests, self.endpoint_outstanding, self.endpoint_up):
                with contextlib.suppress(KeyError):
                    metric.remove(url)
            self._endpoint_children.pop(url, None)
        for url, (outstanding, healthy) in states.items():
            self.endpoint_outstanding.labels(url).set(outstanding)
            self.endpoint_up.labels(url).set(1 if healthy else 0)
        self._shown_endpoints = set(states)

    def call(self, labels: tuple[str, str, str]) -> CallMetrics:
        found = self._calls.get(labels)
        if found is None:
            found = self._calls[labels] = CallMetrics(
                self.latency.labels(*labels),
                self.upstream_latency.labels(*labels),
                self.added_latency.labels(labels[0]),
                self.ttft.labels(*labels),
            )
        return found

    def count_request(self, labels: tuple[str, str, str], endpoint: str, status: int) -> None:
        key = (*labels, endpoint, str(status))
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(*key)
        counter.inc()

    def watch_log(self, traffic_log: TrafficLog, routing: RoutingCache) -> None:
        """Export the log worker's counts and the routing table's state, read at scrape time."""
        self.registry.register(_LogCollector(traffic_log, routing))


class _LogCollector(Collector):
    """The log worker's counters as it last reported them, and the routing table's age and
    invalid aliases, read at scrape time."""

    def __init__(self, traffic_log: TrafficLog, routing: RoutingCache) -> None:
        self.traffic_log = traffic_log
        self.routing = routing

    def collect(self) -> Iterator[Metric]:
        p = self.traffic_log
        records = CounterMetricFamily(
            "ratchet_proxy_log_records",
            "Traffic and feedback records by outcome: sent (acknowledged by Kafka), spooled "
            "(written to disk while Kafka was away), replayed (sent from the spool), dropped "
            "(lost: queue full or spool unwritable), dead_lettered (refused by the broker for "
            "what they are, e.g. too large: on ratchet.deadletter), recovered (left unsent in a "
            "killed log worker's journal, spooled by the next), resent (read by a log worker "
            "that was killed before making them durable, handed to the next)",
            labels=["outcome"],
        )
        for outcome, value in (
            ("sent", p.sent),
            ("spooled", p.spooled),
            ("replayed", p.replayed),
            ("dropped", p.dropped),
            ("dead_lettered", p.dead_lettered),
            ("recovered", p.recovered),
            ("resent", p.resent),
        ):
            records.add_metric([outcome], value)
        yield records
        dropped = CounterMetricFamily(
            "ratchet_proxy_log_dropped_records",
            "Dropped records (outcome=dropped above) by reason: spool_full (the spool holds "
            "proxy.spool_max_bytes while Kafka is away), worker_stuck (the frame a log worker "
            "was handling when it was replaced for confirming nothing in "
            "proxy.log_worker_stuck_s), other (log queue full, spool unwritable, a frame two log "
            "workers died holding)",
            labels=["reason"],
        )
        dropped.add_metric(["spool_full"], p.spool_full)
        dropped.add_metric(["worker_stuck"], p.stuck)
        dropped.add_metric(["other"], max(0, p.dropped - p.spool_full - p.stuck))
        yield dropped
        redaction = CounterMetricFamily(
            "ratchet_proxy_log_redaction_failed_records",
            "Records logged with strings replaced whole instead of redacted, by reason: budget "
            "(redacting the record took longer than proxy.redact_budget_s). Marked truncated, so "
            "the judge does not learn from them",
            labels=["reason"],
        )
        redaction.add_metric(["budget"], p.redact_over_budget)
        yield redaction
        yield GaugeMetricFamily(
            "ratchet_proxy_log_queue_depth",
            "Records accepted and not yet sent or spooled (pipe, proxy and log worker)",
            p.depth,
        )
        yield GaugeMetricFamily(
            "ratchet_proxy_log_spool_backlog_records",
            "Records on disk waiting for Kafka",
            p.spool_pending,
        )
        yield GaugeMetricFamily(
            "ratchet_proxy_registry_age_seconds",
            "Seconds since the routing table was last read from Redis",
            min(self.routing.age_s, 1e9),
        )
        yield GaugeMetricFamily(
            "ratchet_proxy_routing_invalid_aliases",
            "Aliases whose Redis hash is invalid: each keeps its last valid route",
            len(self.routing.invalid.now),
        )

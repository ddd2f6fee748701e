"""The proxy's Prometheus metrics, on their own registry so each app instance counts alone."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("alias", "version", "arm")
        self.requests = Counter(
            "ratchet_proxy_requests_total",
            "Requests by alias, version, canary arm and status",
            (*labels, "endpoint", "status"),
            registry=r,
        )
        self.latency = Histogram(
            "ratchet_proxy_request_seconds",
            "Total request latency seen by the proxy",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "ratchet_proxy_upstream_seconds",
            "Time spent waiting on vLLM",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.added_latency = Histogram(
            "ratchet_proxy_added_seconds",
            "Latency the proxy adds on top of vLLM",
            ("alias",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ratchet_proxy_time_to_first_token_seconds",
            "Time to first streamed chunk",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
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
        self.kafka_up = Gauge(
            "ratchet_proxy_kafka_up", "1 when the traffic producer reaches the broker", registry=r
        )
        self.registry_up = Gauge(
            "ratchet_proxy_registry_up",
            "1 when the routing registry (Redis) is reachable",
            registry=r,
        )

    def bind_log_state(
        self,
        depth: Callable[[], float],
        spooled: Callable[[], float],
        dropped: Callable[[], float],
        sent: Callable[[], float],
        registry_age: Callable[[], float],
    ) -> None:
        """Gauges read at scrape time from the producer and the routing cache."""
        r = self.registry
        Gauge(
            "ratchet_proxy_log_queue_depth", "Traffic records waiting for the producer", registry=r
        ).set_function(depth)
        Gauge(
            "ratchet_proxy_log_spooled_records",
            "Records written to the disk spool, total",
            registry=r,
        ).set_function(spooled)
        Gauge(
            "ratchet_proxy_log_dropped_records", "Records dropped (queue full), total", registry=r
        ).set_function(dropped)
        Gauge(
            "ratchet_proxy_log_sent_records", "Records acknowledged by Kafka, total", registry=r
        ).set_function(sent)
        Gauge(
            "ratchet_proxy_registry_age_seconds",
            "Seconds since the routing table was read",
            registry=r,
        ).set_function(registry_age)

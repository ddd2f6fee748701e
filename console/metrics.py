"""The console's own Prometheus metrics (served on its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class ConsoleMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "ratchet_console_requests_total",
            "HTTP requests, by route and status",
            ("route", "status"),
            registry=r,
        )
        self.actions = Counter(
            "ratchet_console_actions_total",
            "Admin actions, by action and outcome (applied, refused, unconfirmed, unauthorized)",
            ("action", "outcome"),
            registry=r,
        )
        self.events_dropped = Counter(
            "ratchet_console_events_dropped_total",
            "Lifecycle events of actions dropped while Kafka was away too long (still in Redis)",
            registry=r,
        )
        self.logins = Counter(
            "ratchet_console_logins_total", "Login attempts, by outcome", ("outcome",), registry=r
        )
        self.render_seconds = Histogram(
            "ratchet_console_render_seconds",
            "Time to read and render a page or fragment",
            ("template",),
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )

"""Each vLLM replica's faults as the proxy saw them (proxy/upstream.py), read at scrape time:
ejections, requests sent on after it could not take them, connections it refused or never
made, answers that stalled past the first-byte deadline or went silent mid-way; whether it
is ejected now, and the share of the fleet that is. A replica that left the fleet leaves the
series with it."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.upstream import Upstream

COUNTERS = (
    (
        "ratchet_proxy_endpoint_ejections",
        "Times each vLLM replica was ejected for failing requests in a row "
        "(proxy.outlier_ejection)",
    ),
    (
        "ratchet_proxy_endpoint_retries",
        "Requests that never reached this vLLM replica (no connection) and were sent to another",
    ),
    (
        "ratchet_proxy_endpoint_connect_failures",
        "Connections to this vLLM replica refused, unreachable or not made within "
        "proxy.upstream_connect_timeout_s",
    ),
    (
        "ratchet_proxy_endpoint_first_byte_timeouts",
        "Answers from this vLLM replica that sent nothing within "
        "proxy.upstream_first_byte_timeout_s of their 200 (a stalled engine): 504 upstream_stalled",
    ),
    (
        "ratchet_proxy_endpoint_stream_stalls",
        "Answers from this vLLM replica that went silent mid-way past "
        "proxy.upstream_stream_gap_timeout_s, its probe too (a stalled engine): upstream_stalled",
    ),
)


class FleetFaults(Collector):
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def collect(self) -> Iterator[Metric]:
        endpoints = self.upstream.endpoints
        outliers = self.upstream.outliers
        counters = [CounterMetricFamily(name, text, labels=["endpoint"]) for name, text in COUNTERS]
        ejected = GaugeMetricFamily(
            "ratchet_proxy_endpoint_ejected",
            "1 while the vLLM replica is ejected (left out of the choice of replica)",
            labels=["endpoint"],
        )
        now = time.monotonic()
        out = 0
        for url, endpoint in endpoints.items():
            record = outliers.replicas.get(url)
            values = (
                record.ejections if record is not None else 0,
                endpoint.retries,
                endpoint.connect_failures,
                endpoint.first_byte_timeouts,
                endpoint.stream_stalls,
            )
            for family, value in zip(counters, values, strict=True):
                family.add_metric([url], value)
            is_out = outliers.is_ejected(url, now)
            out += is_out
            ejected.add_metric([url], 1 if is_out else 0)
        yield from counters
        yield ejected
        yield GaugeMetricFamily(
            "ratchet_proxy_fleet_ejected_ratio",
            "The share of the vLLM replicas ejected now",
            value=out / len(endpoints) if endpoints else 0.0,
        )

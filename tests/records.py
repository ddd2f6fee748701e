"""Records the tests build: a TrafficRecord with every required field, any of them overridden."""

from __future__ import annotations

from typing import Any

from ratchet.records import TrafficRecord


def build_traffic_record(**overrides: Any) -> TrafficRecord:
    """A served chat exchange of alias ``support`` (request id ``r1``) unless overridden."""
    fields: dict[str, Any] = dict(
        request_id="r1",
        endpoint="chat.completions",
        alias="support",
        request_model="support",
        response_model="m",
        version=0,
        canary_arm="active",
        status=200,
        latency_ms=1.0,
        request={"messages": [{"role": "user", "content": "hi"}]},
    )
    fields.update(overrides)
    return TrafficRecord(**fields)

"""A fleet that heals itself, on the real stack: a proxy of its own in front of the session's vLLM,
a hung replica (its /health answers, its engine never does) and a blackholed one (it took
connections, then dropped off the network: a connect there times out). Fakes, for the two faults
vLLM cannot be made to have (bench/fleet_faults.py, which bench/fleet_routing.py uses too).

What must hold: a request sent to the blackholed replica is answered by another (a retry, as it
never reached one); the hung replica's requests end in 504 ``upstream_stalled`` at the
first-byte deadline (its probe, a one-token stream, sends nothing either), the traffic record
says so, and after ``consecutive_failures`` of them it is ejected and every later request is
answered; the per-replica counters say all of it. The probe that finds a stall is one the real
vLLM answers. A stream the hung replica wedges on mid-way (two events, then nothing) ends with
an error event, upstream_stalled, in the record and against the replica, which is ejected; the
real vLLM's streams, slower between tokens than any deadline here at times, are not.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet_faults import FaultyReplicas
from embedded.processes import Stack
from embedded.stack import proxy_part
from proxy.upstream import PROBE_PROMPT
from ratchet.bus import make_consumer
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord, decode
from ratchet.secrets import vllm_api_key
from ratchet.settings import load_settings
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded, write_config

pytestmark = pytest.mark.integration

FIRST_BYTE_S = 10.0  # above the slowest first token of the shared CPU vLLM under the suite


@contextlib.contextmanager
def fleet_proxy(env: Embedded, home: Path, endpoints: list[str], **proxy: Any) -> Iterator[str]:
    """A proxy beside the session's, on its Kafka and Redis, in front of ``endpoints``."""
    path, config = write_config(home, **proxy)
    config["kafka_bootstrap_servers"] = env.settings.kafka_bootstrap_servers
    config["redis_url"] = env.settings.redis_url
    config["vllm_url"] = endpoints[0]
    config["vllm_endpoints"] = endpoints
    config["vllm_api_key"] = vllm_api_key(env.settings)
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    stack = Stack([proxy_part(settings, path)], home / "stack")
    stack.start()
    try:
        yield f"http://127.0.0.1:{settings.proxy.port}"
    finally:
        stack.stop()


def replica_counters(proxy: str, url: str) -> dict[str, float]:
    text = httpx.get(f"{proxy}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("endpoint") == url and not sample.name.endswith("_created"):
                found[sample.name] = sample.value
    return found


def records_of(env: Embedded, client_ids: set[str]) -> dict[str, TrafficRecord]:
    """The traffic records of these client request ids, re-reading the topic until all are
    there (or 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        consumer = make_consumer(
            env.settings.kafka_bootstrap_servers,
            env.settings.kafka,
            [TRAFFIC_TOPIC],
            None,
            consumer_timeout_ms=1500,
        )
        try:
            found = {
                r.client_request_id: r
                for m in consumer
                if isinstance(r := decode(m.topic, m.value), TrafficRecord)
                and r.client_request_id in client_ids
            }
        finally:
            consumer.close()
        if set(found) == client_ids or time.monotonic() > deadline:
            return found
        time.sleep(0.5)  # polling the topic, with the deadline above


@pytest.mark.timeout(900)  # the session's stack may start in it: minutes
def test_a_blackholed_replica_costs_a_retry_and_a_hung_one_is_ejected(
    base_route: Embedded, tmp_path: Path
) -> None:
    env = base_route
    # The probe is one the real vLLM answers: a first byte of a one-token stream.
    probe = {"model": BASE_MODEL, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": True}
    headers = {"Authorization": f"Bearer {vllm_api_key(env.settings)}"}
    answer = httpx.post(
        f"{env.settings.vllm_url}/v1/completions", json=probe, headers=headers, timeout=60
    )
    assert answer.status_code == 200 and b"data: {" in answer.content

    faulty = FaultyReplicas(env.settings.vllm_url)
    faulty.start()
    real, hung, dark = env.settings.vllm_url, faulty.hung_url, faulty.dark_url
    proxy_settings = {
        "balance": "round_robin",  # each replica in turn: every fault is met, in order
        "upstream_health_interval_s": 600,  # the blackhole is found by requests, not checks
        "upstream_timeout_s": 120,
        "upstream_first_byte_timeout_s": FIRST_BYTE_S,
        "outlier_ejection": {"consecutive_failures": 2, "base_ejection_s": 600},
    }
    try:
        with fleet_proxy(env, tmp_path, [real, hung, dark], **proxy_settings) as proxy:
            faulty.go_dark(cut=True)  # after the proxy's first checks passed for all three
            outcomes: list[tuple[int, str | None, str]] = []
            with httpx.Client(timeout=180) as client:
                for i in range(9):
                    client_id = f"fleet-faults-{uuid.uuid4().hex}"
                    response = client.post(
                        f"{proxy}/v1/chat/completions",
                        json={
                            "model": ALIAS,
                            "messages": [{"role": "user", "content": f"Say {i}."}],
                            "max_tokens": 4,
                        },
                        headers={"x-request-id": client_id},
                    )
                    error = response.json().get("error") if response.status_code >= 400 else None
                    outcomes.append((response.status_code, error and error["code"], client_id))
            statuses = [(status, code) for status, code, _ in outcomes]
            assert statuses.count((504, "upstream_stalled")) == 2, statuses
            assert statuses.count((200, None)) == 7, statuses  # the rest answered, retries too
            assert statuses[-4:] == [(200, None)] * 4  # the hung one is out: all answered

            assert replica_counters(proxy, hung) == {
                "ratchet_proxy_endpoint_requests_total": 2.0,
                "ratchet_proxy_endpoint_outstanding": 0.0,
                "ratchet_proxy_endpoint_up": 1.0,  # its health check passes all along
                "ratchet_proxy_endpoint_ejections_total": 1.0,
                "ratchet_proxy_endpoint_retries_total": 0.0,
                "ratchet_proxy_endpoint_connect_failures_total": 0.0,
                "ratchet_proxy_endpoint_first_byte_timeouts_total": 2.0,
                "ratchet_proxy_endpoint_stream_stalls_total": 0.0,
                "ratchet_proxy_endpoint_ejected": 1.0,
            }
            at_dark = replica_counters(proxy, dark)
            assert at_dark["ratchet_proxy_endpoint_connect_failures_total"] == 1.0
            assert at_dark["ratchet_proxy_endpoint_retries_total"] == 1.0
            assert at_dark["ratchet_proxy_endpoint_up"] == 0.0  # out until its check passes

            # The traffic record says whose fault each failure was.
            stalled = {rid for status, _, rid in outcomes if status == 504}
            records = records_of(env, stalled)
            assert set(records) == stalled
            assert all(r.status == 504 and r.error is not None for r in records.values())
            assert [r.error["code"] for r in records.values() if r.error] == [
                "upstream_stalled"
            ] * 2
    finally:
        faulty.stop()


@pytest.mark.timeout(900)  # the session's stack may start in it: minutes
def test_a_stream_the_hung_replica_wedges_on_mid_way_ends_stalled_and_ejects_it(
    base_route: Embedded, tmp_path: Path
) -> None:
    env = base_route
    faulty = FaultyReplicas(env.settings.vllm_url)
    faulty.start()
    real, hung = env.settings.vllm_url, faulty.hung_url
    proxy_settings = {
        "balance": "round_robin",  # each replica in turn: the hung one within two streams
        "upstream_timeout_s": 120,
        "upstream_first_byte_timeout_s": FIRST_BYTE_S,
        "upstream_stream_gap_timeout_s": FIRST_BYTE_S,
        "outlier_ejection": {"consecutive_failures": 1, "base_ejection_s": 600},
    }
    try:
        with fleet_proxy(env, tmp_path, [real, hung], **proxy_settings) as proxy:
            outcomes: list[tuple[int, list[dict[str, Any]], str]] = []
            with httpx.Client(timeout=180) as client:
                for i in range(4):
                    client_id = f"fleet-stream-{uuid.uuid4().hex}"
                    body = {
                        "model": ALIAS,
                        "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                        "max_tokens": 8,
                        "stream": True,
                    }
                    headers = {"x-request-id": client_id}
                    events = []
                    with client.stream(
                        "POST", f"{proxy}/v1/chat/completions", json=body, headers=headers
                    ) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                events.append(json.loads(line.removeprefix("data: ")))
                    outcomes.append((response.status_code, events, client_id))
            assert [status for status, _, _ in outcomes] == [200] * 4  # streams: 200 first
            stalled = [(events, rid) for _, events, rid in outcomes if "error" in events[-1]]
            assert len(stalled) == 1, outcomes  # the hung one's, then it is out
            events, stalled_id = stalled[0]
            assert len(events) == 3  # its two events, then the error
            assert events[-1]["error"]["code"] == "upstream_stalled"
            at_hung = replica_counters(proxy, hung)
            assert at_hung["ratchet_proxy_endpoint_stream_stalls_total"] == 1.0
            assert at_hung["ratchet_proxy_endpoint_first_byte_timeouts_total"] == 0.0
            assert at_hung["ratchet_proxy_endpoint_ejected"] == 1.0
            assert replica_counters(proxy, real)["ratchet_proxy_endpoint_stream_stalls_total"] == 0

            record = records_of(env, {stalled_id})[stalled_id]
            assert record.status == 504 and record.error is not None
            assert record.error["code"] == "upstream_stalled"
    finally:
        faulty.stop()

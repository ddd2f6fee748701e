"""Faults, caused for real: Kafka and Redis stopped in the embedded stack and started again
empty. The whole module is disruptive, so it is scheduled after every module that needs the
stack as it was (a module lands where its first test sorts; see conftest). A vLLM outage is in
test_vllm_down.py: it cuts off a proxy of its own and disrupts nothing."""

from __future__ import annotations

import httpx
import openai
import pytest

from embedded.processes import wait_until
from embedded.stack import create_topics
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord
from tests.integration.conftest import ALIAS, Embedded

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]


def client(env: Embedded) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env.proxy_url}/v1", api_key="k", max_retries=0, timeout=60)


def test_broker_down_requests_succeed_and_records_arrive_later(base_route: Embedded) -> None:
    env = base_route
    spooled = env.sample("ratchet_proxy_log_records_total", outcome="spooled")
    env.stack.stop_part("kafka")
    request_ids = []
    for i in range(5):
        raw = client(env).chat.completions.with_raw_response.create(
            model=ALIAS, max_tokens=2, messages=[{"role": "user", "content": f"outage {i}"}]
        )
        assert raw.parse().choices
        request_ids.append(raw.headers["x-request-id"])
    wait_until(
        lambda: env.sample("ratchet_proxy_log_records_total", outcome="spooled") >= spooled + 5,
        60,
        "spooling",
    )
    assert httpx.get(f"{env.proxy_url}/readyz").json()["kafka"] is False

    env.stack.start_part("kafka")  # a fresh, empty in-memory broker
    create_topics(env.settings)
    records = env.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.request_id in request_ids,
        count=5,
        timeout_s=60,
    )
    # Every request made during the outage is delivered (order per partition is kept by the
    # spool; across partitions Kafka defines none, so this checks the set).
    assert {r.request_id for r in records} == set(request_ids)
    wait_until(lambda: httpx.get(f"{env.proxy_url}/readyz").json()["kafka"], 30, "kafka up")


def test_redis_down_routing_keeps_working_from_cache(base_route: Embedded) -> None:
    env = base_route
    env.set_route(active=2)
    wait_until(
        lambda: (
            httpx.post(
                f"{env.proxy_url}/v1/chat/completions",
                json={
                    "model": ALIAS,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "x"}],
                },
                timeout=60,
            ).headers["x-ratchet-version"]
            == "2"
        ),
        5,
        "route v2",
    )
    env.stack.stop_part("redis")
    # The proxy notices, and keeps the table it last read (at least a second ago).
    wait_until(
        lambda: httpx.get(f"{env.proxy_url}/readyz").json()["registry"] is False,
        15,
        "registry down",
    )
    wait_until(
        lambda: env.sample("ratchet_proxy_registry_age_seconds") >= 1.0, 15, "registry age 1 s"
    )
    for _ in range(3):
        raw = client(env).chat.completions.with_raw_response.create(
            model=ALIAS, max_tokens=1, messages=[{"role": "user", "content": "still here?"}]
        )
        assert raw.headers["x-ratchet-version"] == "2"
    assert httpx.get(f"{env.proxy_url}/readyz").json()["registry"] is False
    assert env.sample("ratchet_proxy_registry_age_seconds") >= 1.0

    # Redis returns (empty: it keeps nothing on disk here); a new write reaches the proxy.
    env.stack.start_part("redis")
    wait_until(
        lambda: httpx.get(f"{env.proxy_url}/readyz").json()["registry"], 15, "registry reconnect"
    )
    env.set_route(active=1)
    # Seen within a second on a quiet host; 10 s for a loaded one (the channel resubscribes).
    wait_until(lambda: env.live_version() == 1, 10, "route after reconnect")

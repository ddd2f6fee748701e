"""Faults, caused for real: Kafka and Redis by stopping them in the embedded stack (these run
last); vLLM by cutting a proxy of its own off from it (tests/integration/forwarder.py), so vLLM
keeps running and no later test pays its cold start and first-generation compile again."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from embedded.processes import wait_until
from embedded.stack import create_topics
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord
from tests.integration.conftest import ALIAS, Embedded
from tests.integration.forwarder import Forwarder
from tests.integration.side_proxy import side_proxy

pytestmark = pytest.mark.integration


def client(env: Embedded) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env.proxy_url}/v1", api_key="k", max_retries=0, timeout=60)


@pytest.mark.disruptive
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


@pytest.mark.disruptive
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
    wait_until(
        lambda: env.live_version() == 1,
        3,
        "route after reconnect",
    )


@dataclass
class CutOff:
    proxy_url: str
    vllm: Forwarder


@pytest.fixture
def cut_off_proxy(base_route: Embedded, tmp_path: Path) -> Iterator[CutOff]:
    """A proxy beside the session's that reaches vLLM only through a forwarder the test can
    close."""
    vllm = urlsplit(base_route.settings.vllm_url)
    assert vllm.hostname is not None and vllm.port is not None
    forwarder = Forwarder(vllm.hostname, vllm.port)
    forwarder.open()
    try:
        with side_proxy(base_route, tmp_path, vllm_url=forwarder.url) as url:
            yield CutOff(url, forwarder)
    finally:
        if forwarder.open_now:
            forwarder.close()


def test_vllm_down_gives_503_and_proxy_recovers(cut_off_proxy: CutOff) -> None:
    proxy_url, vllm = cut_off_proxy.proxy_url, cut_off_proxy.vllm

    def ready() -> int:
        return httpx.get(f"{proxy_url}/readyz").status_code

    llm = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="k", max_retries=0, timeout=60)
    vllm.close()  # connections refused from now on, as from a stopped vLLM
    response = httpx.post(
        f"{proxy_url}/v1/chat/completions",
        json={"model": ALIAS, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.InternalServerError):
        llm.chat.completions.create(
            model=ALIAS, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    wait_until(lambda: ready() == 503, 5, "not ready")

    vllm.open()
    wait_until(lambda: ready() == 200, 30, "ready")
    completion = llm.chat.completions.create(
        model=ALIAS, max_tokens=2, messages=[{"role": "user", "content": "back?"}]
    )
    assert completion.choices[0].message.content is not None

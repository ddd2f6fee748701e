"""vLLM down, caused for real: a proxy of its own reaches vLLM through a forwarder the test
closes (tests/integration/forwarder.py), so the shared vLLM keeps running, no later test pays
its cold start again, and this module is not disruptive (test_faults.py, which restarts Kafka
and Redis, is)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from embedded.processes import wait_until
from tests.integration.conftest import ALIAS, Embedded
from tests.integration.forwarder import Forwarder
from tests.integration.side_proxy import side_proxy

pytestmark = pytest.mark.integration


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

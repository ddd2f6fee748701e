"""The proxy sends vLLM's key on every call and never the client's: the client's Authorization
header proves who the client is to the proxy and stops there. A vLLM that refuses the proxy's
key is a server fault (502), never a 401 the client would take for its own.

The vLLM here is a stand-in that, like the real one, refuses calls without the key. Whether the
real vLLM requires it is for the integration tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from embedded.processes import free_port
from proxy.app import create_app
from proxy.http1 import UpstreamPool
from ratchet.secrets import vllm_api_key
from ratchet.settings import RatchetSettings
from tests.unit.embedded.keyed_vllm import KeyedVllm, keyed_vllm

VLLM_KEY = "vllm-key-for-the-proxy"
CLIENT_KEY = "sk-the-clients-own-key"
CHAT = {"model": "support", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def vllm() -> Iterator[KeyedVllm]:
    with keyed_vllm(VLLM_KEY) as stand_in:
        yield stand_in


async def proxy_client(
    vllm: KeyedVllm, tmp_path: Path, proxy_key: str | None
) -> AsyncIterator[httpx.AsyncClient]:
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        vllm_url=vllm.url,
        vllm_api_key=proxy_key,
        proxy={"api_keys": [CLIENT_KEY], "upstream_timeout_s": 5},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            deadline = time.monotonic() + 10
            while (await client.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline, "the proxy never saw vLLM healthy"
            yield client


@pytest.fixture
async def proxy(vllm: KeyedVllm, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for client in proxy_client(vllm, tmp_path, VLLM_KEY):
        yield client


@pytest.fixture
async def misconfigured(vllm: KeyedVllm, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for client in proxy_client(vllm, tmp_path, "a-key-vllm-does-not-know"):
        yield client


async def test_vllm_gets_its_key_and_never_the_clients(
    proxy: httpx.AsyncClient, vllm: KeyedVllm
) -> None:
    for stream in (False, True):
        resp = await proxy.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": stream},
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        )
        assert resp.status_code == 200, resp.text
    calls = [s for s in vllm.seen if s[1] == "/v1/chat/completions"]
    assert len(calls) == 2
    assert all(auth == f"Bearer {VLLM_KEY}" for _, _, auth in vllm.seen), vllm.seen
    assert not any(CLIENT_KEY in (auth or "") for _, _, auth in vllm.seen)


async def test_vllm_refusing_the_proxys_key_is_a_502_not_the_clients_401(
    misconfigured: httpx.AsyncClient, vllm: KeyedVllm
) -> None:
    resp = await misconfigured.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
    )
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_auth")
    assert VLLM_KEY not in resp.text and "a-key-vllm-does-not-know" not in resp.text
    assert vllm.seen and not vllm.authorized()


def test_without_a_configured_key_the_proxy_sends_the_derived_one(tmp_path: Path) -> None:
    settings = RatchetSettings(home=tmp_path)
    app = create_app(settings)
    (endpoint,) = app.state.ratchet.upstream.endpoints.values()  # the one replica configured
    head: bytes = endpoint.pool._head
    assert b"Authorization: Bearer " + vllm_api_key(settings).encode() + b"\r\n" in head


@pytest.mark.parametrize("key", ["", "two words", "key\r\nX-Injected: 1", "k\n", "ключ"])
def test_a_key_that_cannot_travel_in_a_header_is_refused(key: Any) -> None:
    with pytest.raises(ValueError, match="vllm_api_key"):
        UpstreamPool("http://127.0.0.1:1", 1.0, 1.0, api_key=key)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("VLLM_API_KEY", "", "is blank"),
        ("VLLM_API_KEY", "  ", "is blank"),
        ("VLLM_API_KEY", "two words", "printable ASCII without spaces"),
        ("SECRET", "", "is blank"),
    ],
)
def test_an_unusable_key_or_secret_is_refused_at_start_with_its_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    """An unset variable in a pod gives a blank value: vLLM given a blank key requires none,
    and a blank secret is one every client knows."""
    from ratchet.settings import ConfigError, load_settings

    monkeypatch.setenv(f"RATCHET_{name}", value)
    with pytest.raises(ConfigError) as refused:
        load_settings(None)
    text = str(refused.value)
    assert f"{name.lower()}: " in text and message in text and f"RATCHET_{name}" in text

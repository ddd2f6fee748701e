"""Request limits, keys and the log pipe's byte bound, in-process (the app in front of the fake
vLLM of conftest.py); the server-level defences are test_hardening.py's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from proxy.generation import STREAM_TAIL_CHUNKS, Call
from proxy.log.pipe import TrafficLog
from proxy.log.worker import ExchangeMeta, WorkerConfig
from ratchet.secrets import hash_api_key, server_secret
from ratchet.settings import KafkaSettings, RatchetSettings
from tests.unit.proxy.conftest import ProxyFactory

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
ADMIN, CLIENT = "sk-admin-0123", "sk-client-4567"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "support", "messages": MSG, **fields}


def error_of(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def echo_answer(size: int = 10) -> Any:
    """A fake vLLM whose whole answer is about `size` bytes of content."""

    async def handler(request: web.Request) -> web.Response:
        body = {"id": "c1", "choices": [{"index": 0, "message": {"content": "x" * size}}]}
        return web.json_response(body)

    return handler


async def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


# ---- limits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "proxy", "param", "setting"),
    [
        (CHAT, chat(n=17), {}, "n", "proxy.max_n"),
        (CHAT, chat(messages=MSG * 3), {"max_messages": 2}, "messages", "proxy.max_messages"),
        (CHAT, chat(max_tokens=10**6), {"max_tokens": 100}, "max_tokens", "proxy.max_tokens"),
        (
            "/v1/completions",
            {"model": "support", "prompt": ["a"] * 10, "n": 10},
            {},
            "n",
            "proxy.max_choices",
        ),
    ],
    ids=["n", "messages", "max-tokens", "choices"],
)
async def test_limits_are_400_envelopes_naming_the_setting(
    proxy_with: ProxyFactory,
    path: str,
    body: dict[str, Any],
    proxy: dict[str, Any],
    param: str,
    setting: str,
) -> None:
    async with proxy_with(**proxy) as (client, state):
        error = error_of(await client.post(path, json=body), 400, "limit_exceeded")
        assert error["param"] == param and setting in error["message"]
        assert state.metrics.in_flight._value.get() == 0


async def test_body_limit_names_the_setting(proxy_with: ProxyFactory) -> None:
    async with proxy_with(max_body_bytes=2048) as (client, _):
        long = [{"role": "user", "content": "x" * 4096}]
        resp = await client.post(CHAT, json=chat(messages=long))
        assert "proxy.max_body_bytes" in error_of(resp, 413, "request_too_large")["message"]


async def test_max_tokens_defaults_to_the_context_vllm_reports(
    proxy_with: ProxyFactory, upstream: dict[str, Any]
) -> None:
    upstream["max_model_len"] = 1000
    upstream["handler"] = echo_answer()
    async with proxy_with() as (client, state):
        await wait_for(lambda: state.limits.model_context == 1000)
        assert (await client.post(CHAT, json=chat(max_tokens=1000))).status_code == 200
        error = error_of(await client.post(CHAT, json=chat(max_tokens=1001)), 400, "limit_exceeded")
        assert "proxy.max_tokens" in error["message"] and "1000" in error["message"]


async def test_whole_answer_past_max_answer_bytes_is_refused(
    proxy_with: ProxyFactory, upstream: dict[str, Any]
) -> None:
    upstream["handler"] = echo_answer(size=200_000)
    async with proxy_with(max_answer_bytes=65536, upstream_timeout_s=30) as (client, state):
        error = error_of(await client.post(CHAT, json=chat()), 400, "answer_too_large")
        assert "proxy.max_answer_bytes" in error["message"] and "stream" in error["message"]
        assert state.metrics.in_flight._value.get() == 0
        upstream["handler"] = echo_answer(size=1000)
        assert (await client.post(CHAT, json=chat())).status_code == 200


def test_a_long_stream_keeps_only_its_tail_for_the_log() -> None:
    meta = ExchangeMeta("r1", "chat.completions", "support", "s", 0, "active", True, None, True, 0)
    call = Call(meta, b"{}", b"{}", ("support", "0", "active"), False, 0.0)
    for i in range(1000):
        call.keep(b"data: %d\n\n" % i + b"x" * 1000, limit=100_000)
    assert call.meta.logged is False  # counted, not logged: the record would be cut short
    assert len(call.chunks) == STREAM_TAIL_CHUNKS and call.chunks[-1].startswith(b"data: 999")
    assert call.streamed == sum(len(b"data: %d\n\n" % i) + 1000 for i in range(1000))


# ---- keys ---------------------------------------------------------------------------------------


async def test_keys_are_hashed_with_the_server_secret(proxy_with: ProxyFactory) -> None:
    async with proxy_with(api_keys=[CLIENT], admin_key=ADMIN) as (client, state):
        secret = server_secret(state.settings)
        assert state.key_hashes == {hash_api_key(secret, CLIENT), hash_api_key(secret, ADMIN)}
        assert hash_api_key(b"other-secret", CLIENT) not in state.key_hashes
        ok = await client.get("/v1/models", headers={"authorization": f"Bearer {CLIENT}"})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"authorization": "Bearer sk-nobody"}, 401),
        ({"authorization": f"Bearer {CLIENT}"}, 403),
        ({"authorization": f"Bearer {ADMIN}"}, 200),
    ],
    ids=["none", "unknown", "client-key", "admin-key"],
)
async def test_metrics_auth_needs_the_admin_key(
    proxy_with: ProxyFactory, headers: dict[str, str], status: int
) -> None:
    async with proxy_with(api_keys=[CLIENT], admin_key=ADMIN, metrics_auth=True) as (client, _):
        resp = await client.get("/metrics", headers=headers)
        assert resp.status_code == status, resp.text
        if status != 200:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        else:
            assert b"ratchet_proxy" in resp.content


async def test_metrics_are_open_by_default_on_loopback_only(proxy_with: ProxyFactory) -> None:
    """They count requests per version and canary arm: off loopback they need the admin key
    unless proxy.metrics_auth is turned off, and without one nobody reads them."""
    async with proxy_with(api_keys=[CLIENT], admin_key=ADMIN) as (client, _):
        assert (await client.get("/metrics")).status_code == 200
    async with proxy_with(host="0.0.0.0", api_keys=[CLIENT], admin_key=ADMIN) as (client, _):
        assert (await client.get("/metrics")).status_code == 401
        assert (
            await client.get("/metrics", headers={"authorization": f"Bearer {CLIENT}"})
        ).status_code == 403
        assert (
            await client.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})
        ).status_code == 200
    async with proxy_with(host="0.0.0.0", api_keys=[CLIENT]) as (client, _):
        assert (
            await client.get("/metrics", headers={"authorization": f"Bearer {CLIENT}"})
        ).status_code == 403
    async with proxy_with(host="0.0.0.0", api_keys=[CLIENT], metrics_auth=False) as (client, _):
        assert (await client.get("/metrics")).status_code == 200


def test_metrics_auth_without_an_admin_key_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"proxy\.admin_key"):
        RatchetSettings(proxy={"metrics_auth": True})


# ---- the log pipe, bounded in bytes -------------------------------------------------------------


async def test_log_pipe_drops_past_its_byte_bound(tmp_path: Path) -> None:
    config = WorkerConfig("127.0.0.1:1", KafkaSettings(), tmp_path, [], queue_size=1000)
    log = TrafficLog(config, max_bytes=1 << 20)  # no worker started: frames wait here
    answer = b"x" * (300 << 10)
    accepted = [log.submit_exchange(orjson.dumps({"n": i}), b"{}", answer) for i in range(5)]
    assert accepted == [True, True, True, False, False]  # 3 x 300 KiB fit in 1 MiB, not 4
    assert log.dropped == 2 and log.depth == 3
    assert (1 << 20) - (300 << 10) < log.buffered_bytes <= 1 << 20
    await log.close(timeout_s=0.1)


async def test_the_admin_key_can_neither_generate_nor_rate(proxy_with: ProxyFactory) -> None:
    """It reads and steers the proxy; traffic and ratings it sent would be learned from as a
    client's (audit L-6)."""
    async with proxy_with(api_keys=[CLIENT], admin_key=ADMIN) as (client, _):
        headers = {"authorization": f"Bearer {ADMIN}"}
        for path, body in (
            ("/v1/chat/completions", {"model": "support", "messages": []}),
            ("/v1/feedback", {"completion_id": "chatcmpl-1", "score": 1}),
        ):
            reply = await client.post(path, json=body, headers=headers)
            assert reply.status_code == 403, (path, reply.text)
            assert reply.json()["error"]["code"] == "admin_key_not_a_client_key"
        models = await client.get("/v1/models", headers=headers)
        assert models.status_code == 200

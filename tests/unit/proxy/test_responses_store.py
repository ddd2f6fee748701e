"""Stored responses (proxy/response_store.py) in a real Redis: one key's responses are another's
404s, each is kept for its TTL and refused past its size bound; and, through the proxy in front of
a stand-in vLLM, what the Responses route does when Redis is away."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.errors import ProxyError
from proxy.response_store import ResponseStore, response_key
from proxy.state import shared_redis
from tests.unit.proxy.conftest import ProxyFactory

RESPONSE = {"id": "resp_1", "object": "response", "output": []}
CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def store(redis_url: str, ttl_s: int = 60, max_bytes: int = 4096) -> ResponseStore:
    return ResponseStore(shared_redis(redis_url), CollectorRegistry(), ttl_s, max_bytes)


async def close(responses: ResponseStore) -> None:
    await responses._redis.aclose()  # the proxy's shared client: ProxyState closes it there


async def test_a_stored_response_is_its_owners_alone_for_its_ttl(redis_url: str) -> None:
    responses = store(redis_url, ttl_s=60)
    assert await responses.save(RESPONSE, CONVERSATION, "hash-a")
    entry = await responses.load("resp_1", "hash-a")
    assert entry["response"] == RESPONSE and entry["conversation"] == CONVERSATION
    assert 0 < redis.Redis.from_url(redis_url).ttl(response_key("resp_1")) <= 60
    for other in ("hash-b", None):  # another key, or none: as if it did not exist
        with pytest.raises(ProxyError) as unknown:
            await responses.load("resp_1", other)
        assert (unknown.value.status, unknown.value.code) == (404, "response_not_found")
    with pytest.raises(ProxyError):
        await responses.delete("resp_1", "hash-b")  # nor may it delete it
    await responses.delete("resp_1", "hash-a")
    with pytest.raises(ProxyError):
        await responses.load("resp_1", "hash-a")
    await close(responses)


async def test_a_response_past_the_size_bound_or_with_storing_off_is_not_kept(
    redis_url: str,
) -> None:
    small = store(redis_url, max_bytes=1024)
    long_conversation = [{"role": "user", "content": "x" * 2000}]
    assert not await small.save(RESPONSE, long_conversation, "hash-a")
    assert small.saved.labels("too_large")._value.get() == 1
    off = store(redis_url, ttl_s=0)
    assert not await off.save(RESPONSE, CONVERSATION, "hash-a")
    assert off.saved.labels("disabled")._value.get() == 1
    assert redis.Redis.from_url(redis_url).keys("ratchet:response:*") == []
    await close(small)
    await close(off)


async def chat_answer(_: web.Request) -> web.Response:
    return web.json_response(
        {
            "id": "chatcmpl-u1",
            "object": "chat.completion",
            "created": 1,
            "model": "smollm2-135m-instruct",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )


async def test_with_redis_away_an_answer_is_still_given_and_a_continuation_is_a_503(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    """The fixture's Redis port is closed: the answer does not depend on the store (it says
    store false), while a continuation, which cannot be checked, is a retryable 503."""
    upstream["handler"] = chat_answer
    async with proxy_with() as (client, _):
        answer = await client.post(
            "/v1/responses", json={"model": "support", "input": "hi", "max_output_tokens": 4}
        )
        assert answer.status_code == 200, answer.text
        body = orjson.loads(answer.content)
        assert body["output"][0]["content"][0]["text"] == "hello"
        assert body["store"] is False and body["id"] == "resp_u1"
        continued = await client.post(
            "/v1/responses",
            json={"model": "support", "input": "and?", "previous_response_id": "resp_u1"},
        )
        assert continued.status_code == 503
        assert continued.json()["error"]["code"] == "store_unavailable"
        assert continued.headers["retry-after"] == "1"


async def test_an_id_longer_than_any_of_ours_is_unknown_without_asking_redis(
    proxy_with: ProxyFactory,
) -> None:
    async with proxy_with() as (client, _):  # Redis is away: asking it would be a 503
        for method in ("GET", "DELETE"):
            answer = await client.request(method, "/v1/responses/resp_" + "x" * 300)
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "response_not_found"

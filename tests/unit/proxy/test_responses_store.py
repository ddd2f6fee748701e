"""Stored responses (proxy/response_store.py) in a real Redis: one key's responses are another's
404s, each is kept for its TTL and refused past its size bound, past its key's or everyone's byte
quota (proxy/response_quota.py), and stored redacted; and, through the proxy in front of a
stand-in vLLM, what the Responses route does when Redis is away."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
import redis
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.errors import ProxyError
from proxy.log.redaction import REDACTED
from proxy.response_quota import ENTRY_OVERHEAD, allocation, charge_of, ledger_keys
from proxy.response_store import INLINE_REDACT_MATCHES, ResponseStore, response_key
from proxy.state import shared_redis
from ratchet.settings import ProxySettings
from tests.unit.proxy.conftest import ProxyFactory

RESPONSE = {"id": "resp_1", "object": "response", "output": []}
CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def store(redis_url: str, ttl_s: int = 60, max_bytes: int = 4096, **more: Any) -> ResponseStore:
    settings = ProxySettings(
        responses_store_ttl_s=ttl_s, responses_store_max_bytes=max_bytes, **more
    )
    return ResponseStore(shared_redis(redis_url), CollectorRegistry(), settings)


def response(number: int) -> dict[str, Any]:
    return {**RESPONSE, "id": f"resp_{number}"}


def entry_bytes(redis_url: str, response_id: str) -> int:
    return int(redis.Redis.from_url(redis_url).strlen(response_key(response_id)))


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


PADDED = [{"role": "user", "content": "x" * 3000}]  # a quota of three is past its floor


def entry_size(number: int, owner: str) -> int:
    entry = {"owner": owner, "response": response(number), "conversation": PADDED}
    return charge_of(len(orjson.dumps(entry)))


def test_a_charge_is_rounded_up_as_jemalloc_allocates() -> None:
    """Four size classes per doubling: a 17,000-byte string takes 20 KiB, not 17,000."""
    assert [allocation(n) for n in (100, 128, 129, 17_000, 32_768)] == [
        112,
        128,
        160,
        20_480,
        32_768,
    ]


def charged(redis_url: str, owner: str) -> tuple[int, int]:
    """The owner's and everyone's counted bytes."""
    client = redis.Redis.from_url(redis_url)
    _, own, _, every = ledger_keys(owner)
    return int(client.get(own) or 0), int(client.get(every) or 0)


async def test_past_its_keys_quota_a_response_is_not_kept_and_another_key_is_unaffected(
    redis_url: str,
) -> None:
    """Three fit in the key's quota, the fourth does not; another key still stores; a delete
    gives its room back."""
    one = entry_size(1, "hash-a")
    quota = 3 * one + ENTRY_OVERHEAD // 2
    responses = store(redis_url, responses_store_key_bytes=quota)
    for number in (1, 2, 3):
        assert await responses.save(response(number), PADDED, "hash-a")
    assert not await responses.save(response(4), PADDED, "hash-a")
    assert responses.saved.labels("key_quota")._value.get() == 1
    assert not redis.Redis.from_url(redis_url).exists(response_key("resp_4"))
    assert await responses.save(response(5), PADDED, "hash-b")
    assert charged(redis_url, "hash-a")[0] == 3 * one
    await responses.delete("resp_2", "hash-a")
    assert charged(redis_url, "hash-a") == (2 * one, 3 * one)
    assert await responses.save(response(4), PADDED, "hash-a")
    await close(responses)


async def test_past_the_total_quota_no_key_stores(redis_url: str) -> None:
    one = entry_size(1, "hash-a")
    responses = store(redis_url, responses_store_total_bytes=2 * one)
    assert await responses.save(response(1), PADDED, "hash-a")
    assert await responses.save(response(2), PADDED, "hash-b")
    assert not await responses.save(response(3), PADDED, "hash-c")
    assert responses.saved.labels("total_quota")._value.get() == 1
    await close(responses)


async def test_an_expired_response_gives_its_room_back_and_the_ledgers_expire_with_it(
    redis_url: str,
) -> None:
    one = entry_size(1, "hash-a")
    responses = store(redis_url, ttl_s=1, responses_store_key_bytes=one + ENTRY_OVERHEAD)
    assert await responses.save(response(1), PADDED, "hash-a")
    assert not await responses.save(response(2), PADDED, "hash-a")
    deadline = time.monotonic() + 10
    while not await responses.save(response(2), PADDED, "hash-a"):  # once resp_1 expired
        assert time.monotonic() < deadline, "an expired response's room did not come back"
        await asyncio.sleep(0.05)
    assert charged(redis_url, "hash-a") == (one, one)
    client = redis.Redis.from_url(redis_url)
    assert all(0 < int(client.pttl(key)) <= 1000 for key in ledger_keys("hash-a"))
    deadline = time.monotonic() + 10
    while client.dbsize():  # nothing is left behind once the last one expired
        assert time.monotonic() < deadline, client.keys("*")
        await asyncio.sleep(0.05)
    await close(responses)


async def test_what_is_stored_is_redacted_and_what_was_answered_is_not(redis_url: str) -> None:
    responses = store(redis_url, redact_patterns=[r"[\w.+-]+@[\w-]+\.[\w.]+"])
    answer: dict[str, Any] = {
        **RESPONSE,
        "output": [{"type": "message", "content": "mail bob@example.com"}],
    }
    asked = [{"role": "user", "content": "I am ann@example.org"}]
    assert await responses.save(answer, asked, "hash-a")
    assert answer["output"][0]["content"] == "mail bob@example.com"  # the client's copy
    entry = await responses.load("resp_1", "hash-a")
    assert entry["response"]["output"][0]["content"] == f"mail {REDACTED}"
    assert entry["conversation"] == [{"role": "user", "content": f"I am {REDACTED}"}]
    raw = redis.Redis.from_url(redis_url).get(response_key("resp_1"))
    assert isinstance(raw, bytes) and b"example" not in raw
    await close(responses)


async def test_an_entry_of_many_matches_is_redacted_whole_off_the_event_loop(
    redis_url: str,
) -> None:
    """Past INLINE_REDACT_MATCHES the store gives up redacting in line and redacts in a thread:
    every match is still gone from what Redis keeps."""
    responses = store(redis_url, redact_patterns=[r"[\w.+-]+@[\w-]+\.[\w.]+"])
    many = " ".join(f"u{i}@example.com" for i in range(INLINE_REDACT_MATCHES * 2))
    answer: dict[str, Any] = {**RESPONSE, "output": [{"type": "message", "content": many}]}
    assert await responses.save(answer, [{"role": "user", "content": "hi"}], "hash-a")
    entry = await responses.load("resp_1", "hash-a")
    kept = entry["response"]["output"][0]["content"]
    assert kept == " ".join([REDACTED] * INLINE_REDACT_MATCHES * 2)
    await close(responses)


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

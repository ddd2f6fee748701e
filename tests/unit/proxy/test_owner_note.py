"""The completion owner note spells the key as a 128-bit digest; a note of the whole hash
(written before the upgrade) still rates for its one TTL, and another key never does."""

from __future__ import annotations

import asyncio

import pytest
import redis
from prometheus_client import CollectorRegistry

from proxy.completions import CompletionOwners, owner_key, owner_of
from proxy.errors import ProxyError
from ratchet.secrets import hash_api_key

KEY = hash_api_key(b"secret", "key-a")
OTHER = hash_api_key(b"secret", "key-b")


def claim(url: str, completion_id: str, key_hash: str | None) -> int | str | None:
    async def run() -> int | str | None:
        owners = CompletionOwners(url, CollectorRegistry(), 600)
        try:
            return await owners.claim_rating(completion_id, key_hash)
        except ProxyError as exc:
            return exc.status
        finally:
            await owners.close()

    return asyncio.run(run())


def test_a_note_is_the_keys_short_digest_and_only_that_key_rates(redis_url: str) -> None:
    async def remember() -> None:
        owners = CompletionOwners(redis_url, CollectorRegistry(), 600)
        owners.remember(b'{"id":"chatcmpl-new"}', KEY)
        await owners.close()

    asyncio.run(remember())
    note = redis.Redis.from_url(redis_url).get(owner_key("chatcmpl-new"))
    assert note == owner_of(KEY).encode() and len(note) == 22
    assert claim(redis_url, "chatcmpl-new", OTHER) == 404
    assert claim(redis_url, "chatcmpl-new", KEY) is None
    assert claim(redis_url, "chatcmpl-new", KEY) == 409


@pytest.mark.parametrize("vouched", [False, True])
def test_a_note_of_the_whole_hash_from_before_the_upgrade_still_rates(
    redis_url: str, vouched: bool
) -> None:
    assert KEY is not None
    old = KEY + ("\tuser:abc" if vouched else "")
    redis.Redis.from_url(redis_url).set(owner_key("chatcmpl-old"), old, ex=600)
    assert claim(redis_url, "chatcmpl-old", OTHER) == 404
    assert claim(redis_url, "chatcmpl-old", KEY) == ("user:abc" if vouched else None)


def test_without_auth_the_anonymous_note_rates_for_no_key(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).set(owner_key("chatcmpl-anon"), owner_of(None), ex=600)
    assert owner_of(None) == "-"
    assert claim(redis_url, "chatcmpl-anon", KEY) == 404
    assert claim(redis_url, "chatcmpl-anon", None) is None

"""The canary's claims on completions (learner/canary_claims.py), in a real Redis: a claim is a
field of a sliced hash, claimed only by the key that got the answer, counted once whichever
replica reads the rating, kept by the first exchange of an id, expiring with its slice; a claim
written before slices (a key of its own) is still counted once by its key."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import redis

from learner.canary_claims import (
    COMPLETION_TTL_S,
    SLICE_S,
    claim_answer,
    claim_rating,
    claimed,
    field_of,
    legacy_key,
    shard_key,
    slice_of,
)
from ratchet.records import ANONYMOUS_CLIENT, TrafficRecord
from ratchet.secrets import client_source, hash_api_key
from tests.records import build_traffic_record

ALICE = hash_api_key(b"secret", "alice") or ""
MALLORY = hash_api_key(b"secret", "mallory") or ""


def answered(
    key_hash: str | None,
    completion: str = "c1",
    seconds_ago: float = 0.0,
    version: int = 12,
    source: str | None = None,
) -> TrafficRecord:
    ts = datetime.fromtimestamp(time.time() - seconds_ago, UTC).isoformat()
    return build_traffic_record(
        alias="support",
        version=version,
        api_key_hash=key_hash,
        response_id=completion,
        ts=ts,
        source=source,
    )


def claim(client: redis.Redis, record: TrafficRecord, arm: str) -> Any:
    pipe = client.pipeline(transaction=False)
    claim_answer(pipe, record, arm)
    return pipe.execute()[0]


def rate(client: redis.Redis, completion: str, rater: str | None) -> Any:
    pipe = client.pipeline(transaction=False)
    claim_rating(pipe, completion, rater, ["other", "support"])
    return pipe.execute()[0]


def test_only_the_answers_key_counts_its_rating_and_only_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert rate(client, "c1", ALICE) == 0  # not known yet: the rating waits
    assert claim(client, answered(ALICE), "canary") == 1
    assert claimed(rate(client, "c1", MALLORY)) is None
    assert claimed(rate(client, "c1", ALICE)) == ("support", 12, "canary", "")
    # A second replica reading the same rating (or a second rating) counts nothing.
    assert rate(client, "c1", ALICE) is None
    assert claimed(rate(client, "c1", ALICE)) is None


def test_an_answer_without_a_key_is_rated_without_one(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert claim(client, answered(None), "active") == 1
    assert claimed(rate(client, "c1", ALICE)) is None
    assert claimed(rate(client, "c1", None)) == ("support", 12, "active", ANONYMOUS_CLIENT)


def test_a_vouched_users_claim_names_that_user_and_stays_compact(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    user = client_source(b"secret", ALICE, "user-of-alice") or ""
    for i in range(50):
        claim(client, answered(ALICE, completion=f"c{i}", source=user, version=123456), "canary")
    key = shard_key("support", slice_of(time.time()), field_of("c1")[1])
    assert client.object("encoding", key) == b"listpack"  # each value under 64 bytes
    assert claimed(rate(client, "c1", ALICE)) == ("support", 123456, "canary", user)


def test_the_first_exchange_of_an_id_keeps_it_across_slices(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert claim(client, answered(ALICE, seconds_ago=3 * SLICE_S), "canary") == 1
    assert claim(client, answered(MALLORY, version=11), "active") == 0
    assert claim(client, answered(ALICE, version=11), "active") == 0
    assert claimed(rate(client, "c1", MALLORY)) is None
    assert claimed(rate(client, "c1", ALICE)) == ("support", 12, "canary", "")


def test_a_claim_expires_with_its_slice_a_ttl_after_it(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    record = answered(ALICE, seconds_ago=2 * SLICE_S)
    assert claim(client, record, "canary") == 1
    own = slice_of(time.time() - 2 * SLICE_S)
    key = shard_key("support", own, field_of("c1")[1])
    left = client.ttl(key)
    assert COMPLETION_TTL_S - 2 * SLICE_S - 5 <= left <= COMPLETION_TTL_S - SLICE_S + 5
    # An answer older than the TTL is not claimed for long: its slice is already gone.
    stale = answered(ALICE, completion="c2", seconds_ago=COMPLETION_TTL_S + 2 * SLICE_S)
    claim(client, stale, "canary")
    assert rate(client, "c2", ALICE) == 0


def test_claims_are_a_few_dozen_bytes_each(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    before = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i in range(10_000):
        claim_answer(pipe, answered(ALICE, completion=f"chatcmpl-{i:032x}"), "canary")
    assert sum(pipe.execute()) == 10_000
    per_claim = (int(client.info("memory")["used_memory"]) - before) / 10_000
    assert per_claim < 60, per_claim  # a key of its own took about 240


def test_a_claim_written_before_slices_is_still_counted_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = "\t".join(("support", "12", "canary", "", "digest-of-alice"))
    client.set(legacy_key("c1"), before, ex=COMPLETION_TTL_S)
    # No new claim takes the id from it.
    assert claim(client, answered(MALLORY, version=11), "active") == 0
    assert claimed(rate(client, "c1", MALLORY)) is None
    older = "\t".join(("support", "12", "canary", ALICE, ALICE))  # before digests: whole hash
    client.set(legacy_key("c2"), older, ex=COMPLETION_TTL_S)
    assert claimed(rate(client, "c2", MALLORY)) is None
    assert claimed(rate(client, "c2", ALICE)) == ("support", 12, "canary", ALICE)
    assert rate(client, "c2", ALICE) is None  # rated once
    assert client.ttl(legacy_key("c2")) > 0  # and still expires

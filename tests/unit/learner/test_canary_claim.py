"""The canary's claim on a completion (learner/canary_counter.py), in a real Redis: short enough
for Redis to keep in one allocation, claimed only by the key that got the answer, and a claim
written before digests (the whole key hash) still claimed by that key."""

from __future__ import annotations

import redis

from learner.canary_counter import CLAIM_RATING_SCRIPT, completion_claim
from ratchet.digests import key_digest
from ratchet.records import TrafficRecord
from ratchet.secrets import hash_api_key
from tests.records import build_traffic_record

ALICE = hash_api_key(b"secret", "alice") or ""
MALLORY = hash_api_key(b"secret", "mallory") or ""
EMBSTR_MAX = 44  # Redis keeps a string value this short in one allocation with its header


def answered(key_hash: str, source: str | None = None) -> TrafficRecord:
    return build_traffic_record(alias="support", version=12, api_key_hash=key_hash, source=source)


def claim(client: redis.Redis, completion: str, rater: str) -> object:
    return client.eval(CLAIM_RATING_SCRIPT, 1, completion, key_digest(rater), rater)


def test_a_claim_is_short_and_only_its_key_rates_it(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    own = completion_claim(answered(ALICE, source=ALICE), "canary")
    assert len(own.encode()) <= EMBSTR_MAX, own
    assert own.split("\t")[3] == ""  # the client is the key itself: left out
    client.set("c1", own)
    assert claim(client, "c1", MALLORY) is None
    assert claim(client, "c1", ALICE) == own.encode()
    assert claim(client, "c1", ALICE) is None  # rated once
    vouched = completion_claim(answered(ALICE, source="user:abc"), "active")
    assert vouched.split("\t")[3] == "user:abc"


def test_a_claim_written_before_digests_is_still_claimed_by_its_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = "\t".join(("support", "12", "canary", ALICE, ALICE))
    client.set("c1", before)
    assert claim(client, "c1", MALLORY) is None
    assert claim(client, "c1", ALICE) == before.encode()

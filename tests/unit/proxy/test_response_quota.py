"""The store's quota script on a real Redis: a response saved again under the same id replaces
its charge in both ledgers rather than adding to it (proxy/response_quota.py)."""

from __future__ import annotations

import redis

from proxy.response_quota import StoreQuota, charge_of, ledger_keys
from proxy.state import shared_redis


def counted(redis_url: str, owner: str) -> tuple[int, int, int, int]:
    """The owner's counter and ledger size, then everyone's."""
    client = redis.Redis.from_url(redis_url)
    ledger, counter, all_ledger, all_counter = ledger_keys(owner)
    return (
        int(client.get(counter) or 0),
        int(client.zcard(ledger)),
        int(client.get(all_counter) or 0),
        int(client.zcard(all_ledger)),
    )


async def test_saving_an_id_again_replaces_its_charge(redis_url: str) -> None:
    small, large = b"s" * 100, b"l" * 5000
    client = shared_redis(redis_url)
    quota = StoreQuota(client, key_bytes=10**6, total_bytes=10**6)
    for _ in range(3):
        assert await quota.save("ratchet:response:r1", "r1", small, "owner-a", 60) == "stored"
    assert counted(redis_url, "owner-a") == (charge_of(100), 1, charge_of(100), 1)
    assert await quota.save("ratchet:response:r1", "r1", large, "owner-a", 60) == "stored"
    assert counted(redis_url, "owner-a") == (charge_of(5000), 1, charge_of(5000), 1)
    await quota.delete("ratchet:response:r1", "r1", "owner-a")
    assert counted(redis_url, "owner-a") == (0, 0, 0, 0)
    await client.aclose()


async def test_a_save_again_within_a_full_quota_fits_and_one_refused_keeps_the_old(
    redis_url: str,
) -> None:
    """A quota that holds one response: its id saved again fits (its old charge is freed);
    one too large for the quota is refused and the stored one stays counted."""
    value = b"v" * 1000
    client = shared_redis(redis_url)
    quota = StoreQuota(client, key_bytes=charge_of(1000), total_bytes=10**6)
    assert await quota.save("ratchet:response:r1", "r1", value, "owner-a", 60) == "stored"
    assert await quota.save("ratchet:response:r1", "r1", value, "owner-a", 60) == "stored"
    assert await quota.save("ratchet:response:r2", "r2", value, "owner-a", 60) == "key_quota"
    too_large = b"v" * 4000
    assert await quota.save("ratchet:response:r1", "r1", too_large, "owner-a", 60) == "key_quota"
    assert redis.Redis.from_url(redis_url).get("ratchet:response:r1") == value
    assert counted(redis_url, "owner-a") == (charge_of(1000), 1, charge_of(1000), 1)
    await client.aclose()

"""The Responses store's byte quotas: what each API key, and all keys together, may hold in Redis.

Two ledgers, one per scope (the owner's key, and everyone), each a sorted set of the stored
responses (member ``<charge>:<response id>``, score the Redis-clock millisecond it expires) and a
counter of their charges. A response's charge is what Redis allocates for its value (jemalloc
rounds a 17 KB string up to 20 KB) plus :data:`ENTRY_OVERHEAD` (the key, its expiry and the two
ledger entries), so the quotas bound Redis's memory, not only the payloads. One Lua script per
write drops what has expired from both ledgers, checks both quotas and then stores the
response, so two replicas cannot both take the last room; every ledger key expires with its
newest response, so a key that stops storing leaves nothing.
"""

from __future__ import annotations

from typing import Literal

import redis.asyncio as aioredis

ALL_LEDGER = "ratchet:responses:all"
# Redis's own bytes per stored response beyond its value: the key, its expiry, a ledger entry in
# each scope (bench/redis_footprint.py measures the whole against the charges).
ENTRY_OVERHEAD = 512
SDS_HEADER = 10  # a long string's header and terminator
# Expired entries dropped per scope per write: a write after a long quiet spell spreads the
# clean-up over the next writes (the counter only overstates until then, never understates).
DROP_PER_WRITE = 1000

Outcome = Literal["stored", "key_quota", "total_quota"]

# KEYS: the response, owner ledger, its counter, all ledger, its counter. ARGV: value, TTL ms,
# charge, owner quota, total quota, ledger member, DROP_PER_WRITE, the response id,
# ENTRY_OVERHEAD, SDS_HEADER. Reply: "stored", "key_quota" or "total_quota". A response saved
# again (its id already stored) replaces its old ledger entry and charge rather than adding
# to them: the old charge is computed from the stored value's length, as DELETE_SCRIPT does.
SAVE_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function used(ledger, counter)
  local gone = redis.call('ZRANGEBYSCORE', ledger, '-inf', now, 'LIMIT', 0, ARGV[7])
  local freed = 0
  for _, member in ipairs(gone) do
    freed = freed + tonumber(string.match(member, '^(%d+):'))
    redis.call('ZREM', ledger, member)
  end
  local total = tonumber(redis.call('GET', counter) or '0')
  if freed > 0 then
    total = math.max(0, total - freed)
    redis.call('SET', counter, total, 'KEEPTTL')
  end
  return total
end
local function stored_charge()
  local length = redis.call('STRLEN', KEYS[1])
  if length == 0 then return 0 end
  local n, step = length + tonumber(ARGV[10]), 16
  while step * 8 <= n do step = step * 2 end
  return math.ceil(n / step) * step + tonumber(ARGV[9])
end
local old = stored_charge()
local old_member = old .. ':' .. ARGV[8]
local function held(ledger)
  if old > 0 and redis.call('ZSCORE', ledger, old_member) then return old end
  return 0
end
local ttl, charge = tonumber(ARGV[2]), tonumber(ARGV[3])
local own = used(KEYS[2], KEYS[3]) - held(KEYS[2]) + charge
if own > tonumber(ARGV[4]) then return 'key_quota' end
local all = used(KEYS[4], KEYS[5]) - held(KEYS[4]) + charge
if all > tonumber(ARGV[5]) then return 'total_quota' end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZREM', KEYS[2], old_member)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[6])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('SET', KEYS[3], own, 'PX', ttl)
redis.call('ZREM', KEYS[4], old_member)
redis.call('ZADD', KEYS[4], now + ttl, ARGV[6])
redis.call('PEXPIRE', KEYS[4], ttl)
redis.call('SET', KEYS[5], all, 'PX', ttl)
return 'stored'
"""

# KEYS: the response, owner ledger, its counter, all ledger, its counter. ARGV: the response id,
# ENTRY_OVERHEAD, SDS_HEADER. Its charge is computed from its length as when it was stored
# (:func:`charge_of`; values never change).
DELETE_SCRIPT = """
local length = redis.call('STRLEN', KEYS[1])
if length == 0 then return 0 end
redis.call('DEL', KEYS[1])
local n, step = length + tonumber(ARGV[3]), 16
while step * 8 <= n do step = step * 2 end
local charge = math.ceil(n / step) * step + tonumber(ARGV[2])
local member = charge .. ':' .. ARGV[1]
for i = 2, 4, 2 do
  if redis.call('ZREM', KEYS[i], member) == 1 then
    local left = redis.call('DECRBY', KEYS[i + 1], charge)
    if left < 0 then redis.call('SET', KEYS[i + 1], 0, 'KEEPTTL') end
  end
end
return 1
"""


def ledger_keys(owner: str) -> list[str]:
    """The owner's ledger and counter, then everyone's."""
    return [
        f"ratchet:responses:key:{owner}",
        f"ratchet:responses:key:{owner}:bytes",
        ALL_LEDGER,
        f"{ALL_LEDGER}:bytes",
    ]


def allocation(size: int) -> int:
    """jemalloc's size class for ``size`` bytes: four classes per doubling (16-byte steps below
    128), so a size is rounded up by at most a quarter."""
    step = 16
    while step * 8 <= size:
        step *= 2
    return -(-size // step) * step


def charge_of(value_bytes: int) -> int:
    """A stored value's bytes in Redis: its allocation (with the string's header) plus the
    key, expiry and ledger entries."""
    return allocation(value_bytes + SDS_HEADER) + ENTRY_OVERHEAD


class StoreQuota:
    """The two scripts on the proxy's shared client; quotas in bytes of charge."""

    def __init__(self, client: aioredis.Redis, key_bytes: int, total_bytes: int) -> None:
        self.key_bytes, self.total_bytes = key_bytes, total_bytes
        self._save = client.register_script(SAVE_SCRIPT)
        self._delete = client.register_script(DELETE_SCRIPT)

    async def save(
        self, redis_key: str, response_id: str, value: bytes, owner: str, ttl_s: int
    ) -> Outcome:
        """Store ``value`` under ``redis_key`` for ``ttl_s`` if both quotas have room for it."""
        charge = charge_of(len(value))
        member = f"{charge}:{response_id}"
        args: list[bytes | str | int] = [value, ttl_s * 1000, charge, self.key_bytes]
        args += [self.total_bytes, member, DROP_PER_WRITE, response_id]
        args += [ENTRY_OVERHEAD, SDS_HEADER]
        reply = await self._save(keys=[redis_key, *ledger_keys(owner)], args=args)
        outcome = reply.decode() if isinstance(reply, bytes) else str(reply)
        return outcome  # type: ignore[return-value]

    async def delete(self, redis_key: str, response_id: str, owner: str) -> None:
        await self._delete(
            keys=[redis_key, *ledger_keys(owner)], args=[response_id, ENTRY_OVERHEAD, SDS_HEADER]
        )

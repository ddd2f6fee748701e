"""The rate limiter's buckets in Redis: their shape, their keys and the two Lua scripts.

Each limit is a bucket that refills continuously, kept in Redis as one number: the time at which
it is full again (GCRA's "theoretical arrival time"), in milliseconds of Redis's own clock, so
replicas need no common clock. A missing key is a full bucket, so each key expires when its
bucket is full and Redis holds only the keys of callers who used some of a limit lately.

* ``requests_per_minute`` (with ``burst``): a request takes one unit when it is admitted.
* ``tokens_per_minute``, ``tokens_per_day``: a request needs one token left to be admitted; what
  it used (prompt + completion, from vLLM's usage) is charged after the answer, so one request
  may overdraw the budget and the key then waits until it has refilled.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Literal

from proxy.errors import ProxyError
from ratchet.settings import RateLimitSettings

KEY_PREFIX = "ratchet:ratelimit:"

# KEYS: one bucket per limit. ARGV: three per key (ms per unit, ms to refill from empty, units
# taken now), then one per key: ms of refill added first (earlier requests' takes and tokens).
# Reply: {0 or the index of the limit that refuses, ms to wait, then per key the ms until the
# bucket is full again}. Refused: nothing taken; what was added is kept either way.
ADMIT_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local full_at, worst, wait = {}, 0, 0
for i = 1, #KEYS do
  local at = tonumber(redis.call('GET', KEYS[i]) or 0)
  if at < now then at = now end
  at = at + tonumber(ARGV[3 * #KEYS + i])
  full_at[i] = at
  local over = at + tonumber(ARGV[3 * i - 2]) - now - tonumber(ARGV[3 * i - 1])
  if over > wait then worst, wait = i, over end
end
local reply = {worst, math.ceil(wait)}
for i = 1, #KEYS do
  local take = 0
  if worst == 0 then take = tonumber(ARGV[3 * i]) end
  local at = full_at[i] + take * tonumber(ARGV[3 * i - 2])
  if take > 0 or tonumber(ARGV[3 * #KEYS + i]) > 0 then
    redis.call('SET', KEYS[i], string.format('%.3f', at), 'PX', math.max(1, math.ceil(at - now)))
  end
  reply[i + 2] = math.ceil(at - now)
end
return reply
"""

# KEYS: buckets; ARGV[i]: ms of refill added to KEYS[i] (takes of requests already let through,
# tokens of answers), unconditionally. Reply: per key, the ms until it is full again.
ADD_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local reply = {}
for i = 1, #KEYS do
  local at = tonumber(redis.call('GET', KEYS[i]) or 0)
  if at < now then at = now end
  local added = tonumber(ARGV[i])
  if added > 0 then
    at = at + added
    redis.call('SET', KEYS[i], string.format('%.3f', at), 'PX', math.max(1, math.ceil(at - now)))
  end
  reply[i] = math.ceil(at - now)
end
return reply
"""
ADMIT_SHA = hashlib.sha1(ADMIT_SCRIPT.encode()).hexdigest()
ADD_SHA = hashlib.sha1(ADD_SCRIPT.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Limit:
    """One configured limit and its bucket's shape."""

    name: str  # the setting, e.g. "requests_per_minute"
    kind: Literal["requests", "tokens"]  # OpenAI's error type for this limit
    unit_ms: float  # refill time of one unit
    capacity: int  # units the bucket holds
    take: int  # units a request takes when admitted
    described: str  # "60 requests per minute, 10 at once"

    @property
    def room_ms(self) -> float:
        """Time to refill from empty to full."""
        return self.unit_ms * self.capacity

    @property
    def args(self) -> tuple[str, str, str]:
        return repr(self.unit_ms), repr(self.room_ms), str(self.take)


def configured_limits(settings: RateLimitSettings) -> list[Limit]:
    """The limits that are on, in the order their Redis keys are passed."""
    limits = []
    if settings.requests_per_minute is not None:
        rate = settings.requests_per_minute
        burst = settings.burst or rate
        described = f"{rate} requests per minute, {burst} at once"
        limits.append(Limit("requests_per_minute", "requests", 60_000 / rate, burst, 1, described))
    for name, period_ms, per in (
        ("tokens_per_minute", 60_000, "minute"),
        ("tokens_per_day", 86_400_000, "day"),
    ):
        budget: int | None = getattr(settings, name)
        if budget is not None:
            limits.append(
                Limit(name, "tokens", period_ms / budget, budget, 0, f"{budget} tokens per {per}")
            )
    return limits


def bucket_key(bucket: str, limit: Limit) -> str:
    return f"{KEY_PREFIX}{bucket}:{limit.name}"


def refusal(limit: Limit, wait_s: float, per_key: bool) -> ProxyError:
    """429 in OpenAI's shape, naming the setting; retry-after in whole seconds, rounded up."""
    retry_after = max(1, math.ceil(wait_s))
    whose = "this API key" if per_key else "all callers together (auth is off)"
    return ProxyError(
        429,
        f"rate limit reached: proxy.rate_limit.{limit.name} ({limit.described} for {whose}); "
        f"try again in {retry_after} s",
        type=limit.kind,
        code="rate_limit_exceeded",
        headers={"retry-after": str(retry_after)},
    )


_TOTAL_TOKENS = b'"total_tokens"'
_COUNT = re.compile(rb"\s*:\s*(\d{1,15})")


def total_tokens(answer: bytes) -> int:
    """vLLM's ``usage.total_tokens`` in a JSON answer or an SSE stream (the last one), without
    parsing the answer: a key written as ``"total_tokens"`` cannot occur inside a JSON string,
    where its quotes would be escaped. 0 when there is none (a stream cut short)."""
    at = answer.rfind(_TOTAL_TOKENS)
    if at < 0:
        return 0
    count = _COUNT.match(answer, at + len(_TOTAL_TOKENS))
    return int(count.group(1)) if count else 0

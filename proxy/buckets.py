"""The rate limiter's buckets in Redis: their shape, their keys and the two Lua scripts.

Each limit is a bucket that refills continuously, kept in Redis as one number: the time at which
it is full again (GCRA's "theoretical arrival time"), in milliseconds of Redis's own clock, so
replicas need no common clock. A missing key is a full bucket, so each key expires when its
bucket is full and Redis holds only the keys of callers who used some of a limit lately.

* ``requests_per_minute`` (with ``burst``): a request takes one unit when it is admitted.
* ``tokens_per_minute``, ``tokens_per_day``: a request reserves what it may use when it is
  admitted (:func:`reservation`: its prompt estimated from the body's bytes, plus n x max_tokens,
  at most the whole budget) and is refused when the budget has not that much left. After the
  answer the difference to what it did use is settled (proxy/generation.py's ``tokens_used``):
  a refund, or a further charge when the prompt was longer than estimated; a stream the client
  left is settled to what vLLM generated (proxy/stream_usage.py).

:class:`LocalBuckets` holds the same limits in this process, for while Redis cannot check them.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import ProxyError
from proxy.validation import RequestLimits, _prompt_count
from ratchet.settings import RateLimitSettings

KEY_PREFIX = "ratchet:ratelimit:"

# KEYS: one bucket per limit. ARGV: two per key (ms per unit, ms to refill from empty), then one
# per key: units taken now (a bucket needs room for at least one), then one per key: ms of refill
# added first (earlier requests' takes and settlements; negative: a refund). Reply: {0 or the
# index of the limit that refuses, ms to wait, then per key the ms until the bucket is full
# again}. Refused: nothing taken; what was added is kept either way. The debt (at - now) comes
# first: at + need - now - room rounds, and a full bucket of one would refuse now and then.
ADMIT_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local n = #KEYS
local full_at, worst, wait = {}, 0, 0
for i = 1, n do
  local at = tonumber(redis.call('GET', KEYS[i]) or 0)
  if at < now then at = now end
  at = math.max(now, at + tonumber(ARGV[3 * n + i]))
  full_at[i] = at
  local need = math.max(1, tonumber(ARGV[2 * n + i]))
  local over = (at - now) + need * tonumber(ARGV[2 * i - 1]) - tonumber(ARGV[2 * i])
  if over > wait then worst, wait = i, over end
end
local reply = {worst, math.ceil(wait)}
for i = 1, n do
  local take = 0
  if worst == 0 then take = tonumber(ARGV[2 * n + i]) end
  local at = full_at[i] + take * tonumber(ARGV[2 * i - 1])
  if take > 0 or tonumber(ARGV[3 * n + i]) ~= 0 then
    redis.call('SET', KEYS[i], string.format('%.3f', at), 'PX', math.max(1, math.ceil(at - now)))
  end
  reply[i + 2] = math.ceil(at - now)
end
return reply
"""

# KEYS: buckets; ARGV[i]: ms of refill added to KEYS[i] (takes of requests already let through,
# settlements of answers; negative: a refund, never past full), unconditionally. Reply: per key,
# the ms until it is full again.
ADD_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local reply = {}
for i = 1, #KEYS do
  local at = tonumber(redis.call('GET', KEYS[i]) or 0)
  if at < now then at = now end
  local added = tonumber(ARGV[i])
  if added ~= 0 then
    at = math.max(now, at + added)
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
    take: int  # units a request takes when admitted, besides its token reservation
    described: str  # "60 requests per minute, 10 at once"

    @property
    def room_ms(self) -> float:
        """Time to refill from empty to full."""
        return self.unit_ms * self.capacity

    @property
    def args(self) -> tuple[str, str]:
        return repr(self.unit_ms), repr(self.room_ms)

    def taken(self, reserve: int) -> int:
        """Units a request reserving ``reserve`` tokens takes. At most the whole budget, so a
        request asking for more than the budget waits for a full bucket, not forever."""
        return min(reserve, self.capacity) if self.kind == "tokens" else self.take


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


def budgets_unavailable() -> ProxyError:
    """503 while Redis cannot check token budgets and they fail closed."""
    return ProxyError(
        503,
        "token budgets cannot be checked while Redis is unavailable "
        "(proxy.rate_limit.budgets_without_redis is closed); retry shortly",
        type="server_error",
        code="rate_limit_unavailable",
        headers={"retry-after": "1"},
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


# A prompt's tokens as reserved before vLLM counts them: about four bytes of JSON body a token.
PROMPT_BYTES_PER_TOKEN = 4
# One per choice in every event of a stream (chat and completions alike), null until the last:
# like "total_tokens", it cannot occur inside a JSON string, whose quotes would be escaped.
_CHOICE_EVENT = b'"finish_reason"'


def prompt_estimate(body: bytes) -> int:
    return len(body) // PROMPT_BYTES_PER_TOKEN + 1


def reservation(payload: dict[str, Any], endpoint: str, limits: RequestLimits, prompt: int) -> int:
    """Tokens a checked request may use: its prompt (estimated), and for each of its choices
    (n or best_of, per prompt) ``max_tokens`` (the largest the request names, else the most it
    may ask for: proxy.max_tokens or the model's context)."""
    prompts = 1 if endpoint == "chat.completions" else _prompt_count(payload["prompt"])
    per_prompt = max(payload.get("n") or 1, payload.get("best_of") or 1)
    asked = [payload.get(name) for name in ("max_tokens", "max_completion_tokens")]
    most = max((value for value in asked if isinstance(value, int)), default=0)
    return prompt + per_prompt * prompts * (most or limits.token_limit()[0])


def choice_events(data: bytes) -> int:
    """Choice events in stream bytes: one per generated token (vLLM sends one per step; the
    first per choice carries only the role, a small overcount), unless vLLM merged several into
    one for a lagging reader. Streams cut before their usage event, and before any of vLLM's
    running counts (proxy/stream_usage.py), are charged this."""
    return data.count(_CHOICE_EVENT)


class LocalBuckets:
    """The same limits kept in this process (GCRA on the monotonic clock), for while Redis cannot
    check them: each replica then enforces every limit on its own. A bucket starts from what
    Redis last said of it (``seed``: each limit's fill and when), else full. Bounded like the
    limiter's views: one entry per bucket."""

    def __init__(self, limits: list[Limit]) -> None:
        self.limits = limits
        self._full_at: dict[str, list[float]] = {}  # bucket -> per limit, ms (monotonic)

    def admit(
        self, bucket: str, takes_ms: list[float], now_ms: float, seed: tuple[list[float], float]
    ) -> tuple[Limit, float] | None:
        """Take ``takes_ms`` from every limit, or from none: then (the limit, ms to wait)."""
        full_at = self._bucket(bucket, now_ms, seed)
        worst: tuple[Limit, float] | None = None
        for index, limit in enumerate(self.limits):
            need = max(takes_ms[index], limit.unit_ms)
            # Debt first, then the take against the room: (now + need) - now - room is not
            # exactly need - room in floats, and a full bucket of one request would then refuse
            # it about once in 150 checks.
            over = max(full_at[index] - now_ms, 0.0) + need - limit.room_ms
            if over > 0 and (worst is None or over > worst[1]):
                worst = (limit, over)
        if worst is None:
            self.add(bucket, takes_ms, now_ms)
        return worst

    def add(self, bucket: str, ms: list[float], now_ms: float) -> None:
        """Charge (or refund: negative) each limit, never past full."""
        full_at = self._full_at.get(bucket)
        if full_at is not None:
            for index, value in enumerate(ms):
                full_at[index] = max(now_ms, max(full_at[index], now_ms) + value)

    def forget(self, bucket: str) -> None:
        """Redis answered for this bucket: its word is the truth from here on."""
        self._full_at.pop(bucket, None)

    def _bucket(self, bucket: str, now_ms: float, seed: tuple[list[float], float]) -> list[float]:
        full_at = self._full_at.get(bucket)
        if full_at is None:
            fills, seen_ms = seed
            full_at = self._full_at[bucket] = [
                seen_ms + (1.0 - fill) * limit.room_ms
                for fill, limit in zip(fills, self.limits, strict=True)
            ]
        return full_at

"""The proxy's bounds on what clients make it hold: per-key request rates, token budgets and
requests in flight (``proxy.rate_limit``), and the Responses store's quota
(``proxy.responses_store_*``).

A module of its own so that ratchet/settings/proxy.py stays readable; every setting keeps its
name, nesting, environment variable and YAML path: ``RateLimitSettings`` is still
``proxy.rate_limit``, and the store's fields are declared on ``ProxySettings`` with the fields
below as their defaults (each carries its default, bounds and description).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ratchet.settings.base import _Section


class RateLimitSettings(_Section):
    """`proxy.rate_limit`: per-key limits every proxy replica shares through Redis; a key over
    one gets 429 and retry-after. All off by default: a sensible number depends on the model and
    the hardware, and without keys every client would share one bucket (a global limit)."""

    requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description=(
            "Requests a key may start per minute, refilled continuously (a token bucket)..."
        ),
    )
    burst: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="...and at most this many at once; unset, a full minute's worth.",
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        le=10**10,
        description=(
            "Prompt + completion tokens, refilled continuously: a request reserves its prompt "
            "(estimated) plus n x max_tokens at admission, refused when that much is not left, "
            "and is settled to what it used after the answer (proxy/buckets.py: also a stream cut "
            "short, a 504, ...)."
        ),
    )
    tokens_per_day: int | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="Prompt + completion tokens a key may use per UTC day.",
    )
    timeout_s: float = Field(
        default=0.05,
        gt=0,
        le=5.0,
        description=(
            "The longest a request waits for Redis to check it; past that it is checked as below."
        ),
    )
    budgets_without_redis: Literal["closed", "local"] = Field(
        default="closed",
        description=(
            "While Redis cannot check a request (slow past timeout_s, down, or full), request "
            "rates are checked by each replica on its own, in process; token budgets too with "
            '"local", while "closed" refuses the requests they would check with 503 and '
            "retry-after: a replica's own bucket starts from what Redis last said, so a long "
            "outage with many replicas could spend a day's budget several times over."
        ),
    )

    max_in_flight: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description=(
            "Requests of one key being served at once by one replica (streams until their last "
            "byte); one more is refused with 429 and retry-after. On by default, unlike the "
            "limits above: it bounds what one key can make a replica hold (security audit M-2)."
        ),
    )
    max_parse_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024 * 1024,
        le=1 << 40,
        description=(
            "Memory one key's requests in flight may take on one replica for their bodies, "
            "parsed (each charged its bound from its Content-Length before it is read: twice "
            "the body plus the parsed tree, at most 24x the body and 200 bytes per JSON value; "
            "proxy/inflight.py); a body past it is refused with 413, unless the key has nothing "
            "else in flight. Keep it, plus the replica's own memory, under its memory limit."
        ),
    )
    replica_max_parse_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1024 * 1024,
        le=1 << 40,
        description=(
            "Memory all requests in flight on one replica may take for their bodies, parsed, "
            "whatever their keys (each charged as for max_parse_bytes); past it a request is "
            "refused with 503 and retry-after, unless nothing else is in flight. Many keys "
            "each within max_parse_bytes cannot then take the replica past its memory limit: "
            "keep this, plus the replica's own memory and its log queue "
            "(proxy.log_queue_bytes), under that limit."
        ),
    )

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> RateLimitSettings:
        if self.burst is not None and self.requests_per_minute is None:
            raise ValueError(
                "proxy.rate_limit.burst is set but proxy.rate_limit.requests_per_minute is not; "
                "set both, or remove burst"
            )
        return self


# ---- the Responses store's quota: fields of ProxySettings, declared there by name ----------------

RESPONSES_STORE_TTL_S: int = Field(
    default=3600,
    ge=0,
    le=30 * 86400,
    description=(
        "Responses API (POST /v1/responses, store: true, OpenAI's default): how long a "
        "response is kept in Redis for GET /v1/responses/{id} and previous_response_id (0: "
        "none is), and the largest kept, with its conversation. Redis holds at most "
        "responses/s x TTL x this."
    ),
)

RESPONSES_STORE_MAX_BYTES: int = Field(
    default=256 * 1024,
    ge=1024,
    le=64 * 1024 * 1024,
    description=(
        "Largest stored Responses API response, with its conversation; a larger one is not stored."
    ),
)

RESPONSES_STORE_KEY_BYTES: int = Field(
    default=16 * 1024 * 1024,
    ge=4096,
    le=1 << 40,
    description=(
        "Stored Responses API responses of one API key together, in bytes of Redis (each "
        "counts what Redis allocates for it, key and bookkeeping included); past it a "
        "response is answered and not stored (store: false) until older ones expire or are "
        "deleted."
    ),
)

RESPONSES_STORE_TOTAL_BYTES: int = Field(
    default=256 * 1024 * 1024,
    ge=4096,
    le=1 << 40,
    description=(
        "Stored Responses API responses of all keys together, in bytes of Redis (counted as "
        "for one key); past it none is stored. Add it to Redis's maxmemory."
    ),
)

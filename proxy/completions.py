"""Ratings: once per completion, and only from the API key that got the answer.

After each answer the proxy notes who got it, in Redis ``ratchet:completion:<id>`` (the caller's
key hash, ``-`` without auth; first writer wins, kept :func:`owner_ttl_s`: as long as the
learner waits for a rating, an hour by default; a later rating is a 404). The key is kept as a
128-bit digest (ratchet/digests.py): a note per exchange, so every byte counts. The notes are
written off the request path: :meth:`CompletionOwners.remember` only queues one, and a task
sends what is queued in one pipeline. ``POST /v1/feedback`` then checks, in one script, that the
caller's key got that completion and that it is not rated yet (``ratchet:completion:<id>:rated``,
set if absent). Another key's completion, or one never answered here, is a 404 as if it did not
exist; a second rating is a 409; without Redis nothing can be checked: 503.

The completion id is vLLM's ``id``, the first key of its answer and of each streamed chunk, read
from the bytes without parsing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from proxy.errors import ProxyError
from ratchet.digests import key_digest
from ratchet.settings import FeedbackConfig, RatchetSettings

log = logging.getLogger(__name__)

KEY_PREFIX = "ratchet:completion:"
ANONYMOUS = "-"  # the owner of completions served without auth
# The first key of a JSON answer, or of a stream's first event.
_ID = re.compile(rb'\s*(?:data:\s*)?\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
_ID_WITHIN = 400  # "id" is the first key, so within the first bytes or not there at all
# Notes wait this long to go in one pipeline: the answer goes out first, and Redis sees one round
# trip per interval, not one per request.
FLUSH_DELAY_S = 0.05
_MAX_PENDING = 100_000  # notes queued while Redis is slow; past it they are dropped (counted)
_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)

# KEYS: owner, rated marker. ARGV: the caller's key digest, the marker's TTL in seconds, the
# caller's whole key hash (as notes written before the digest spell it: read for their one TTL).
# The owner note is the key digest, then, for a vouched user, a tab and the client it served.
# Returns {0}: not this caller's completion (or unknown), {1, client}: rated now, {2}: before.
RATE_SCRIPT = """
local owner = redis.call('GET', KEYS[1])
if not owner then return {0} end
local key, client = owner, ''
local tab = string.find(owner, '\t', 1, true)
if tab then key, client = string.sub(owner, 1, tab - 1), string.sub(owner, tab + 1) end
if key ~= ARGV[1] and key ~= ARGV[3] then return {0} end
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[2])) then return {1, client} end
return {2}
"""
# A vouched user's client (ratchet.secrets.client_source): the one kind the note must carry.
VOUCHED_PREFIX = "user:"


def completion_id_of(answer: bytes) -> str | None:
    """vLLM's completion id from the start of an answer or a stream, without parsing it."""
    found = _ID.match(answer, 0, _ID_WITHIN)
    return found.group(1).decode("utf-8", "replace") if found else None


def owner_ttl_s(settings: RatchetSettings) -> int:
    """How long a completion may still be rated: the longest ``feedback.join_ttl_s``, how long
    the learner waits for a rating (the canary counts one only within the hour of its default).
    A note per answer, so no longer."""
    default = FeedbackConfig.model_fields["join_ttl_s"].default
    joins = [config.feedback.join_ttl_s for config in settings.aliases.values()]
    return max(joins, default=default)


def owner_of(key_hash: str | None) -> str:
    """How a note spells the key that got an answer: its 128-bit digest (22 characters, so the
    note fits Redis's embedded strings), ``-`` without auth."""
    return key_digest(key_hash) or ANONYMOUS


def owner_key(completion_id: str) -> str:
    return KEY_PREFIX + completion_id


def rated_key(completion_id: str) -> str:
    return KEY_PREFIX + completion_id + ":rated"


class CompletionOwners:
    """Who got each completion (queued, sent in the background) and the check of a rating."""

    def __init__(self, redis_url: str, registry: CollectorRegistry, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        self._rate_script = self._redis.register_script(RATE_SCRIPT)
        self._pending: dict[str, str] = {}  # completion id -> owner, not yet in Redis
        self._flusher: asyncio.Task[None] | None = None
        self._down = False
        self.lost = Counter(
            "ratchet_proxy_completion_owners_lost_total",
            "Completions whose owner could not be written to Redis (their ratings get 404)",
            registry=registry,
        )
        self.ratings = Counter(
            "ratchet_proxy_feedback_total",
            "POST /v1/feedback by outcome: accepted, not_found (not the caller's completion), "
            "already_rated, unavailable (Redis down: cannot check), queue_full",
            ("outcome",),
            registry=registry,
        )

    def remember(self, answer: bytes, key_hash: str | None, client: str | None = None) -> None:
        """Note the caller as the owner of the completion in ``answer``, soon, off the path;
        and ``client``, when it is a user the key vouched for: its rating counts for that
        client, whatever the rating's own body says (audit N-14)."""
        completion_id = completion_id_of(answer)
        if completion_id is None:
            return
        if len(self._pending) >= _MAX_PENDING:
            self.lost.inc()
            return
        owner = owner_of(key_hash)
        if client is not None and client.startswith(VOUCHED_PREFIX):
            owner += "\t" + client
        self._pending.setdefault(completion_id, owner)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(FLUSH_DELAY_S)
                pending, self._pending = self._pending, {}
                await self._write(pending)
        finally:
            self._flusher = None

    async def _write(self, owners: dict[str, str]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for completion_id, owner in owners.items():
                # NX: an id that comes again (vLLM takes a request_id from the body) keeps its
                # first owner, so nobody can take over another key's completion.
                pipe.set(owner_key(completion_id), owner, nx=True, ex=self.ttl_s)
            await pipe.execute()
        except _ERRORS as exc:
            self.lost.inc(len(owners))
            if not self._down:
                self._down = True
                log.warning("completion owners not written (%r): their ratings will get 404", exc)
            return
        if self._down:
            self._down = False
            log.warning("completion owners written again: Redis answers")

    async def drain(self) -> None:
        """Wait for the notes under way (tests, shutdown, a rating of one still queued)."""
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    async def close(self) -> None:
        await self.drain()
        await self._redis.aclose()

    async def claim_rating(self, completion_id: str, key_hash: str | None) -> str | None:
        """Pass if the caller got this completion and has not rated it; the rating is then
        taken (a second one is refused) and the vouched user's client the completion served is
        returned (None: the key alone). 404, 409 or 503 otherwise."""
        if completion_id in self._pending or self._flusher is not None:
            await self.drain()  # rated right after the answer: its owner is on its way
        keys = [owner_key(completion_id), rated_key(completion_id)]
        try:
            caller: list[str | int] = [owner_of(key_hash), self.ttl_s, key_hash or ANONYMOUS]
            outcome, *served = await self._rate_script(keys, caller)
        except _ERRORS:
            self.ratings.labels("unavailable").inc()
            raise ProxyError(
                503,
                "feedback cannot be checked right now (the registry is unreachable); retry later",
                type="server_error",
                code="feedback_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        if outcome == 0:
            self.ratings.labels("not_found").inc()
            raise ProxyError(
                404,
                f"no completion {completion_id!r} was answered for this API key",
                param="completion_id",
                code="completion_not_found",
            )
        if outcome == 2:
            self.ratings.labels("already_rated").inc()
            raise ProxyError(
                409,
                f"completion {completion_id!r} is already rated; a completion is rated once",
                param="completion_id",
                code="already_rated",
            )
        client = served[0].decode() if served and served[0] else None
        return client

    async def release_rating(self, completion_id: str) -> None:
        """Give a rating back when it could not be recorded, so the caller may retry."""
        # If this fails too, the caller's retry is refused as already rated: nothing is counted.
        with contextlib.suppress(*_ERRORS):
            await self._redis.delete(rated_key(completion_id))

"""Stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues, in Redis ``ratchet:response:<id>`` so that every replica sees them.

Each belongs to the API key that made it (its hash; ``-`` without auth): another key's id reads
as unknown, a 404 that says nothing about whether it exists. Each is kept
``proxy.responses_store_ttl_s`` (0: nothing is stored). Bounded by design, a response is not
stored (counted by outcome) when it is past ``proxy.responses_store_max_bytes``, conversation
included, or when its owner's stored responses would pass ``proxy.responses_store_key_bytes``,
or everyone's ``proxy.responses_store_total_bytes`` (proxy/response_quota.py): the answer is
given all the same and says ``store: false`` (a streamed one has already said what was asked
when its last event is built). A quota is never a 4xx: ``store`` is OpenAI's default, so a
client that never continues a response would otherwise lose answers for a feature it does not
use.

What is stored is redacted as the traffic log is (``proxy.redact_patterns``, in a thread: a
string of many matches takes a while). ``GET`` returns, and a continuation sends the model, the
redacted text: a secret redacted from the log is not kept in Redis either, and a client whose
next turn needs it sends it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from proxy.errors import ProxyError
from proxy.log.redaction import Redactor, TooManyForInline
from proxy.response_quota import StoreQuota
from ratchet.settings import ProxySettings

log = logging.getLogger(__name__)

KEY_PREFIX = "ratchet:response:"
ANONYMOUS = "-"
_ERRORS = (redis.RedisError, OSError, TimeoutError)
# Entries up to this size, with up to this many matches, are redacted on the event loop: at
# most about 0.5 ms of it (an RE2 scan of 16 KB, 16 matches at ~10 µs); others in a thread.
INLINE_REDACT_BYTES = 16 * 1024
INLINE_REDACT_MATCHES = 16


def response_key(response_id: str) -> str:
    return KEY_PREFIX + response_id


class ResponseStore:
    def __init__(
        self, client: aioredis.Redis, registry: CollectorRegistry, settings: ProxySettings
    ) -> None:
        self._redis = client  # the proxy's shared client (proxy/state.py shared_redis)
        self.ttl_s = settings.responses_store_ttl_s
        self.max_bytes = settings.responses_store_max_bytes
        self.quota = StoreQuota(
            client, settings.responses_store_key_bytes, settings.responses_store_total_bytes
        )
        patterns = settings.redact_patterns
        self.redactor = Redactor(patterns, settings.redact_budget_s) if patterns else None
        self.saved = Counter(
            "ratchet_proxy_responses_stored",
            "Responses asked to be stored (store: true), by outcome: stored, too_large (past "
            "proxy.responses_store_max_bytes), key_quota (its key's stored responses at "
            "proxy.responses_store_key_bytes), total_quota (all keys' at "
            "proxy.responses_store_total_bytes), disabled (proxy.responses_store_ttl_s 0), "
            "redis_error",
            ["outcome"],
            registry=registry,
        )

    async def save(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], key_hash: str | None
    ) -> bool:
        """Keep ``response`` and the chat messages it ends for its owner, redacted; False when
        it was not kept (counted). Never raises: the answer has been given, and an unstored
        response only cannot be continued."""
        if self.ttl_s <= 0:
            self.saved.labels("disabled").inc()
            return False
        owner = key_hash or ANONYMOUS
        entry = {"owner": owner, "response": response, "conversation": conversation}
        value = orjson.dumps(entry)
        # Checked before redaction too, so that redaction's time is bounded by max_bytes.
        if len(value) > self.max_bytes or (
            self.redactor is not None
            and len(value := await self._redacted(self.redactor, entry, len(value)))
            > self.max_bytes
        ):
            self.saved.labels("too_large").inc()
            return False
        try:
            outcome = await self.quota.save(
                response_key(response["id"]), response["id"], value, owner, self.ttl_s
            )
        except _ERRORS as exc:
            self.saved.labels("redis_error").inc()
            log.warning("could not store response %s: %s", response["id"], exc)
            return False
        self.saved.labels(outcome).inc()
        return outcome == "stored"

    @staticmethod
    async def _redacted(redactor: Redactor, entry: dict[str, Any], size: int) -> bytes:
        """The entry as stored: its response and conversation redacted (the owner is ours).
        A small entry with few matches is redacted in line (tens of µs), anything more in a
        thread: the hop to a thread costs more than the redaction of a small entry (on a loaded
        host, milliseconds), while a string of many matches costs ~10 µs each."""
        parts = {"response": entry["response"], "conversation": entry["conversation"]}
        redacted: dict[str, Any] | None = None
        if size <= INLINE_REDACT_BYTES:
            with contextlib.suppress(TooManyForInline):
                redacted = redactor.begin(inline_matches=INLINE_REDACT_MATCHES)(parts)
        if redacted is None:
            redacted = await asyncio.to_thread(redactor.begin(), parts)
        assert redacted is not None
        return orjson.dumps({"owner": entry["owner"], **redacted})

    async def load(
        self, response_id: str, key_hash: str | None, param: str | None = None
    ) -> dict[str, Any]:
        """The stored entry, if ``key_hash`` owns it; else a 404 naming ``param``."""
        try:
            value = await self._redis.get(response_key(response_id))
        except _ERRORS as exc:
            raise _unavailable(exc) from None
        entry = orjson.loads(value) if value else None
        if entry is None or entry.get("owner") != (key_hash or ANONYMOUS):
            raise not_found(response_id, param)
        return entry  # type: ignore[no-any-return]

    async def delete(self, response_id: str, key_hash: str | None) -> None:
        """Delete it (a 404 unless the caller owns it), its room back in both quotas."""
        await self.load(response_id, key_hash)
        try:
            await self.quota.delete(response_key(response_id), response_id, key_hash or ANONYMOUS)
        except _ERRORS as exc:
            raise _unavailable(exc) from None


def not_found(response_id: str, param: str | None = None) -> ProxyError:
    return ProxyError(
        404,
        f"no stored response {response_id[:80]!r} for this API key (responses are kept "
        "proxy.responses_store_ttl_s, only for the key that made them, and only those that "
        "said store: true: one past the store's size or quotas says store: false)",
        param=param,
        type="invalid_request_error",
        code="response_not_found",
    )


def _unavailable(exc: BaseException) -> ProxyError:
    log.warning("response store unavailable: %s", exc)
    return ProxyError(
        503,
        "stored responses are unavailable right now (Redis); retry shortly",
        type="server_error",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )

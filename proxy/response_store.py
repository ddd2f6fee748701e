"""Stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues, in Redis ``ratchet:response:<id>`` so that every replica sees them.

Each belongs to the API key that made it (its hash; ``-`` without auth): another key's id reads
as unknown, a 404 that says nothing about whether it exists. Each is kept
``proxy.responses_store_ttl_s`` (0: nothing is stored) and refused past
``proxy.responses_store_max_bytes``, conversation included: the store's memory is at most
responses per second x TTL x that size, and a conversation continued turn after turn stops
being stored once it outgrows it (counted; a whole Response then says ``store: false``, a
streamed one has already said what was asked when its last event is built).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from proxy.errors import ProxyError

log = logging.getLogger(__name__)

KEY_PREFIX = "ratchet:response:"
ANONYMOUS = "-"
_ERRORS = (redis.RedisError, OSError, TimeoutError)


def response_key(response_id: str) -> str:
    return KEY_PREFIX + response_id


class ResponseStore:
    def __init__(
        self, client: aioredis.Redis, registry: CollectorRegistry, ttl_s: int, max_bytes: int
    ) -> None:
        self._redis = client  # the proxy's shared client (proxy/state.py shared_redis)
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self.saved = Counter(
            "ratchet_proxy_responses_stored",
            "Responses asked to be stored (store: true), by outcome: stored, too_large (past "
            "proxy.responses_store_max_bytes), disabled (proxy.responses_store_ttl_s 0), "
            "redis_error",
            ["outcome"],
            registry=registry,
        )

    async def save(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], key_hash: str | None
    ) -> bool:
        """Keep ``response`` and the chat messages it ends for its owner; False when it was not
        kept (counted). Never raises: the answer has been given, and an unstored response only
        cannot be continued."""
        if self.ttl_s <= 0:
            self.saved.labels("disabled").inc()
            return False
        value = orjson.dumps(
            {"owner": key_hash or ANONYMOUS, "response": response, "conversation": conversation}
        )
        if len(value) > self.max_bytes:
            self.saved.labels("too_large").inc()
            return False
        try:
            await self._redis.set(response_key(response["id"]), value, ex=self.ttl_s)
        except _ERRORS as exc:
            self.saved.labels("redis_error").inc()
            log.warning("could not store response %s: %s", response["id"], exc)
            return False
        self.saved.labels("stored").inc()
        return True

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
        await self.load(response_id, key_hash)  # 404 unless the caller owns it
        try:
            await self._redis.delete(response_key(response_id))
        except _ERRORS as exc:
            raise _unavailable(exc) from None


def not_found(response_id: str, param: str | None = None) -> ProxyError:
    return ProxyError(
        404,
        f"no stored response {response_id[:80]!r} for this API key (responses are kept "
        "proxy.responses_store_ttl_s, and only for the key that made them)",
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

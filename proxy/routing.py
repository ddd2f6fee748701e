"""The proxy's routing table: a copy of the registry, kept fresh by pub/sub, served while Redis
is away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis
import redis.asyncio as aioredis

from ratchet.registry import CHANNEL, AliasRoute, alias_key, decode_hash
from ratchet.settings import AliasConfig

log = logging.getLogger(__name__)


class RoutingCache:
    """The proxy's copy of the routing table.

    Loaded in full at start and every ``refresh_s``; each message on ``ratchet:registry`` reloads
    its alias at once. While Redis is unreachable the last table keeps serving and ``age_s``
    grows, which is exported as a metric.
    """

    def __init__(self, redis_url: str, aliases: dict[str, AliasConfig], refresh_s: float) -> None:
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=2, socket_connect_timeout=1, health_check_interval=5
        )
        self._aliases = aliases
        self._refresh_s = refresh_s
        # Aliases from ratchet.yaml serve v0 (the base model) until Redis says otherwise.
        self.routes: dict[str, AliasRoute] = {
            name: AliasRoute(alias=name, base_model=cfg.base_model) for name, cfg in aliases.items()
        }
        self.loaded_at: float | None = None
        self.connected = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def age_s(self) -> float:
        return float("inf") if self.loaded_at is None else time.monotonic() - self.loaded_at

    async def start(self) -> None:
        try:
            await self.load_all()
        except (redis.RedisError, OSError) as exc:
            log.warning("routing registry unreachable at start (%s); serving config defaults", exc)
        self._tasks = [
            asyncio.create_task(self._listen(), name="registry-listen"),
            asyncio.create_task(self._refresh_loop(), name="registry-refresh"),
        ]

    async def close(self) -> None:
        # redis-py's pubsub.listen() can swallow one cancellation while it reconnects: cancel
        # until every task has ended, then close the connection pool.
        pending = {task for task in self._tasks if not task.done()}
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()

    def _default_base(self, alias: str) -> str:
        config = self._aliases.get(alias)
        return config.base_model if config else ""

    async def load_alias(self, alias: str) -> None:
        raw = decode_hash(await self._redis.hgetall(alias_key(alias)))
        if raw:
            self.routes[alias] = AliasRoute.from_hash(alias, raw, self._default_base(alias))
        elif alias not in self._aliases:
            self.routes.pop(alias, None)

    async def load_all(self) -> None:
        routes = {
            name: AliasRoute(alias=name, base_model=cfg.base_model)
            for name, cfg in self._aliases.items()
        }
        async for key in self._redis.scan_iter(match="ratchet:alias:*", count=500):
            key = key.decode()
            if key.endswith(":history"):
                continue
            name = key.removeprefix("ratchet:alias:")
            raw = decode_hash(await self._redis.hgetall(key))
            if raw:
                routes[name] = AliasRoute.from_hash(name, raw, self._default_base(name))
        self.routes = routes
        self.loaded_at = time.monotonic()
        self.connected = True

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.load_all()
            except (redis.RedisError, OSError) as exc:
                if self.connected:
                    log.warning("routing registry unreachable (%s); serving the last table", exc)
                self.connected = False

    async def _listen(self) -> None:
        backoff = 0.2
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(CHANNEL)
                # Changes made while we were disconnected are caught by this full reload.
                await self.load_all()
                backoff = 0.2
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    await self.load_alias(message["data"].decode())
                    self.loaded_at = time.monotonic()
            except asyncio.CancelledError:
                raise
            except (redis.RedisError, OSError) as exc:
                if self.connected:
                    log.warning("registry subscription lost (%s); retrying", exc)
                self.connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()

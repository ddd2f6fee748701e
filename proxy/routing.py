"""The proxy's routing table: a copy of the registry, kept fresh by pub/sub, served while Redis
is away; with it, the replicas out of each routed version's rotation
(ratchet/version_exclusion.py), read in the same refreshes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import redis
import redis.asyncio as aioredis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ratchet.registry import (
    CHANNEL,
    AliasRoute,
    InvalidRoutes,
    RoutingTable,
    alias_key,
    alias_of_key,
    decode_hash,
)
from ratchet.settings import AliasConfig
from ratchet.version_exclusion import VersionExclusions, read_exclusions

log = logging.getLogger(__name__)


class RoutingCache:
    """The proxy's copy of the routing table.

    Loaded in full at start and every ``refresh_s``; each message on ``ratchet:registry`` reloads
    its alias at once. While Redis is unreachable the last table keeps serving and ``age_s``
    grows, which is exported as a metric; past ``stale_after_s`` the table is reported stale. An
    alias whose hash is invalid keeps its last valid route and is listed in ``invalid``.
    """

    def __init__(
        self, client: aioredis.Redis, aliases: dict[str, AliasConfig], refresh_s: float
    ) -> None:
        self._redis = client  # the proxy's shared client (proxy/state.py shared_redis)
        self._aliases = aliases
        self._refresh_s = refresh_s
        # Aliases from ratchet.yaml serve v0 (the base model) until Redis says otherwise.
        self.routes: dict[str, AliasRoute] = {
            name: AliasRoute(alias=name, base_model=cfg.base_model) for name, cfg in aliases.items()
        }
        self.invalid = InvalidRoutes()
        # Asked by the choice of replica on every request (proxy/upstream.py): kept here, read
        # with the routes, so that lookup never waits on Redis.
        self.exclusions = VersionExclusions()
        self.loaded_at: float | None = None
        self.readable = False
        self.subscribed = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def age_s(self) -> float:
        return float("inf") if self.loaded_at is None else time.monotonic() - self.loaded_at

    @property
    def connected(self) -> bool:
        """Redis answers and the change channel is subscribed: a route written now reaches this
        proxy at once, not at the next full refresh."""
        return self.readable and self.subscribed

    @property
    def stale(self) -> bool:
        """True once the table has gone unread for three refreshes (Redis away, or a refresh
        failing): the proxy still serves it, and says so."""
        return self.age_s > 3 * self._refresh_s

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
        # until every task has ended. The client is the proxy's, which closes it.
        pending = {task for task in self._tasks if not task.done()}
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def load_alias(self, alias: str) -> None:
        raw = decode_hash(await self._redis.hgetall(alias_key(alias)))
        if not raw and alias not in self._aliases:
            self.routes.pop(alias, None)
            return
        table = RoutingTable.build({alias: raw}, self._aliases, self.routes)
        route = table.routes.get(alias)
        if route is None:  # invalid, and never valid here before (an alias only Redis knows)
            self.routes.pop(alias, None)
        else:
            self.routes[alias] = route
        invalid = {name: why for name, why in self.invalid.now.items() if name != alias}
        self.invalid.update(invalid | table.invalid)
        kept = self.routes.get(alias)
        found = await read_exclusions(self._redis, [kept] if kept else [])
        self.exclusions.set_alias(alias, found.get(alias, {}))

    async def load_all(self) -> None:
        hashes = {}
        async for key in self._redis.scan_iter(match="ratchet:alias:*", count=500):
            name = alias_of_key(key)
            if name is not None:
                hashes[name] = decode_hash(await self._redis.hgetall(alias_key(name)))
        table = RoutingTable.build(hashes, self._aliases, self.routes)
        exclusions = await read_exclusions(self._redis, table.routes.values())
        self.routes = table.routes
        self.invalid.update(table.invalid)
        self.exclusions.replace(exclusions)
        self.loaded_at = time.monotonic()
        self.readable = True

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.load_all()
            except (redis.RedisError, OSError) as exc:
                if self.readable:
                    log.warning("routing registry unreachable (%s); serving the last table", exc)
                self.readable = False
            except Exception:
                # Never let the table freeze silently: log, keep serving, try again next time
                # (the table's age, in /readyz and the metrics, shows it is not moving).
                log.exception("routing refresh failed; serving the last table")

    async def _listen(self) -> None:
        backoff = 0.2
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(CHANNEL)
                # Changes made while we were disconnected are caught by this full reload.
                await self.load_all()
                self.subscribed = True
                backoff = 0.2
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    await self.load_alias(message["data"].decode(errors="replace"))
                    self.loaded_at = time.monotonic()
            except asyncio.CancelledError:
                raise
            except (redis.RedisError, OSError) as exc:
                if self.subscribed:
                    log.warning("registry subscription lost (%s); retrying", exc)
                self.subscribed = False
                self.readable = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py


class ExcludedReplicas(Collector):
    """``ratchet_fleet_version_excluded``, read at scrape time from the routing cache."""

    def __init__(self, routing: RoutingCache) -> None:
        self.routing = routing

    @staticmethod
    def family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "ratchet_fleet_version_excluded",
            "1 while a vLLM replica is out of a routed version's rotation: it could not load "
            "the version before its gate (learner/served_check.py), so none of that version's "
            "requests go to it",
            labels=["alias", "version", "replica"],
        )

    def describe(self) -> Iterator[Metric]:
        # Its name and labels without a sample: a fleet with no exclusion still declares them.
        yield self.family()

    def collect(self) -> Iterator[Metric]:
        family = self.family()
        for alias, version, replica in self.routing.exclusions.entries():
            family.add_metric([alias, str(version), replica], 1)
        yield family

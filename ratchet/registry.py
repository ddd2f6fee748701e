"""The routing registry in Redis: which version of each alias is live, and which is on canary.

Keys (ARCHITECTURE.md): ``ratchet:alias:<alias>`` (hash), ``ratchet:alias:<alias>:history``
(list, newest first), and the ``ratchet:registry`` pub/sub channel, published on every change so
proxies refresh at once. Writers use :class:`RegistryWriter`; the proxy reads through its own
cache (``proxy/routing.py``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
import redis

from ratchet.records import LifecycleEvent, utc_now
from ratchet.secrets import keyed_hash
from ratchet.settings import AliasConfig

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

log = logging.getLogger(__name__)

CHANNEL = "ratchet:registry"
HISTORY_LIMIT = 1000


def alias_key(alias: str) -> str:
    return f"ratchet:alias:{alias}"


def history_key(alias: str) -> str:
    return f"ratchet:alias:{alias}:history"


def served_name(alias: str, version: int, base_model: str) -> str:
    """The name vLLM serves a version under: the base model's own name for v0."""
    return base_model if version == 0 else f"{alias}@v{version}"


@dataclass(frozen=True, slots=True)
class AliasRoute:
    alias: str
    base_model: str
    active: int = 0
    canary: int | None = None
    canary_weight: float = 0.0
    paused: bool = False
    updated_at: str | None = None

    @property
    def on_canary(self) -> bool:
        """True while some requests go to a canary version."""
        return self.canary is not None and self.canary_weight > 0.0

    def pick(
        self, sticky_key: str | None, *, key_hash: str | None, secret: bytes
    ) -> tuple[int, str]:
        """Choose (version, arm) for one request: random, or sticky per (API key, sticky key).

        The draw is a keyed hash under the server secret: without it a client cannot tell
        which arm a sticky value lands on, and the same value under another API key draws
        afresh. Keyed by alias and canary version too, so each canary draws a fresh cohort.
        """
        if self.canary is None or self.canary_weight <= 0.0:
            return self.active, "active"
        if sticky_key is None:
            draw = random.random()
        else:
            digest = keyed_hash(
                secret, "canary", self.alias, str(self.canary), key_hash or "", sticky_key
            )
            draw = int(digest[:16], 16) / 2**64
        if draw < self.canary_weight:
            return self.canary, "canary"
        return self.active, "active"

    def to_hash(self) -> dict[str, str]:
        return {
            "active": str(self.active),
            "canary": "" if self.canary is None else str(self.canary),
            "canary_weight": repr(self.canary_weight),
            "base_model": self.base_model,
            "paused": "1" if self.paused else "0",
            "updated_at": self.updated_at or utc_now(),
        }

    @classmethod
    def from_hash(cls, alias: str, data: dict[str, str], default_base: str) -> AliasRoute:
        canary = data.get("canary") or ""
        return cls(
            alias=alias,
            base_model=data.get("base_model") or default_base,
            active=int(data.get("active") or 0),
            canary=int(canary) if canary else None,
            canary_weight=float(data.get("canary_weight") or 0.0),
            paused=data.get("paused") == "1",
            updated_at=data.get("updated_at"),
        )


def decode_hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }


class RegistryWriter:
    """Synchronous writes of the routing table (CLI, learner). Every change is published."""

    def __init__(self, redis_url: str, aliases: dict[str, AliasConfig]) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.aliases = aliases

    def read(self, alias: str) -> AliasRoute | None:
        raw = decode_hash(self.redis.hgetall(alias_key(alias)))
        config = self.aliases.get(alias)
        if not raw:
            return AliasRoute(alias=alias, base_model=config.base_model) if config else None
        return AliasRoute.from_hash(alias, raw, config.base_model if config else "")

    def read_all(self) -> dict[str, AliasRoute]:
        routes = {
            name: AliasRoute(alias=name, base_model=cfg.base_model)
            for name, cfg in self.aliases.items()
        }
        for key in self.redis.scan_iter(match="ratchet:alias:*", count=500):
            key = key.decode()
            if key.endswith(":history"):
                continue
            name = key.removeprefix("ratchet:alias:")
            route = self.read(name)
            if route is not None:
                routes[name] = route
        return routes

    def write(
        self,
        route: AliasRoute | None,
        event: LifecycleEvent | None = None,
        *,
        alias: str | None = None,
        also: Callable[[Any], None] | None = None,
    ) -> AliasRoute | None:
        """Change a route and/or append an event to the alias's history, in one transaction.

        ``route=None`` appends the event only (``alias`` names whose history). ``also(pipe)`` may
        queue more commands into the same MULTI, so a caller's own state (the learner's trained
        group ids) is stored atomically with the outcome it belongs to.
        """
        name = route.alias if route is not None else alias or (event.alias if event else None)
        if name is None:
            raise ValueError("write() needs a route, an alias or an event")
        pipe = self.redis.pipeline(transaction=True)
        if route is not None:
            route = replace(route, updated_at=utc_now())
            # redis types a hash's fields as any encodable value; a dict's key type is invariant.
            fields: dict[FieldT, EncodableT] = dict(route.to_hash().items())
            pipe.hset(alias_key(name), mapping=fields)
        if event is not None:
            pipe.lpush(history_key(name), event.to_json())
            pipe.ltrim(history_key(name), 0, HISTORY_LIMIT - 1)
        if also is not None:
            also(pipe)
        if route is not None:
            pipe.publish(CHANNEL, name)
        pipe.execute()
        return route

    def history(self, alias: str, limit: int = 20) -> list[dict[str, Any]]:
        return [orjson.loads(item) for item in self.redis.lrange(history_key(alias), 0, limit - 1)]

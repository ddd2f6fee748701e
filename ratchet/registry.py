"""The routing registry in Redis: which version of each alias is live, and which is on canary.

Keys (ARCHITECTURE.md): ``ratchet:alias:<alias>`` (hash), ``ratchet:alias:<alias>:history``
(list, newest first), and the ``ratchet:registry`` pub/sub channel, published on every change so
proxies refresh at once. Writers use :class:`RegistryWriter`; the proxy reads through its own
cache (``proxy/routing.py``).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
import redis

from ratchet.lease import Lease
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


CHANGE_ATTEMPTS = 50


class RouteContended(RuntimeError):
    """A route that changed under every attempt to change it."""


class InvalidRoute(ValueError):
    """An alias's hash in Redis that does not describe a route (say, a field written by hand)."""


def _version_field(alias: str, field: str, value: str) -> int:
    try:
        version = int(value)
    except ValueError:
        version = -1
    if version < 0:
        raise InvalidRoute(f"{alias_key(alias)}: {field} is {value!r}, not a version number >= 0")
    return version


def _weight_field(alias: str, value: str) -> float:
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not 0.0 <= weight <= 1.0:  # NaN fails this too
        raise InvalidRoute(
            f"{alias_key(alias)}: canary_weight is {value!r}, not a number in [0, 1]"
        )
    return weight


def _base_field(alias: str, value: str | None, aliases: Mapping[str, AliasConfig]) -> str:
    """The hash's base_model, only if ratchet.yaml names it as some alias's base model.

    v0 is served under this name, and vLLM looks a name it does not serve up as a LoRA folder
    under its adapter store (the filesystem resolver joins it onto the path): ``../x`` or an
    absolute path would load any adapter on the vLLM host. Only the operator's own names pass.
    """
    config = aliases.get(alias)
    base = value or (config.base_model if config else "")
    if base not in {cfg.base_model for cfg in aliases.values()}:
        shown = repr(base[:80]) + ("..." if len(base) > 80 else "")
        raise InvalidRoute(
            f"{alias_key(alias)}: base_model is {shown}, not the base_model of an alias in "
            "ratchet.yaml"
        )
    return base


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
    def from_hash(
        cls, alias: str, data: dict[str, str], aliases: Mapping[str, AliasConfig]
    ) -> AliasRoute:
        """The route a hash describes; :class:`InvalidRoute` naming the field if it does not.
        Without a ``base_model`` field, the alias's own from ratchet.yaml."""
        canary = data.get("canary") or ""
        return cls(
            alias=alias,
            base_model=_base_field(alias, data.get("base_model"), aliases),
            active=_version_field(alias, "active", data.get("active") or "0"),
            canary=_version_field(alias, "canary", canary) if canary else None,
            canary_weight=_weight_field(alias, data.get("canary_weight") or "0"),
            paused=data.get("paused") == "1",
            updated_at=data.get("updated_at"),
        )


def decode_hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode(errors="replace") if isinstance(k, bytes) else k): (
            v.decode(errors="replace") if isinstance(v, bytes) else v
        )
        for k, v in raw.items()
    }


def alias_of_key(key: bytes | str) -> str | None:
    """The alias a ``ratchet:alias:*`` key routes, or None for its history list."""
    name = key.decode(errors="replace") if isinstance(key, bytes) else key
    if name.endswith(":history"):
        return None
    return name.removeprefix("ratchet:alias:")


@dataclass
class RoutingTable:
    """Routes built from the aliases' hashes. One invalid hash never costs the others their
    route: its alias keeps the route it had (``previous``), or its ratchet.yaml default, and is
    listed in ``invalid`` with why."""

    routes: dict[str, AliasRoute]
    invalid: dict[str, str]

    @classmethod
    def build(
        cls,
        hashes: dict[str, dict[str, str]],
        aliases: dict[str, AliasConfig],
        previous: dict[str, AliasRoute] | None = None,
    ) -> RoutingTable:
        routes = {
            name: AliasRoute(alias=name, base_model=cfg.base_model) for name, cfg in aliases.items()
        }
        invalid: dict[str, str] = {}
        for name, data in hashes.items():
            if not data:
                continue
            try:
                routes[name] = AliasRoute.from_hash(name, data, aliases)
            except InvalidRoute as exc:
                invalid[name] = str(exc)
                if previous and name in previous:
                    routes[name] = previous[name]
        return cls(routes, invalid)


class InvalidRoutes:
    """Which aliases' hashes are invalid now, logged once when one turns invalid (or its reason
    changes) and once when it is fixed: a refresh every second must not flood the log."""

    def __init__(self) -> None:
        self.now: dict[str, str] = {}

    def update(self, invalid: dict[str, str]) -> list[str]:
        """Take the latest table's ``invalid``; return the aliases newly invalid."""
        new = [alias for alias, why in invalid.items() if self.now.get(alias) != why]
        for alias in new:
            log.warning("alias %s skipped, its last valid route kept: %s", alias, invalid[alias])
        for alias in self.now.keys() - invalid.keys():
            log.info("alias %s: its route is valid again", alias)
        self.now = dict(invalid)
        return new


class RegistryWriter:
    """Synchronous writes of the routing table (CLI, learner). Every change is published."""

    def __init__(self, redis_url: str, aliases: dict[str, AliasConfig]) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.aliases = aliases

    def read(self, alias: str) -> AliasRoute | None:
        return self._route_of(alias, decode_hash(self.redis.hgetall(alias_key(alias))))

    def _route_of(self, alias: str, raw: dict[str, str]) -> AliasRoute | None:
        config = self.aliases.get(alias)
        if not raw:
            return AliasRoute(alias=alias, base_model=config.base_model) if config else None
        return AliasRoute.from_hash(alias, raw, self.aliases)

    def change(
        self,
        alias: str,
        compute: Callable[[AliasRoute | None], tuple[AliasRoute, LifecycleEvent]],
        also: Callable[[Any], None] | None = None,
        replace_invalid: bool = False,
        fence: Lease | None = None,
    ) -> tuple[AliasRoute, LifecycleEvent]:
        """Read the alias's route, ``compute`` the new one (and its event) from it, and write
        both only if nobody changed the route in between (WATCH, then MULTI); if someone did,
        read again and compute again. So a promotion computed before a concurrent pause cannot
        write the route back unpaused. ``compute`` may raise to give up.

        An invalid hash raises InvalidRoute, unless ``replace_invalid`` (an operator's explicit
        ``ratchet alias set``): then the change starts from the alias's defaults and repairs it.

        With a ``fence``, the lease's key is watched too and must hold the lease's token: a
        holder whose lease expired or was taken gets LeaseLost and writes nothing.
        """
        key = alias_key(alias)
        for _ in range(CHANGE_ATTEMPTS):
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key, *([fence.key] if fence else []))  # type: ignore[no-untyped-call]
                    if fence is not None:
                        fence.check(pipe.get(fence.key))
                    raw = decode_hash(pipe.hgetall(key))
                    route, event = compute(self._current(alias, raw, replace_invalid))
                    pipe.multi()
                    written = self._queue(pipe, alias, route, event, also)
                    pipe.execute()
                except redis.WatchError:
                    continue
            assert written is not None
            return written, event
        raise RouteContended(f"{key} kept changing; {CHANGE_ATTEMPTS} attempts gave up")

    def _current(self, alias: str, raw: dict[str, str], replace_invalid: bool) -> AliasRoute | None:
        try:
            return self._route_of(alias, raw)
        except InvalidRoute:
            if not replace_invalid:
                raise
            config = self.aliases.get(alias)
            if config is None:
                raise
            # Repaired from ratchet.yaml, never from the hash (its base_model may be the fault).
            return AliasRoute(alias=alias, base_model=config.base_model)

    def read_all(self, previous: dict[str, AliasRoute] | None = None) -> RoutingTable:
        hashes = {}
        for key in self.redis.scan_iter(match="ratchet:alias:*", count=500):
            name = alias_of_key(key)
            if name is not None:
                hashes[name] = decode_hash(self.redis.hgetall(alias_key(name)))
        return RoutingTable.build(hashes, self.aliases, previous)

    def write(
        self,
        route: AliasRoute | None,
        event: LifecycleEvent | None = None,
        *,
        alias: str | None = None,
        also: Callable[[Any], None] | None = None,
        fence: Lease | None = None,
    ) -> AliasRoute | None:
        """Change a route and/or append an event to the alias's history, in one transaction.

        ``route=None`` appends the event only (``alias`` names whose history). ``also(pipe)`` may
        queue more commands into the same MULTI, so a caller's own state (the learner's trained
        group ids) is stored atomically with the outcome it belongs to. With a ``fence`` it is
        written only while that lease is held (LeaseLost otherwise), as in :meth:`change`.
        """
        name = route.alias if route is not None else alias or (event.alias if event else None)
        if name is None:
            raise ValueError("write() needs a route, an alias or an event")
        if fence is None:
            pipe = self.redis.pipeline(transaction=True)
            route = self._queue(pipe, name, route, event, also)
            pipe.execute()
            return route
        for _ in range(CHANGE_ATTEMPTS):
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(fence.key)  # type: ignore[no-untyped-call]
                    fence.check(pipe.get(fence.key))
                    pipe.multi()
                    written = self._queue(pipe, name, route, event, also)
                    pipe.execute()
                except redis.WatchError:
                    continue  # renewed or taken meanwhile: check again
            return written
        raise RouteContended(f"{fence.key} kept changing; {CHANGE_ATTEMPTS} attempts gave up")

    def _queue(
        self,
        pipe: Any,
        name: str,
        route: AliasRoute | None,
        event: LifecycleEvent | None,
        also: Callable[[Any], None] | None,
    ) -> AliasRoute | None:
        """Queue one change's commands into a MULTI; the route as it will be stored."""
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
        return route

    def history(self, alias: str, limit: int = 20) -> list[dict[str, Any]]:
        return [orjson.loads(item) for item in self.redis.lrange(history_key(alias), 0, limit - 1)]


KEEP = object()  # set_route: leave the canary as it is


def set_route(
    writer: RegistryWriter,
    alias: str,
    actor: str,
    active: int | None = None,
    canary: int | object | None = KEEP,
    weight: float | None = None,
    forced: list[str] | None = None,
) -> AliasRoute:
    """An operator's routing change (``ratchet alias set``, the console's canary weight): the
    given parts of the alias's route, with a ``route`` event naming ``actor``. LookupError for an
    alias not in the config; an invalid hash is replaced, starting from the defaults. ``forced``:
    the gate verdicts the operator overrode (ratchet/verdict.py), kept in the event's reason so
    the console's history shows the override."""
    if weight is not None and not 0.0 <= weight <= 1.0:
        raise ValueError(f"the canary weight must be in [0, 1], not {weight}")
    if active is not None and active < 0:
        raise ValueError(f"the active version must be >= 0, not {active}")
    overrode = {"forced": True, "reason": "forced: " + "; ".join(forced)} if forced else {}

    def compute(route: AliasRoute | None) -> tuple[AliasRoute, LifecycleEvent]:
        if route is None:
            raise LookupError(f"unknown alias {alias!r}: add it to ratchet.yaml first")
        new = route
        if active is not None:
            new = replace(new, active=active)
        if canary is not KEEP:
            assert canary is None or isinstance(canary, int)
            new = replace(new, canary=canary)
            if new.canary is None:
                new = replace(new, canary_weight=0.0)
        if weight is not None:
            new = replace(new, canary_weight=weight)
        event = LifecycleEvent(
            alias=alias,
            kind="route",
            version=new.active,
            previous_version=route.active,
            actor=actor,
            detail={"canary": new.canary, "canary_weight": new.canary_weight, **overrode},
        )
        return new, event

    new, _ = writer.change(alias, compute, replace_invalid=True)
    return new

"""Replicas out of one version's rotation: a vLLM replica that could not load a candidate before
its gate (learner/served_check.py) is never sent that version's requests; it still serves every
other version.

Kept in Redis as ``ratchet:excluded:<alias>:v<N>``, a hash of replica URL to the reason, written
by the learner (:func:`exclude`) with ``learner.served_check.exclusion_ttl_s`` to live, which the
canary watcher renews while the version is the alias's active or canary one (:func:`renew`): an
exclusion lasts while its version is routed and lapses once the version has left the registry.
The watcher also asks each excluded replica again (learner/readmission.py) and takes back
(:func:`readmit`) one that now serves the version as trained: a replica that restarted with the
store in view, or a new pod that was given an excluded one's address.
Each write publishes the alias on ``ratchet:registry``, so the proxies read it with the alias's
route (proxy/routing.py) into a :class:`VersionExclusions`, which the choice of replica asks
per request by served name: a dict lookup, never a Redis call.

v0 is the base model under its own name, which every replica serves: it is never excluded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis

from ratchet.registry import CHANNEL, AliasRoute, decode_hash, served_name

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

NONE: frozenset[str] = frozenset()

# Per alias, per version: each excluded replica and why.
Exclusions = dict[int, dict[str, str]]


def excluded_key(alias: str, version: int) -> str:
    return f"ratchet:excluded:{alias}:v{version}"


def routed_versions(route: AliasRoute) -> list[int]:
    """The versions a route sends requests to that can be excluded (not v0)."""
    return sorted({v for v in (route.active, route.canary) if v})


def exclude(
    client: redis.Redis, alias: str, version: int, reasons: Mapping[str, str], ttl_s: float
) -> None:
    """Take each replica in ``reasons`` out of ``version``'s rotation, for ``ttl_s`` unless
    renewed, and tell the proxies."""
    if not reasons or version <= 0:
        return
    key = excluded_key(alias, version)
    pipe = client.pipeline(transaction=True)
    fields: dict[FieldT, EncodableT] = dict(reasons.items())
    pipe.hset(key, mapping=fields)
    pipe.expire(key, max(1, round(ttl_s)))
    pipe.publish(CHANNEL, alias)
    pipe.execute()


def readmit(client: redis.Redis, alias: str, version: int, replicas: Iterable[str]) -> None:
    """Put each of ``replicas`` back in ``version``'s rotation (it serves it now), and tell the
    proxies."""
    fields = list(replicas)
    if not fields:
        return
    pipe = client.pipeline(transaction=True)
    pipe.hdel(excluded_key(alias, version), *fields)
    pipe.publish(CHANNEL, alias)
    pipe.execute()


def read_versions(client: redis.Redis, alias: str, versions: Iterable[int]) -> Exclusions:
    """The exclusions of ``versions`` of one alias (v0 has none), in one round trip."""
    wanted = sorted({v for v in versions if v > 0})
    if not wanted:
        return {}
    pipe = client.pipeline(transaction=False)
    for version in wanted:
        pipe.hgetall(excluded_key(alias, version))
    answers: list[Any] = pipe.execute()
    return {v: decode_hash(raw) for v, raw in zip(wanted, answers, strict=True) if raw}


def renew(client: redis.Redis, routes: Iterable[AliasRoute], ttl_s: float) -> None:
    """Keep the exclusions of every routed version for another ``ttl_s`` (a missing key stays
    missing)."""
    pipe = client.pipeline(transaction=False)
    queued = False
    for route in routes:
        for version in routed_versions(route):
            pipe.expire(excluded_key(route.alias, version), max(1, round(ttl_s)))
            queued = True
    if queued:
        pipe.execute()


def read_excluded(client: redis.Redis, alias: str, version: int) -> dict[str, str]:
    return decode_hash(client.hgetall(excluded_key(alias, version)))


async def read_exclusions(
    client: aioredis.Redis, routes: Iterable[AliasRoute]
) -> dict[str, Exclusions]:
    """The exclusions of each route's routed versions, in one round trip; an alias with none
    maps to an empty dict."""
    wanted = [(route.alias, v) for route in routes for v in routed_versions(route)]
    found: dict[str, Exclusions] = {route.alias: {} for route in routes}
    if not wanted:
        return found
    pipe = client.pipeline(transaction=False)
    for alias, version in wanted:
        pipe.hgetall(excluded_key(alias, version))
    answers: list[Any] = await pipe.execute()
    for (alias, version), raw in zip(wanted, answers, strict=True):
        if raw:
            found[alias][version] = decode_hash(raw)
    return found


class VersionExclusions:
    """The replicas out of each routed version's rotation, as last read: :meth:`barred` by
    served name on every request, replaced whole per alias when the routing table is read."""

    def __init__(self) -> None:
        self.by_alias: dict[str, Exclusions] = {}
        self._by_served: dict[str, frozenset[str]] = {}

    def barred(self, served: str) -> frozenset[str]:
        """The replicas a request for ``served`` (a served name) must not go to."""
        return self._by_served.get(served, NONE) if self._by_served else NONE

    def set_alias(self, alias: str, exclusions: Exclusions) -> None:
        if exclusions:
            self.by_alias[alias] = exclusions
        else:
            self.by_alias.pop(alias, None)
        self._rebuild()

    def replace(self, by_alias: Mapping[str, Exclusions]) -> None:
        self.by_alias = {alias: found for alias, found in by_alias.items() if found}
        self._rebuild()

    def add(self, alias: str, version: int, reasons: Mapping[str, str]) -> None:
        """A client's own exclusion, before any routing table says so (the learner's gate)."""
        if version > 0 and reasons:
            self.by_alias.setdefault(alias, {}).setdefault(version, {}).update(reasons)
            self._rebuild()

    def entries(self) -> Iterator[tuple[str, int, str]]:
        """Each (alias, version, replica) out of rotation."""
        for alias, versions in sorted(self.by_alias.items()):
            for version, reasons in sorted(versions.items()):
                for replica in sorted(reasons):
                    yield alias, version, replica

    def _rebuild(self) -> None:
        # Replaced, never mutated: a request reading the old dict meanwhile sees a whole one.
        self._by_served = {
            served_name(alias, version, ""): frozenset(reasons)
            for alias, versions in self.by_alias.items()
            for version, reasons in versions.items()
            if reasons
        }

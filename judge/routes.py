"""What the judge samples from, per alias: the route (active and canary versions), the carry
(the candidate the learner's next round starts from, ratchet/carry.py) and the replicas out of
each of those versions' rotation (ratchet/version_exclusion.py), read together in one Redis
round trip per group, the way the proxy's routing cache reads the exclusions with the route.

The exclusions read go into the judge's :class:`~ratchet.fleet.Replicas`, whose choice of
replica consults them by served name (a dictionary lookup): a group is never sampled from a
replica that cannot load its version (it would answer 404, and the group would be lost). The
keys read are those of the versions the last read found; a version new to the alias (a promotion,
a new canary or carried candidate) costs one more round trip, once.

While Redis is away or the alias's hash is invalid, the last valid route, carry and exclusions
are kept.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.asyncio as aioredis

from judge.metrics import JudgeMetrics
from ratchet.carry import Carry, carry_from_hash, carry_key, start_of_round
from ratchet.registry import AliasRoute, InvalidRoute, alias_key, decode_hash
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.version_exclusion import Exclusions, VersionExclusions, excluded_key

log = logging.getLogger(__name__)


class JudgeRoutes:
    """Each alias's route, carry and exclusions as last read (see the module docstring)."""

    def __init__(
        self,
        settings: RatchetSettings,
        client: aioredis.Redis,
        metrics: JudgeMetrics,
        exclusions: VersionExclusions,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.metrics = metrics
        self.exclusions = exclusions
        self.routes: dict[str, AliasRoute] = {}
        self.carries: dict[str, Carry | None] = {}  # the last read, for while Redis is away
        self.versions: dict[str, frozenset[int]] = {}  # whose exclusions the last read asked for

    async def route(self, alias: str, config: AliasConfig) -> AliasRoute:
        """The live route, from Redis, with the alias's carry and exclusions; the last one read
        while Redis is away or while the alias's hash is invalid."""
        known = sorted(self.versions.get(alias, frozenset()))
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(alias_key(alias))
            pipe.hgetall(carry_key(alias))
            for version in known:
                pipe.hgetall(excluded_key(alias, version))
            answers: list[Any] = await pipe.execute()
            data = decode_hash(answers[0])
            route = (
                AliasRoute.from_hash(alias, data, self.settings.aliases)
                if data
                else AliasRoute(alias=alias, base_model=config.base_model)
            )
            carry = carry_from_hash(answers[1])
            found = {v: decode_hash(raw) for v, raw in zip(known, answers[2:], strict=True) if raw}
            await self._exclusions(alias, route, carry, set(known), found)
        except (redis.RedisError, OSError):
            return self.routes.get(alias) or AliasRoute(alias=alias, base_model=config.base_model)
        except InvalidRoute as exc:
            log.warning("%s; sampling from its last valid route", exc)
            self.metrics.failures.labels(alias, "invalid_route").inc()
            return self.routes.get(alias) or AliasRoute(alias=alias, base_model=config.base_model)
        self.routes[alias] = route
        self.carries[alias] = carry
        return route

    def policy(self, alias: str, route: AliasRoute) -> int:
        """The version to sample from: where the alias's next round starts (the live version,
        or the candidate the learner carries on from, the canary included while it runs), by
        the carry read with the route."""
        rounds = self.settings.learner.max_candidate_rounds
        return start_of_round(self.carries.get(alias), route.active, rounds, route.canary).version

    def sampled_versions(self, route: AliasRoute, carry: Carry | None) -> frozenset[int]:
        """The versions a group of the alias may be sampled from now (v0 is never excluded)."""
        rounds = self.settings.learner.max_candidate_rounds
        policy = start_of_round(carry, route.active, rounds, route.canary).version
        return frozenset(v for v in (route.active, route.canary, policy) if v)

    async def _exclusions(
        self,
        alias: str,
        route: AliasRoute,
        carry: Carry | None,
        read: set[int],
        found: Exclusions,
    ) -> None:
        """The alias's exclusions handed to the replicas: those of the versions it samples
        from, read with the route, plus one read of any version the last read did not know."""
        wanted = self.sampled_versions(route, carry)
        missing = sorted(wanted - read)
        if missing:
            pipe = self.redis.pipeline(transaction=False)
            for version in missing:
                pipe.hgetall(excluded_key(alias, version))
            answers: list[Any] = await pipe.execute()
            found.update(
                (v, decode_hash(raw)) for v, raw in zip(missing, answers, strict=True) if raw
            )
        self.versions[alias] = wanted
        self.exclusions.set_alias(alias, {v: r for v, r in found.items() if v in wanted})

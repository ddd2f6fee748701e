"""The judge reads the replicas out of each sampled version's rotation with the alias's route
(judge/routes.py) and never samples a group from one: the active version's, and the carried
candidate's, whose exclusion a round wrote before its gate."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from judge.metrics import JudgeMetrics
from judge.routes import JudgeRoutes
from ratchet.carry import Carry, write_carry
from ratchet.fleet import Replicas
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.version_exclusion import exclude, readmit

GOOD, BAD = "http://a:8000", "http://b:8000"


def test_a_sampled_versions_excluded_replica_gets_none_of_its_groups(redis_url: str) -> None:
    config = AliasConfig()
    settings = RatchetSettings(redis_url=redis_url, aliases={"routed": config})
    sync = redis.Redis.from_url(redis_url)
    RegistryWriter(redis_url, settings.aliases).write(
        AliasRoute(alias="routed", base_model=config.base_model, active=2)
    )
    exclude(sync, "routed", 2, {BAD: "HTTP 404"}, ttl_s=3600)
    exclude(sync, "routed", 5, {GOOD: "HTTP 400"}, ttl_s=3600)
    replicas = Replicas([GOOD, BAD], resolve=False)

    async def run() -> list[tuple[int, frozenset[str]]]:
        client = aioredis.Redis.from_url(redis_url)
        routes = JudgeRoutes(settings, client, JudgeMetrics(), replicas.exclusions)
        seen = []
        route = await routes.route("routed", config)
        version = routes.policy("routed", route)
        seen.append((version, replicas.exclusions.barred(f"routed@v{version}")))
        async with replicas.use(f"routed@v{version}") as url:
            assert url == GOOD
        # The learner carries on from its rejected candidate v5: sampled from it, not from GOOD.
        pipe = sync.pipeline()
        write_carry(pipe, "routed", Carry(5, 2, 1, 0.4))
        pipe.execute()
        route = await routes.route("routed", config)
        version = routes.policy("routed", route)
        seen.append((version, replicas.exclusions.barred(f"routed@v{version}")))
        # Let back in (learner/readmission.py): the next read sees it.
        readmit(sync, "routed", 5, [GOOD])
        await routes.route("routed", config)
        seen.append((5, replicas.exclusions.barred("routed@v5")))
        await client.aclose()
        return seen

    assert asyncio.run(run()) == [(2, {BAD}), (5, {GOOD}), (5, frozenset())]

"""The judge's Redis cache, against a real redis-server: a repeated group is not judged twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from judge.metrics import JudgeMetrics
from judge.scoring import CACHE_INDEX, GroupScorer
from ratchet.bill import Bill
from ratchet.rewards.ruler import JudgeRequest, JudgeScores
from ratchet.settings import JudgeSettings, RewardConfig

PROMPT = [{"role": "user", "content": "q"}]


class CountingScorer(GroupScorer):
    calls = 0

    async def call_judge(
        self, alias: str, reward: RewardConfig, request: JudgeRequest, bill: Bill | None = None
    ) -> JudgeScores:
        self.calls += 1
        order = sorted(request.index_of.values())
        return JudgeScores(scores=[0.1 * (i + 1) for i in order], explanations=["e"] * len(order))


def test_repeated_group_comes_from_the_cache_with_a_ttl(redis_url: str) -> None:
    samples = [{"role": "assistant", "content": t} for t in ("a", "b", "c")]

    async def run() -> tuple[CountingScorer, list[Any], int]:
        client = aioredis.Redis.from_url(redis_url)
        metrics = JudgeMetrics()
        scorer = CountingScorer(JudgeSettings(cache_ttl_s=600), "http://unused", client, metrics)
        first = await scorer.score("a", RewardConfig(), PROMPT, None, samples)
        second = await scorer.score("a", RewardConfig(), PROMPT, None, samples)
        other = await scorer.score("a", RewardConfig(rubric="different"), PROMPT, None, samples)
        keys = [k async for k in client.scan_iter(match="ratchet:judge:cache:*")]
        ttl = await client.ttl(keys[0])
        await client.aclose()
        hits = metrics.cache_hits.labels("a")._value.get()
        assert hits == 1
        return scorer, [first.rewards, second.rewards, other.rewards, len(keys)], ttl

    scorer, (first, second, _, keys), ttl = asyncio.run(run())
    assert first == second == pytest.approx([0.1, 0.2, 0.3])
    assert scorer.calls == 2, "the second, identical group was judged again"
    assert keys == 2 and 0 < ttl <= 600


def test_redis_down_means_no_cache_not_a_failure() -> None:
    async def run() -> list[float]:
        client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        scorer = CountingScorer(JudgeSettings(), "http://unused", client, JudgeMetrics())
        score = await scorer.score(
            "a", RewardConfig(), PROMPT, None, [{"content": "x"}, {"content": "y"}]
        )
        await client.aclose()
        return score.rewards

    assert asyncio.run(run()) == pytest.approx([0.1, 0.2])


def test_the_cache_keeps_at_most_its_count_the_oldest_going_first(redis_url: str) -> None:
    async def run() -> tuple[CountingScorer, set[bytes], int]:
        client = aioredis.Redis.from_url(redis_url)
        settings = JudgeSettings(cache_ttl_s=600, cache_max_entries=100)
        scorer = CountingScorer(settings, "http://unused", client, JudgeMetrics())
        for i in range(130):
            prompt = [{"role": "user", "content": f"q{i}"}]
            await scorer.score(
                "a", RewardConfig(), prompt, None, [{"content": "x"}, {"content": "y"}]
            )
        keys = {k async for k in client.scan_iter(match="ratchet:judge:cache:*")}
        indexed = await client.zcard(CACHE_INDEX)
        # The newest is still a hit, the oldest is judged again.
        await scorer.score(
            "a",
            RewardConfig(),
            [{"role": "user", "content": "q129"}],
            None,
            [{"content": "x"}, {"content": "y"}],
        )
        calls_after_newest = scorer.calls
        await scorer.score(
            "a",
            RewardConfig(),
            [{"role": "user", "content": "q0"}],
            None,
            [{"content": "x"}, {"content": "y"}],
        )
        assert scorer.calls == calls_after_newest + 1, "an evicted entry was still a hit"
        assert calls_after_newest == 130
        await client.aclose()
        return scorer, keys, indexed

    _, keys, indexed = asyncio.run(run())
    assert len(keys) == 100 and indexed == 100

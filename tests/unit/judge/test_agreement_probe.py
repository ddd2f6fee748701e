"""The judge's agreement probe against a real Redis and a scripted vLLM: rated answers are scored
among re-samples, the pairs kept and the measures exported; failures are counted and dropped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web

from embedded.processes import free_port
from judge.agreement import AgreementProbe
from judge.metrics import JudgeMetrics
from judge.scoring import GroupScorer
from ratchet.bill import Bill
from ratchet.registry import AliasRoute
from ratchet.rewards.agreement import RatedExchange, agreement_key, decode_pair, to_judge_key
from ratchet.rewards.rated import RatedAnswer
from ratchet.settings import AliasConfig, JudgeSettings, RatchetSettings, RewardConfig

ALIAS = "judged"


class ContentJudge(GroupScorer):
    """RULER replaced by a rule on the text: an answer saying "good" scores 0.9, others 0.1."""

    served: list[dict[str, Any]]  # the first answer of each group judged: the rated one
    tools: list[list[dict[str, Any]] | None]  # the tools each group was judged with

    async def ruler(
        self,
        alias: str,
        reward: RewardConfig,
        prompt: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        samples: list[dict[str, Any]],
        bill: Bill | None = None,
    ) -> tuple[list[float], list[str]]:
        self.served.append(samples[0])
        self.tools.append(tools)
        scores = [0.9 if "good" in (s.get("content") or "") else 0.1 for s in samples]
        return scores, [""] * len(samples)


class FakeVllm:
    """Answers every sampling request with ``n`` plain answers; ``fail`` makes it answer 500."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = False

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.fail:
            return web.json_response({"error": "down"}, status=500)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": f"plain {i}"},
                "token_ids": [1, 2],
                "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                "finish_reason": "stop",
            }
            for i in range(body["n"])
        ]
        return web.json_response({"prompt_token_ids": [7, 8], "choices": choices})


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def rated(
    cid: str,
    answer: str,
    score: float,
    tool_calls: list[dict[str, Any]] | None = None,
    request: dict[str, Any] | None = None,
    replayable: bool = True,
) -> bytes:
    messages = [{"role": "user", "content": f"question {cid}"}]
    item = RatedAnswer(messages, answer, score, "alice", "h", cid, tool_calls=tool_calls)
    served = request or {"messages": messages}
    return RatedExchange(item, served if replayable else None).encode().encode()


async def probe_for(redis_url: str, vllm_url: str) -> tuple[AgreementProbe, Any]:
    config = AliasConfig(learning={"group_size": 4}, feedback={"agreement_window": 10})
    settings = RatchetSettings(redis_url=redis_url, vllm_url=vllm_url, aliases={ALIAS: config})
    client = aioredis.Redis.from_url(redis_url)
    metrics = JudgeMetrics()
    scorer = ContentJudge(JudgeSettings(), vllm_url + "/v1", None, metrics)
    scorer.served, scorer.tools = [], []

    async def route_of(alias: str, _: AliasConfig) -> AliasRoute:
        return AliasRoute(alias=alias, base_model=config.base_model, active=3)

    probe = AgreementProbe(
        settings, client, scorer, metrics, route_of, lambda _: [], asyncio.Semaphore(2), "key"
    )
    return probe, client


def gauge(metrics: JudgeMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"alias": ALIAS, **labels})


async def test_rated_answers_are_scored_among_resamples_and_measured(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    fake, url = vllm
    sync = redis.Redis.from_url(redis_url)
    sync.rpush(
        to_judge_key(ALIAS),
        rated("c1", "a good answer", 1.0),
        rated("c2", "a poor answer", 0.0),
        rated("c3", "good again", 1.0),
    )
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        assert await probe.probe(session, ALIAS) == 3
    await client.aclose()

    # Each was sampled from the live version, group_size - 1 re-samples beside the served answer.
    assert sorted(b["model"] for b in fake.bodies) == [f"{ALIAS}@v3"] * 3
    assert {b["n"] for b in fake.bodies} == {3}
    pairs = sorted(decode_pair(raw) for raw in sync.lrange(agreement_key(ALIAS), 0, -1))
    assert pairs == [(0.1, 0.0), (0.9, 1.0), (0.9, 1.0)]
    assert sync.llen(to_judge_key(ALIAS)) == 0
    metrics = probe.metrics
    assert gauge(metrics, "ratchet_judge_user_agreement_pairs") == 3
    accuracy = gauge(metrics, "ratchet_judge_user_agreement", measure="pairwise_accuracy")
    assert accuracy == 1.0
    assert gauge(metrics, "ratchet_judge_user_agreement_min") == 0.6
    assert gauge(metrics, "ratchet_judge_agreement_probes_total", outcome="scored") == 3


async def test_the_window_keeps_the_newest_pairs(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    _, url = vllm
    sync = redis.Redis.from_url(redis_url)
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        for batch in range(3):  # 3 x 8 rated answers through a window of 10
            sync.rpush(to_judge_key(ALIAS), *(rated(f"{batch}-{i}", "good", 1.0) for i in range(8)))
            assert await probe.probe(session, ALIAS) == 8
    await client.aclose()
    assert sync.llen(agreement_key(ALIAS)) == 10


async def test_an_answer_vllm_cannot_resample_is_counted_and_dropped(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    fake, url = vllm
    fake.fail = True
    sync = redis.Redis.from_url(redis_url)
    sync.rpush(to_judge_key(ALIAS), rated("c1", "good", 1.0))
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        assert await probe.probe(session, ALIAS) == 1
        assert await probe.probe(session, ALIAS) == 0  # dropped, not retried forever
    await client.aclose()
    assert sync.llen(agreement_key(ALIAS)) == 0
    assert gauge(probe.metrics, "ratchet_judge_agreement_probes_total", outcome="http_500") == 1


async def test_a_rated_tool_call_is_judged_as_the_call_that_was_served(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    _, url = vllm
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    redis.Redis.from_url(redis_url).rpush(to_judge_key(ALIAS), rated("t1", "", 1.0, [call]))
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        assert await probe.probe(session, ALIAS) == 1
    await client.aclose()
    assert isinstance(probe.scorer, ContentJudge)
    assert probe.scorer.served == [{"role": "assistant", "content": "", "tool_calls": [call]}]


async def test_a_rated_answer_is_resampled_from_the_request_it_answered(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    """The whole conversation, the tools and the output's constraints, as the answer was served:
    not the excerpt the reward model reads, and not a bare prompt."""
    fake, url = vllm
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    conversation = [
        {"role": "system", "content": "You answer about weather. " * 2000},  # past the excerpt
        {"role": "user", "content": "Oslo?"},
    ]
    request = {
        "messages": conversation,
        "tools": [tool],
        "tool_choice": "required",
        "response_format": {"type": "text"},
        "max_tokens": 12,
    }
    redis.Redis.from_url(redis_url).rpush(to_judge_key(ALIAS), rated("r1", "", 1.0, None, request))
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        assert await probe.probe(session, ALIAS) == 1
    await client.aclose()
    [body] = fake.bodies
    assert body["messages"] == conversation
    assert (body["tools"], body["tool_choice"], body["response_format"]) == (
        [tool],
        "required",
        {"type": "text"},
    )
    assert body["max_tokens"] <= 12  # the client's own cap bounds the re-samples
    assert isinstance(probe.scorer, ContentJudge)
    assert probe.scorer.tools == [[tool]]


async def test_entries_it_cannot_replay_or_read_are_counted_and_the_rest_scored(
    redis_url: str, vllm: tuple[FakeVllm, str]
) -> None:
    fake, url = vllm
    redis.Redis.from_url(redis_url).rpush(
        to_judge_key(ALIAS),
        rated("cut", "good", 1.0, replayable=False),  # its request was cut to fit Kafka
        b"{not json",
        json.dumps({"rated": {"answer": "no fields"}}).encode(),
        rated("ok", "good", 1.0),
    )
    probe, client = await probe_for(redis_url, url)
    async with aiohttp.ClientSession() as session:
        assert await probe.probe(session, ALIAS) == 4
        assert await probe.probe(session, ALIAS) == 0  # dropped, not retried
    await client.aclose()
    assert [b["messages"] for b in fake.bodies] == [[{"role": "user", "content": "question ok"}]]
    count = "ratchet_judge_agreement_probes_total"
    assert gauge(probe.metrics, count, outcome="not_replayable") == 1
    assert gauge(probe.metrics, count, outcome="bad_entry") == 2
    assert gauge(probe.metrics, count, outcome="scored") == 1

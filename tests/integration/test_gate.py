"""The learner's RULER gate for real: held-out prompts answered by two versions in the embedded
vLLM, each differing pair judged by the same vLLM (SmolLM2 through litellm, structured output)
in both presentation orders. A 135M judge's verdicts are not predictable; what the gate
guarantees about them is: every pair is either counted or accounted as failed, each judged pair
is shown in both orders, and identical answers are ties that cost no judge call. The gate's
sequential test stops as soon as a pass is out of reach: with 4 pairs drawn it always is (a pass
at alpha 0.05 needs at least 14 won pairs), so these gates stop after their first counted pair,
having judged the whole first wave."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from learner.gate import Gate
from learner.gate_verdict import GateResult
from ratchet.records import HeldoutPrompt, prompt_hash
from ratchet.settings import AliasConfig, GateConfig, RatchetSettings, RewardConfig
from tasks.demo import load_prompts
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded, free_port

pytestmark = pytest.mark.integration

PROMPTS = [
    HeldoutPrompt(
        prompt_hash=prompt_hash(p["messages"], None),
        alias=ALIAS,
        prompt_messages=p["messages"],
        traffic_request_id=f"gate-{i}",
    )
    for i, p in enumerate(load_prompts()[340:344])
]
SAMPLE = re.compile(r'<sample id="[^"]+">(.*?)</sample>')


def ruler_alias() -> AliasConfig:
    count = len(PROMPTS)
    return AliasConfig(
        base_model=BASE_MODEL,
        reward=RewardConfig(kind="ruler", judge_model=f"hosted_vllm/{BASE_MODEL}"),
        # Short answers keep the judge's prompt short; all prompts are in the first wave.
        gate=GateConfig(min_pairs=count, max_pairs=count, max_tokens=24),
    )


def gate_settings(env: Embedded, judge_api_base: str, gate_concurrency: int) -> RatchetSettings:
    judge = env.settings.judge.model_copy(
        # One attempt per order, so the judge calls seen are exactly the ones the gate made.
        update={"judge_api_base": judge_api_base, "judge_retries": 0}
    )
    learner = env.settings.learner.model_copy(update={"gate_concurrency": gate_concurrency})
    return env.settings.model_copy(update={"judge": judge, "learner": learner})


@asynccontextmanager
async def recording_judge(env: Embedded, seen: list[dict[str, Any]]) -> AsyncIterator[str]:
    """A pass-through to vLLM's /v1 that keeps each judge request body; yields its /v1 URL.
    It adds vLLM's key, as a judge endpoint of its own would hold its own."""
    vllm_url = env.settings.vllm_url

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(orjson.loads(body))
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{vllm_url}/v1/{request.match_info['path']}",
                data=body,
                headers={"content-type": "application/json", **env.vllm_headers},
            ) as reply,
        ):
            return web.Response(
                body=await reply.read(), status=reply.status, content_type="application/json"
            )

    app = web.Application()
    app.router.add_post("/v1/{path:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def presented(request: dict[str, Any]) -> tuple[str, list[str]]:
    """The conversation block and the samples' JSON in the order the judge was shown them."""
    user = next(m["content"] for m in request["messages"] if m["role"] == "user")
    return user.split("<sample", 1)[0], SAMPLE.findall(user)


def test_ruler_gate_judges_each_differing_pair_in_both_orders(embedded: Embedded) -> None:
    seen: list[dict[str, Any]] = []

    async def evaluate() -> GateResult:
        async with recording_judge(embedded, seen) as judge_url:
            gate = Gate(gate_settings(embedded, judge_url, gate_concurrency=16))
            # A random test adapter against the base: their answers differ.
            return await gate.evaluate(ALIAS, ruler_alias(), PROMPTS, f"{ALIAS}@v1", BASE_MODEL)

    result = asyncio.run(evaluate())
    print(f"RULER gate, {len(seen)} judge calls: {result}")

    assert result.drawn == len(PROMPTS) and result.reason, result
    assert result.pairs + result.failed_pairs <= len(PROMPTS), result
    # No pass is in reach of 4 pairs (tests/unit/learner/test_gate_bounds.py), so the first
    # counted pair must end the gate: one pair counted, however the judge voted.
    if result.pairs:
        assert result.pairs == 1 and "futile" in result.reason, result
        assert result.ci_low is not None and result.ci_low <= result.threshold, result
    by_prompt: dict[str, list[list[str]]] = {}
    for request in seen:
        # Structured output: the reply must be the scores object for exactly these samples.
        response_format = request["response_format"]
        assert response_format["type"] == "json_schema", response_format
        assert response_format["json_schema"]["strict"] is True, response_format
        conversation, samples = presented(request)
        assert len(samples) == 2, samples
        by_prompt.setdefault(conversation, []).append(samples)
    assert 1 <= len(by_prompt) <= len(PROMPTS), by_prompt.keys()
    both_orders = 0
    for orders in by_prompt.values():
        # One call per order, the second only when the first gave a usable verdict.
        assert len(orders) in (1, 2), orders
        if len(orders) == 2:
            first, second = orders
            assert first[0] != first[1] and second == first[::-1], orders
            both_orders += 1
    assert both_orders >= 1, "no pair was judged in both presentation orders"
    # A judge failure is a judged pair without a verdict; the answers themselves all arrived.
    assert result.failed_pairs <= len(by_prompt), result


def test_ruler_gate_counts_identical_answers_as_ties_without_a_judge(embedded: Embedded) -> None:
    # No judge listens here: a judge call would fail its pair.
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    # One request at a time, so each greedy answer is computed alone and the two are identical.
    gate = Gate(gate_settings(embedded, nowhere, gate_concurrency=1))
    result = asyncio.run(gate.evaluate(ALIAS, ruler_alias(), PROMPTS, BASE_MODEL, BASE_MODEL))
    # Waves of one pair: the first tie already puts a pass out of reach, so the gate stops there.
    assert (result.pairs, result.failed_pairs) == (1, 0), result
    assert result.stopped_early and "futile" in result.reason, result
    assert result.win_rate == 0.5 and not result.passed, result

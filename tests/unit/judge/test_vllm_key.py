"""The judge sends vLLM's key on every call it makes to vLLM: sampling a group, and the judge
model's call (litellm) when the judge model is that vLLM; and never vLLM's key elsewhere.

The vLLM here is a stand-in that, like the real one, refuses calls without the key. Whether the
real vLLM requires it is for the integration tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from embedded.processes import free_port
from judge.sampler import SamplingError, sample_group
from judge.service import JudgeService, ToSample
from ratchet.records import TRAFFIC_TOPIC, ScoredGroup, TrafficRecord
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, RatchetSettings
from tests.records import build_traffic_record
from tests.unit.embedded.keyed_vllm import keyed_vllm

KEY = "vllm-key-for-the-judge"
BODY = {"model": "m", "messages": [{"role": "user", "content": "q"}], "n": 2}


async def sample(url: str, key: str) -> Any:
    async with aiohttp.ClientSession() as session:
        return await sample_group(session, url, BODY, 10.0, key)


def test_sampling_sends_the_key() -> None:
    with keyed_vllm(KEY) as vllm:
        group = asyncio.run(sample(vllm.url, KEY))
        assert len(group.samples) == 2
        assert vllm.seen == [("POST", "/v1/chat/completions", f"Bearer {KEY}")]


def test_sampling_with_a_wrong_key_is_refused_and_counted_as_such() -> None:
    with keyed_vllm(KEY) as vllm, pytest.raises(SamplingError) as failed:
        asyncio.run(sample(vllm.url, "not-the-key"))
    assert failed.value.cause == "http_401"


def traffic() -> TrafficRecord:
    question = {"role": "user", "content": "What is 2 + 2?"}
    return build_traffic_record(request={"messages": [question]}, input_tokens=10)


def judge_service(vllm_url: str, **judge: Any) -> JudgeService:
    alias = AliasConfig(
        learning={"heldout_fraction": 0.0, "dedup_window_s": 0, "group_size": 2},
        reward={"kind": "ruler", "judge_model": "hosted_vllm/m"},
    )
    settings = RatchetSettings(
        vllm_url=vllm_url,
        vllm_api_key=KEY,
        # Redis is away: the judge routes from its config and judges without a cache.
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        aliases={"support": alias},
        judge={"judge_retries": 0, **judge},
    )
    return JudgeService(settings)


async def handle(service: JudgeService) -> list[Any]:
    record = traffic()
    message = SimpleNamespace(topic=TRAFFIC_TOPIC, partition=0, offset=0, value=record.to_json())
    async with aiohttp.ClientSession() as session:
        work = await service.classify(message)
        assert isinstance(work, ToSample)
        group = await service.group_for(session, work)
    await service.redis.aclose()
    return [group]


def test_the_judge_samples_and_judges_with_vllms_key() -> None:
    with keyed_vllm(KEY) as vllm:
        service = judge_service(vllm.url)
        [group] = asyncio.run(handle(service))
        assert isinstance(group, ScoredGroup)
        # One sampling call and one judge-model call (through litellm), both with the key.
        assert len(vllm.seen) == 2, vllm.seen
        assert vllm.authorized() == vllm.seen
        assert sorted(group.rewards) == [0.0, 1.0]


def test_an_explicit_judge_base_at_vllm_gets_the_key_another_base_does_not() -> None:
    with keyed_vllm(KEY) as vllm:
        service = judge_service(vllm.url, judge_api_base=vllm.url + "/v1/")
        reward = service.settings.aliases["support"].reward
        assert service.scorer.judge_model(reward).endpoint["api_key"] == KEY
        elsewhere = judge_service(vllm.url, judge_api_base="https://api.example.com/v1")
        endpoint = elsewhere.scorer.judge_model(reward).endpoint
        assert endpoint.get("api_key") != KEY


def test_without_a_configured_key_the_judge_uses_the_derived_one(tmp_path: Any) -> None:
    settings = RatchetSettings(home=tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    service = JudgeService(settings)
    reward = settings.aliases["support"].reward
    assert service.vllm_key == vllm_api_key(settings)
    assert service.scorer.judge_model(reward).endpoint["api_key"] == vllm_api_key(settings)

"""The gate sends vLLM's key on every call: both versions' answers to held-out prompts, and the
RULER judge call (litellm) when the judge model is that vLLM.

The vLLM here is a stand-in that, like the real one, refuses calls without the key. Whether the
real vLLM requires it is for the integration tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from learner.gate import Gate
from learner.gate_verdict import GateResult
from ratchet.records import HeldoutPrompt
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, RatchetSettings
from tests.unit.embedded.keyed_vllm import KeyedVllm, keyed_vllm

KEY = "vllm-key-for-the-gate"
PAIRS = 3
ALIAS = AliasConfig(
    reward={"kind": "ruler", "judge_model": "hosted_vllm/m"},
    gate={"min_pairs": PAIRS, "max_pairs": PAIRS},
)


def held_out() -> list[HeldoutPrompt]:
    return [
        HeldoutPrompt(
            prompt_hash=f"h{i}",
            alias="support",
            prompt_messages=[{"role": "user", "content": f"question {i}"}],
            traffic_request_id=f"r{i}",
        )
        for i in range(PAIRS)
    ]


def run_gate(vllm: KeyedVllm, key: str) -> GateResult:
    settings = RatchetSettings(vllm_url=vllm.url, vllm_api_key=key, judge={"judge_retries": 0})
    gate = Gate(settings)
    return asyncio.run(gate.evaluate("support", ALIAS, held_out(), "support@v2", "support@v1"))


def test_the_gate_answers_and_judges_with_vllms_key() -> None:
    with keyed_vllm(KEY) as vllm:
        result = run_gate(vllm, KEY)
        assert result.failed_pairs == 0
        # Two answers per prompt, then the pair judged in both orders.
        assert len(vllm.seen) == PAIRS * 4, vllm.seen
        assert vllm.authorized() == vllm.seen


def test_a_gate_without_the_right_key_gets_no_pairs() -> None:
    """The stand-in does refuse: the test above would see failures if the key were missing."""
    with keyed_vllm(KEY) as vllm:
        result = run_gate(vllm, "not-the-key")
        assert result.failed_pairs == PAIRS and not result.passed
        assert not vllm.authorized()


def test_the_gate_derives_the_key_like_every_service(tmp_path: Path) -> None:
    settings = RatchetSettings(home=tmp_path)
    assert Gate(settings).vllm_key == vllm_api_key(settings)

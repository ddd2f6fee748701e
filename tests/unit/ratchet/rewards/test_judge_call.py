"""The one judge call the judge and the gate share: where it goes, what litellm is asked, and how
attempts are retried, bounded and given up on. litellm's network call is replaced."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from ratchet.bill import Bill
from ratchet.rewards import judge_call
from ratchet.rewards.judge_call import (
    JudgeModel,
    JudgeUnavailable,
    ask_judge_once,
    backoff_s,
    judge_endpoint,
    judge_scores,
)
from ratchet.rewards.ruler import JudgeReplyError, JudgeRequest, JudgeScores, build_judge_request
from ratchet.settings import JudgeSettings, RatchetSettings
from tests.unit.embedded.keyed_vllm import keyed_vllm

PROMPT = [{"role": "user", "content": "q"}]
ANSWERS = [{"role": "assistant", "content": t} for t in ("A", "B")]
JUDGE = JudgeModel("hosted_vllm/m", {"api_base": "http://j/v1"}, max_tokens=64, timeout_s=5.0)


def test_judge_endpoint_defaults_and_overrides() -> None:
    settings = RatchetSettings()
    default_base = settings.vllm_url + "/v1"
    # The default judge is the embedded vLLM; other providers keep litellm's own defaults.
    assert judge_endpoint(settings.judge, "hosted_vllm/m", default_base) == {
        "api_base": "http://127.0.0.1:8401/v1",
        "api_key": "unused",
    }
    assert judge_endpoint(settings.judge, "openai/gpt-4o-mini", default_base) == {}
    custom = JudgeSettings(judge_api_base="http://judge:9/v1", judge_api_key="sk-j")
    assert judge_endpoint(custom, "openai/x", "http://unused") == {
        "api_base": "http://judge:9/v1",
        "api_key": "sk-j",
    }


VLLM_BASE = "http://vllm:8401/v1"
VLLM_KEY = "vllm-key"


@pytest.mark.parametrize(
    ("settings", "model", "expected"),
    [
        # Ratchet's own vLLM, by default or named explicitly (any trailing slash): its key.
        (JudgeSettings(), "hosted_vllm/m", {"api_base": VLLM_BASE, "api_key": VLLM_KEY}),
        (
            JudgeSettings(judge_api_base=VLLM_BASE + "/"),
            "openai/m",
            {"api_base": VLLM_BASE + "/", "api_key": VLLM_KEY},
        ),
        # An explicit judge key wins, even at vLLM's address.
        (
            JudgeSettings(judge_api_base=VLLM_BASE, judge_api_key="sk-j"),
            "hosted_vllm/m",
            {"api_base": VLLM_BASE, "api_key": "sk-j"},
        ),
        # Anywhere else vLLM's key never goes: another vLLM, a hosted provider.
        (
            JudgeSettings(judge_api_base="http://other-vllm:8000/v1"),
            "hosted_vllm/m",
            {"api_base": "http://other-vllm:8000/v1", "api_key": "unused"},
        ),
        (JudgeSettings(), "openai/gpt-4o-mini", {}),
        (
            JudgeSettings(judge_api_base="https://api.example.com/v1"),
            "openai/gpt-4o-mini",
            {"api_base": "https://api.example.com/v1"},
        ),
    ],
)
def test_vllms_key_goes_to_vllm_only(
    settings: JudgeSettings, model: str, expected: dict[str, str]
) -> None:
    assert judge_endpoint(settings, model, VLLM_BASE, VLLM_KEY) == expected
    assert JudgeModel.of(settings, model, VLLM_BASE, VLLM_KEY).endpoint == expected


def test_litellm_sends_vllms_key_as_a_bearer_token() -> None:
    """The real litellm call, to a stand-in vLLM that refuses calls without its key."""
    req = request()
    with keyed_vllm(VLLM_KEY) as vllm:
        judge = JudgeModel.of(JudgeSettings(), "hosted_vllm/m", vllm.url + "/v1", VLLM_KEY)
        verdict = asyncio.run(ask_judge_once(req, judge))
        assert sorted(verdict.scores) == [0.0, 1.0]
        assert vllm.seen == [("POST", "/v1/chat/completions", f"Bearer {VLLM_KEY}")]
        wrong = JudgeModel.of(JudgeSettings(), "hosted_vllm/m", vllm.url + "/v1", "wrong")
        with pytest.raises(Exception, match=r"401|Unauthorized"):
            asyncio.run(ask_judge_once(req, wrong))


def test_judge_model_takes_its_bounds_from_the_settings() -> None:
    settings = JudgeSettings(judge_max_tokens=123, judge_timeout_s=7.0)
    model = JudgeModel.of(settings, "hosted_vllm/m", "http://vllm/v1")
    assert model == JudgeModel(
        "hosted_vllm/m", {"api_base": "http://vllm/v1", "api_key": "unused"}, 123, 7.0
    )


def test_backoff_grows_to_a_cap_with_jitter() -> None:
    for attempt, base in ((1, 0.5), (2, 1.0), (3, 2.0), (5, 8.0), (9, 8.0)):
        waits = [backoff_s(attempt) for _ in range(200)]
        assert all(0.5 * base <= w <= 1.5 * base for w in waits)
        assert len(set(waits)) > 1  # jittered, so replicas do not retry in lock-step


def request(attempt: int = 0) -> JudgeRequest:
    return build_judge_request(PROMPT, ANSWERS, "be good", seed=attempt)


def reply_scoring(req: JudgeRequest, by_index: list[float]) -> Any:
    """A litellm-shaped reply that gives ``samples[i]`` the score ``by_index[i]``."""
    scores = {sid: {"explanation": "e", "score": by_index[req.index_of[sid]]} for sid in req.ids}
    content = orjson.dumps({"scores": scores}).decode()
    return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


def test_one_attempt_asks_litellm_once_and_reads_the_reply_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import litellm

    asked: list[dict[str, Any]] = []
    req = request()

    async def acompletion(**kwargs: Any) -> Any:
        asked.append(kwargs)
        return reply_scoring(req, [0.9, 0.1])

    monkeypatch.setattr(litellm, "acompletion", acompletion)
    latencies: list[float] = []
    verdict = asyncio.run(ask_judge_once(req, JUDGE, on_latency=latencies.append))
    assert verdict.scores == [0.9, 0.1]
    [kwargs] = asked
    assert kwargs["model"] == "hosted_vllm/m" and kwargs["api_base"] == "http://j/v1"
    assert kwargs["max_tokens"] == 64 and kwargs["temperature"] == 0.0
    assert kwargs["num_retries"] == 0  # the retries are judge_scores', each with a new request
    assert kwargs["response_format"] == req.response_format
    assert len(latencies) == 1 and latencies[0] >= 0


def test_a_judge_slower_than_its_timeout_is_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    async def never(**kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(litellm, "acompletion", never)
    slow = JudgeModel("m", {}, 8, timeout_s=0.05)
    with pytest.raises(TimeoutError):
        asyncio.run(ask_judge_once(request(), slow))


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(judge_call, "backoff_s", lambda attempt: 0.0)


def scripted(steps: list[Any], seen: list[JudgeRequest]) -> Any:
    async def attempt(req: JudgeRequest) -> JudgeScores:
        seen.append(req)
        step = steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        return JudgeScores(scores=step, explanations=["e"] * len(step))

    return attempt


@pytest.mark.usefixtures("no_backoff")
def test_each_retry_builds_its_own_request_until_a_reply_parses() -> None:
    seen: list[JudgeRequest] = []
    steps: list[Any] = [JudgeReplyError("schema", "x"), ConnectionError("down"), [0.3, 0.7]]
    built: list[int] = []

    def request_for(attempt: int) -> JudgeRequest:
        built.append(attempt)
        return request(attempt)

    verdict = asyncio.run(judge_scores(request_for, JUDGE, 2, attempt=scripted(steps, seen)))
    assert verdict.scores == [0.3, 0.7]
    assert built == [0, 1, 2] and [r.ids for r in seen] == [request(n).ids for n in range(3)]


@pytest.mark.usefixtures("no_backoff")
@pytest.mark.parametrize(
    ("last", "cause"),
    [
        (JudgeReplyError("missing_ids", "x"), "reply_missing_ids"),
        (TimeoutError(), "judge_timeout"),
        (RuntimeError("provider said no"), "judge_unavailable"),
    ],
)
def test_no_usable_verdict_names_the_last_cause(last: BaseException, cause: str) -> None:
    seen: list[JudgeRequest] = []
    steps = [ConnectionError("down"), last]
    with pytest.raises(JudgeUnavailable) as failed:
        asyncio.run(judge_scores(request, JUDGE, 1, attempt=scripted(steps, seen)))
    assert failed.value.cause == cause and len(seen) == 2


def test_retries_wait_a_backoff_between_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    backoffs: list[int] = []

    def backoff(attempt: int) -> float:
        backoffs.append(attempt)
        return 0.0

    monkeypatch.setattr(judge_call, "backoff_s", backoff)
    steps: list[Any] = [TimeoutError(), TimeoutError(), [0.5, 0.5]]
    asyncio.run(judge_scores(request, JUDGE, 2, attempt=scripted(steps, [])))
    assert backoffs == [1, 2]  # one before each retry, none before the first attempt


def test_the_limit_is_held_for_each_attempt_only() -> None:
    async def run() -> list[bool]:
        limit = asyncio.Semaphore(1)
        held: list[bool] = []

        async def attempt(req: JudgeRequest) -> JudgeScores:
            held.append(limit.locked())
            return JudgeScores([0.5, 0.5], ["e", "e"])

        await judge_scores(request, JUDGE, 0, limit=limit, attempt=attempt)
        held.append(limit.locked())
        return held

    assert asyncio.run(run()) == [True, False]


# --- what a call costs (ratchet/bill.py) ----------------------------------------------------------


def test_a_call_is_billed_with_the_servers_usage_and_a_local_judge_costs_nothing() -> None:
    """The real litellm call to a stand-in vLLM that reports usage 3 + 2 tokens."""
    req = request()
    bill = Bill()
    with keyed_vllm(VLLM_KEY) as vllm:
        judge = JudgeModel.of(JudgeSettings(), "hosted_vllm/m", vllm.url + "/v1", VLLM_KEY)
        asyncio.run(ask_judge_once(req, judge, bill=bill))
        asyncio.run(ask_judge_once(req, judge, bill=bill))
    assert (bill.judge_calls, bill.judge_input_tokens, bill.judge_output_tokens) == (2, 6, 4)
    assert bill.judge_cost_usd == 0.0 and bill.judge_seconds > 0


def test_a_priced_model_is_billed_from_litellms_price_map(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm
    from litellm import ModelResponse

    req = request()

    async def acompletion(**kwargs: Any) -> Any:
        content = reply_scoring(req, [0.9, 0.1]).choices[0].message.content
        return ModelResponse(
            model="gpt-4o-mini",
            choices=[{"message": {"role": "assistant", "content": content}}],
            usage={"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500},
        )

    monkeypatch.setattr(litellm, "acompletion", acompletion)
    bill = Bill()
    judge = JudgeModel("openai/gpt-4o-mini", {}, 64, 5.0)
    asyncio.run(ask_judge_once(req, judge, bill=bill))
    prices = litellm.model_cost["gpt-4o-mini"]  # the bundled map (no download)
    expected = 1000 * prices["input_cost_per_token"] + 500 * prices["output_cost_per_token"]
    assert bill.judge_cost_usd == pytest.approx(expected) and bill.judge_cost_usd > 0
    assert (bill.judge_input_tokens, bill.judge_output_tokens) == (1000, 500)


def test_a_failed_call_is_billed_as_a_call_with_its_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import litellm

    async def never(**kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(litellm, "acompletion", never)
    bill = Bill()
    with pytest.raises(TimeoutError):
        asyncio.run(ask_judge_once(request(), JudgeModel("m", {}, 8, timeout_s=0.05), bill=bill))
    assert bill.judge_calls == 1 and bill.judge_seconds >= 0.05 and bill.judge_cost_usd == 0

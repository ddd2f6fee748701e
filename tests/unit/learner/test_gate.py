"""The promotion gate: the pure decision (outcomes, the sequential test) and Gate.evaluate against a
small aiohttp server standing in for vLLM's /v1/chat/completions.

The stand-in answers by model name: ``good`` reproduces the prompt's ``EXPECTED: {...}`` object,
``bad`` answers the wrong object, anything else is a 404 (an adapter vLLM cannot load). Scoring
uses the real verifier ``ratchet.rewards.examples:exact_json_fields``. RULER is tested through
``_judge_pair`` with fake judges (position-biased and consistent), and once through the real
request builder and reply parser with litellm's call replaced.

The gate runs through ``asyncio.run`` here, as the learner runs it, so the stand-in server lives
on its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp import web

from embedded.processes import free_port
from learner.gate import Gate, GateError, answer_max_tokens
from learner.gate_scoring import PairScorer, pairwise_outcome, verifier_outcome
from learner.gate_verdict import decide, score_lift
from ratchet.records import HeldoutPrompt
from ratchet.rewards.reward_status import RewardStatus
from ratchet.settings import AliasConfig, GateConfig, LearnerSettings, RatchetSettings, RewardConfig

EXPECTED_LINE = re.compile(r"EXPECTED: (\{.*\})")
VERIFIER = "ratchet.rewards.examples:exact_json_fields"


# --- the stand-in vLLM ------------------------------------------------------------------------


@dataclass
class StandIn:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)


def _answer_for(model: str, prompt: str) -> str | None:
    expected = EXPECTED_LINE.search(prompt)
    if model == "good":
        return expected.group(1) if expected else "{}"
    if model == "bad":
        return '{"name": "nobody"}'
    return None


@pytest.fixture
def vllm() -> Iterator[StandIn]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    stand_in = StandIn(url=f"http://127.0.0.1:{port}")

    async def chat(request: web.Request) -> web.Response:
        if request.content_type != "application/json":  # vLLM refuses anything else
            return web.json_response({"error": {"message": "media type"}}, status=400)
        body = await request.json()
        stand_in.requests.append(body)
        prompt = body["messages"][-1]["content"]
        if "UNANSWERABLE" in prompt:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        content = _answer_for(body["model"], prompt)
        if content is None:
            return web.json_response(
                {"error": {"message": f"The model `{body['model']}` does not exist."}}, status=404
            )
        message = {"role": "assistant", "content": content}
        return web.json_response({"id": "c", "choices": [{"index": 0, "message": message}]})

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield stand_in
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def prompts(count: int, tag: str = "") -> list[HeldoutPrompt]:
    out = []
    for i in range(count):
        content = f'Extract the person. {tag}\nEXPECTED: {{"name": "p{i}", "year": {1800 + i}}}'
        out.append(
            HeldoutPrompt(
                prompt_hash=f"h{tag}{i}",
                alias="support",
                prompt_messages=[{"role": "user", "content": content}],
                traffic_request_id=f"r{i}",
            )
        )
    return out


GATE = GateConfig(min_pairs=8, max_pairs=64, threshold=0.5, max_tokens=64)
# All wins pass the sequential test (alpha 0.05, threshold 0.5) at the 16th pair of a gate
# that will look once at its last pair (half of alpha left for betting), at the 14th of a gate
# too short for that look (fewer than FINAL_LOOK_MIN_N pairs drawn); all losses fail it there.
DECISIVE = 16
DECISIVE_SHORT = 14


def verifier_alias(gate: GateConfig = GATE) -> AliasConfig:
    return AliasConfig(reward=RewardConfig(kind="verifier", verifier=VERIFIER), gate=gate)


def make_gate(url: str, concurrency: int = 4) -> Gate:
    settings = RatchetSettings(
        vllm_url=url, learner=LearnerSettings(gate_concurrency=concurrency, gate_timeout_s=10)
    )
    return Gate(settings)


def evaluate(
    gate: Gate,
    config: AliasConfig,
    held: list[HeldoutPrompt],
    cand: str,
    inc: str,
    progress: Callable[[int, int, float], None] | None = None,
):
    return asyncio.run(gate.evaluate("support", config, held, cand, inc, seed=7, progress=progress))


# --- the pure part ----------------------------------------------------------------------------


def test_verifier_outcome_is_the_sign_of_the_score_difference() -> None:
    assert verifier_outcome(0.9, 0.2) == 1.0
    assert verifier_outcome(0.2, 0.9) == 0.0
    assert verifier_outcome(0.5, 0.5) == 0.5
    assert verifier_outcome(0.5 + 1e-12, 0.5) == 0.5  # float noise is a tie


def test_pairwise_outcome_counts_only_agreeing_orders() -> None:
    assert pairwise_outcome(0.4, 0.1) == 1.0
    assert pairwise_outcome(-0.4, -0.1) == 0.0
    # The two orders disagree: the verdict follows the position, not the answer.
    assert pairwise_outcome(0.4, -0.4) == 0.5
    assert pairwise_outcome(-0.4, 0.4) == 0.5
    assert pairwise_outcome(0.4, 0.0) == 0.5


def test_decide_passes_only_with_enough_pairs_and_a_lower_bound_above_threshold() -> None:
    gate = GateConfig(min_pairs=20, max_pairs=64, threshold=0.5)
    passed = decide([1.0] * 40, gate)
    # The floor holds the pass back to min_pairs, then it stops: the rest are not needed.
    assert passed.passed and passed.pairs == 20 and passed.stopped_early
    assert passed.win_rate == 1.0 and passed.ci_low is not None and passed.ci_low > 0.5
    assert passed.evidence is not None and passed.evidence >= 3.0  # log(1/0.05)
    assert passed.alpha == 0.05 and passed.drawn == 40

    too_few = decide([1.0] * 19, gate)
    assert not too_few.passed
    assert "fewer than 20" in too_few.reason

    ties = decide([0.5] * 40, gate)
    assert not ties.passed and ties.win_rate == 0.5
    assert ties.ci_low is not None and ties.ci_low < 0.5 < (ties.ci_high or 0.0)

    # A win rate above the threshold whose bound still reaches below it does not pass.
    noisy = decide([1.0, 0.0, 1.0, 0.5] * 10, gate)
    assert noisy.win_rate is not None and noisy.win_rate > 0.5
    assert noisy.ci_low is not None and noisy.ci_low <= 0.5
    assert not noisy.passed


def test_decide_stops_on_a_clearly_worse_candidate() -> None:
    worse = decide([0.0] * 64, GATE)
    assert not worse.passed and worse.pairs == DECISIVE and worse.stopped_early
    assert worse.ci_high is not None and worse.ci_high < 0.5
    assert "upper bound" in worse.reason


def test_decide_gives_up_when_a_pass_is_out_of_reach() -> None:
    # Ties, then too few pairs left for even all wins to reach the evidence a pass needs.
    futile = decide([0.5] * 64, GATE)
    assert not futile.passed and futile.stopped_early and futile.pairs < 64
    assert "futile" in futile.reason
    # With more pairs drawn than the outcomes so far, the same ties are not futile yet.
    assert not decide([0.5] * 20, GATE, drawn=64).stopped_early


def test_decide_reads_outcomes_in_order() -> None:
    wins_first = decide([1.0] * DECISIVE + [0.0] * 30, GATE)
    assert wins_first.passed and wins_first.pairs == DECISIVE
    losses_first = decide([0.0] * DECISIVE + [1.0] * 30, GATE)
    assert not losses_first.passed and losses_first.pairs == DECISIVE


def test_a_pass_by_too_small_a_lift_is_refused_with_gate_min_lift() -> None:
    """Better more often than not, but by 0.02 a prompt: with gate.min_lift 0.05 it does not
    pass; without a lift measured (a judge that only ranks) it cannot show one."""
    wins = [1.0] * 20
    assert decide(wins, GATE, lift=(0.02, 0.01, 0.03)).passed  # no floor: the win rate decides
    floor = GATE.model_copy(update={"min_lift": 0.05})
    small = decide(wins, floor, lift=(0.02, 0.01, 0.03))
    assert not small.passed and "score lift +0.020 (gate.min_lift 0.05)" in small.reason
    assert small.lift == 0.02 and small.lift_low == 0.01 and small.lift_high == 0.03
    assert "no score lift measured" in decide(wins, floor).reason
    assert decide(wins, floor, lift=(0.08, 0.04, 0.12)).passed


def test_the_lift_is_the_mean_score_difference_with_a_seeded_interval() -> None:
    candidate, incumbent = [0.9, 0.8, 1.0, 0.7] * 5, [0.5, 0.8, 0.6, 0.7] * 5
    lift = score_lift(candidate, incumbent)
    assert lift is not None and lift[0] == pytest.approx(0.2)
    assert lift[1] < 0.2 < lift[2] and lift == score_lift(candidate, incumbent)
    assert score_lift([1.0], [0.0]) is None


def test_decide_without_pairs_is_a_result_not_a_crash() -> None:
    result = decide([], GATE, failed_pairs=3)
    assert not result.passed
    assert result.pairs == 0 and result.failed_pairs == 3
    assert result.win_rate is None and result.ci_low is None
    assert result.as_dict()["reason"] == "no held-out pairs"


# --- Gate.evaluate against the stand-in vLLM --------------------------------------------------


def test_a_better_candidate_passes_and_stops_early(vllm: StandIn) -> None:
    seen: list[tuple[int, int, float]] = []
    result = evaluate(
        make_gate(vllm.url, concurrency=4),
        verifier_alias(),
        prompts(40),
        "good",
        "bad",
        progress=lambda *update: seen.append(update),
    )
    assert result.passed, result.reason
    assert result.pairs == DECISIVE and result.failed_pairs == 0 and result.drawn == 40
    assert result.stopped_early and result.ci_low is not None and result.ci_low > 0.5
    assert result.win_rate == 1.0
    assert result.candidate_score == 1.0 and result.incumbent_score == 0.0
    # The effect size beside the win rate: every pair 1.0 against 0.0.
    assert (result.lift, result.lift_low, result.lift_high) == (1.0, 1.0, 1.0)
    assert result.as_dict()["lift"] == 1.0
    # Waves of 4 pairs in draw order until the 16th pair passed: 4 waves, 16 prompts answered
    # by each version (greedily, with the gate's settings), and none of the other 24.
    assert seen == [(4, 40, 1.0), (8, 40, 1.0), (12, 40, 1.0), (16, 40, 1.0)]
    assert sorted(r["model"] for r in vllm.requests) == ["bad"] * 16 + ["good"] * 16
    asked = {r["messages"][-1]["content"] for r in vllm.requests}
    assert asked == {p.prompt_messages[-1]["content"] for p in prompts(16)}
    assert all(r["temperature"] == 0.0 and r["max_tokens"] == 64 for r in vllm.requests)
    assert all(r["seed"] == 7 for r in vllm.requests)
    # The first pairs scored are kept for people to read, not sent with the gate event.
    assert len(result.sample) == DECISIVE
    first = result.sample[0]
    assert first.prompt_messages == prompts(1)[0].prompt_messages
    assert first.outcome == 1.0 and first.verdict == "candidate better"
    assert first.candidate != first.incumbent and "sample" not in result.as_dict()


class RetrainedMidGate:
    """A feedback alias's reward models, with a retrain (v2) going live after the gate began:
    scores an answer 1 unless it is the bad one, and notes which version scored it."""

    def __init__(self) -> None:
        self.reads = 0
        self.scored_by: list[int] = []

    def status(self, alias: str) -> RewardStatus:
        self.reads += 1
        return RewardStatus(1 if self.reads == 1 else 2, usable=True, reason="held-out AUC 0.9")

    def score(
        self, alias: str, status: RewardStatus, messages: list[Any], texts: list[str]
    ) -> tuple[list[float], str]:
        self.scored_by.append(status.version)
        return [0.0 if "nobody" in t else 1.0 for t in texts], f"{alias}.reward@v{status.version}"


def test_a_feedback_gate_scores_every_pair_with_the_reward_model_live_at_its_start(
    vllm: StandIn,
) -> None:
    models = RetrainedMidGate()
    settings = RatchetSettings(
        vllm_url=vllm.url, learner=LearnerSettings(gate_concurrency=4, gate_timeout_s=10)
    )
    gate = Gate(settings, models, models.status)  # type: ignore[arg-type]
    config = AliasConfig(reward=RewardConfig(kind="feedback"), gate=GATE)
    result = evaluate(gate, config, prompts(40), "good", "bad")
    assert result.passed and result.pairs == DECISIVE, result.reason
    assert models.reads == 1 and set(models.scored_by) == {1}, models.scored_by
    assert result.reward_model == "support.reward@v1"
    assert result.as_dict()["reward_model"] == "support.reward@v1"
    # A verifier's gate names no reward model.
    assert (
        evaluate(make_gate(vllm.url), verifier_alias(), prompts(16), "good", "bad").reward_model
        is None
    )


def test_a_worse_candidate_fails_early(vllm: StandIn) -> None:
    result = evaluate(make_gate(vllm.url), verifier_alias(), prompts(40), "bad", "good")
    assert not result.passed and result.stopped_early and result.pairs == DECISIVE
    assert result.win_rate == 0.0
    assert result.candidate_score == 0.0 and result.incumbent_score == 1.0


def test_the_same_answers_tie_and_fail(vllm: StandIn) -> None:
    result = evaluate(make_gate(vllm.url), verifier_alias(), prompts(10), "good", "good")
    assert not result.passed
    assert result.win_rate == 0.5 and result.ci_low is not None and result.ci_low < 0.5


def test_too_few_held_out_prompts_fail_even_when_all_are_won(vllm: StandIn) -> None:
    result = evaluate(make_gate(vllm.url), verifier_alias(), prompts(5), "good", "bad")
    assert not result.passed
    assert result.win_rate == 1.0 and "5 held-out pairs drawn, fewer than 8" in result.reason


def test_a_candidate_vllm_cannot_answer_loses_its_pairs(vllm: StandIn) -> None:
    """Left out, the prompts it fails on would be the ones it could not be judged on: a
    candidate that breaks exactly where it would lose would pass on the rest."""
    result = evaluate(make_gate(vllm.url), verifier_alias(), prompts(10), "support@v9", "bad")
    assert not result.passed
    assert result.pairs >= 1 and result.failed_pairs == 0  # it stops once a pass is out of reach
    assert result.win_rate == 0.0


def test_prompts_neither_version_answers_are_counted_and_left_out(vllm: StandIn) -> None:
    held = prompts(1, tag="UNANSWERABLE") + prompts(20)
    result = evaluate(make_gate(vllm.url), verifier_alias(), held, "good", "bad")
    assert result.passed, result.reason
    assert result.pairs == DECISIVE_SHORT and result.failed_pairs == 1


def test_a_gate_with_too_many_pairs_left_out_does_not_pass(vllm: StandIn) -> None:
    """3 of 17 pairs lost (above gate.max_failed_share, 0.1): the rest all won, but what was
    judged may not speak for the prompts."""
    held = prompts(3, tag="UNANSWERABLE") + prompts(20)
    result = evaluate(make_gate(vllm.url), verifier_alias(), held, "good", "bad")
    assert not result.passed
    assert result.win_rate == 1.0 and result.failed_pairs == 3
    assert "3 of 17 pairs failed (more than gate.max_failed_share" in result.reason
    lenient = GATE.model_copy(update={"max_failed_share": 0.2})
    assert evaluate(make_gate(vllm.url), verifier_alias(lenient), held, "good", "bad").passed


def test_tools_and_the_clients_tool_choice_are_sent_with_the_prompt(vllm: StandIn) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    held = [p.model_copy(update={"tools": [tool]}) for p in prompts(2)]
    evaluate(make_gate(vllm.url), verifier_alias(), held, "good", "bad")
    assert vllm.requests and all(r["tools"] == [tool] for r in vllm.requests)
    assert all("tool_choice" not in r for r in vllm.requests)
    vllm.requests.clear()
    # An agent that must act asked for a call: both versions answer it so, as it was served.
    required = [p.model_copy(update={"tool_choice": "required"}) for p in held]
    evaluate(make_gate(vllm.url), verifier_alias(), required, "good", "bad")
    assert vllm.requests and all(r["tool_choice"] == "required" for r in vllm.requests)


def test_a_verifier_that_cannot_score_a_prompt_is_a_gate_error(vllm: StandIn) -> None:
    # exact_json_fields raises on a prompt without an EXPECTED line: a broken task, not a loss.
    broken = HeldoutPrompt(
        prompt_hash="x",
        alias="support",
        prompt_messages=[{"role": "user", "content": "EXPECTED: not json"}],
        traffic_request_id="r",
    )
    with pytest.raises(GateError):
        evaluate(make_gate(vllm.url), verifier_alias(), [*prompts(2), broken], "good", "bad")


def test_one_gate_serves_many_rounds(vllm: StandIn) -> None:
    """The learner keeps one Gate and calls asyncio.run once per round: each run has a new event
    loop, and the gate's concurrency limit must work in all of them."""
    gate = make_gate(vllm.url, concurrency=1)
    for _ in range(2):
        result = evaluate(gate, verifier_alias(), prompts(20), "good", "bad")
        assert result.passed and result.pairs == DECISIVE_SHORT


def test_the_live_versions_greedy_answers_are_asked_once_while_it_stays_live(
    vllm: StandIn,
) -> None:
    """Rejected rounds are gated against the same live version again and again: its greedy
    answer to a prompt is the same each time, so vLLM is asked once; a new incumbent (or a
    sampled gate) is asked afresh."""
    gate = make_gate(vllm.url)
    first = evaluate(gate, verifier_alias(), prompts(20), "good", "bad")
    again = evaluate(gate, verifier_alias(), prompts(20), "good", "bad")
    assert (first.pairs, first.win_rate) == (again.pairs, again.win_rate) == (DECISIVE_SHORT, 1.0)
    models = [r["model"] for r in vllm.requests]
    assert models.count("good") == 32 and models.count("bad") == 16  # 16 answered, twice
    assert gate.incumbent_reused == 16

    def asked_of_incumbent(*args: Any) -> int:
        before = len(vllm.requests)
        result = evaluate(gate, *args)
        return sum(r["model"] == args[-1] for r in vllm.requests[before:]) - result.pairs

    assert asked_of_incumbent(verifier_alias(), prompts(20), "bad", "good") >= 0  # another one
    assert gate.incumbent_reused == 16
    sampled = verifier_alias(GATE.model_copy(update={"temperature": 0.7}))
    assert asked_of_incumbent(sampled, prompts(20), "bad", "good") >= 0
    assert asked_of_incumbent(sampled, prompts(20), "bad", "good") >= 0  # never reused
    assert gate.incumbent_reused == 16


# --- RULER: both presentation orders --------------------------------------------------------

CANDIDATE = {"role": "assistant", "content": "candidate's answer"}
INCUMBENT = {"role": "assistant", "content": "incumbent's answer"}
RULER_ALIAS = AliasConfig(gate=GATE)


def install_judge(monkeypatch: pytest.MonkeyPatch, judge: Any) -> list[tuple[int, int]]:
    """Replace the judge call; returns the presentation orders it was asked for."""
    orders: list[tuple[int, int]] = []

    async def judge_once(self, config, prompt, answers, order, seed):
        orders.append(tuple(order))
        return judge(answers, order)

    monkeypatch.setattr(PairScorer, "_judge_once", judge_once)
    return orders


def first_presented_wins(answers: list[dict[str, Any]], order: tuple[int, int]) -> list[float]:
    """Scores in the caller's order; whichever answer was shown first gets the high score."""
    scores = [0.0, 0.0]
    scores[order[0]] = 0.9
    scores[order[1]] = 0.2
    return scores


def prefers(content: str) -> Callable[..., list[float]]:
    def judge(answers: list[dict[str, Any]], order: tuple[int, int]) -> list[float]:
        return [0.9 if a["content"] == content else 0.2 for a in answers]

    return judge


def judge_pair(answers: tuple[dict[str, Any], dict[str, Any]]) -> float | None:
    gate = make_gate("http://127.0.0.1:1")
    return asyncio.run(gate.scorer._judge_pair(RULER_ALIAS, prompts(1)[0], answers, 0))


def test_a_position_biased_judge_gives_a_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    orders = install_judge(monkeypatch, first_presented_wins)
    assert judge_pair((CANDIDATE, INCUMBENT)) == 0.5
    assert sorted(orders) == [(0, 1), (1, 0)]


def test_a_consistent_judge_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    install_judge(monkeypatch, prefers(CANDIDATE["content"]))
    assert judge_pair((CANDIDATE, INCUMBENT)) == 1.0
    install_judge(monkeypatch, prefers(INCUMBENT["content"]))
    assert judge_pair((CANDIDATE, INCUMBENT)) == 0.0


def test_identical_answers_tie_without_a_judge_call(monkeypatch: pytest.MonkeyPatch) -> None:
    orders = install_judge(monkeypatch, prefers(CANDIDATE["content"]))
    assert judge_pair((CANDIDATE, dict(CANDIDATE))) == 0.5
    assert orders == []


def test_no_verdict_in_either_order_is_no_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    install_judge(monkeypatch, lambda answers, order: None if order == (1, 0) else [1.0, 0.0])
    assert judge_pair((CANDIDATE, INCUMBENT)) is None


def test_ruler_gate_with_a_biased_judge_never_passes(
    vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_judge(monkeypatch, first_presented_wins)
    result = evaluate(make_gate(vllm.url), RULER_ALIAS, prompts(10), "good", "bad")
    assert not result.passed and result.win_rate == 0.5
    assert result.candidate_score is None  # no verifier in a RULER gate


def test_ruler_gate_counts_unjudged_pairs_as_failed(
    vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def judge(answers: list[dict[str, Any]], order: tuple[int, int]) -> list[float] | None:
        if '"p0"' in answers[0]["content"]:
            return None  # no usable verdict on this prompt
        return [0.9, 0.2]  # the candidate, in both orders

    install_judge(monkeypatch, judge)
    result = evaluate(make_gate(vllm.url), RULER_ALIAS, prompts(20), "good", "bad")
    assert result.pairs == DECISIVE_SHORT and result.failed_pairs == 1
    assert result.win_rate == 1.0 and result.passed


def test_mixed_gate_weighs_ruler_and_verifier(
    vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_judge(monkeypatch, first_presented_wins)  # RULER: 0.5 on every pair
    config = AliasConfig(
        reward=RewardConfig(kind="mixed", verifier=VERIFIER, ruler_weight=0.25), gate=GATE
    )
    result = evaluate(make_gate(vllm.url), config, prompts(24), "good", "bad")
    # 0.25 x 0.5 (RULER tie) + 0.75 x 1.0 (the verifier prefers the candidate)
    assert result.win_rate == pytest.approx(0.875)
    assert result.passed


def test_judge_once_reads_scores_back_in_the_callers_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real request builder and parser: a judge that always scores the first sample
    it is shown highest must come out as a tie, whichever answer is the candidate."""
    import litellm

    async def acompletion(**kwargs: Any) -> Any:
        schema = kwargs["response_format"]["json_schema"]["schema"]
        shown = list(schema["properties"]["scores"]["properties"])  # ids, presentation order
        scores = {
            sample_id: {"explanation": "first is best", "score": 1.0 if i == 0 else 0.0}
            for i, sample_id in enumerate(shown)
        }
        content = orjson.dumps({"scores": scores}).decode()
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])

    monkeypatch.setattr(litellm, "acompletion", acompletion)
    assert judge_pair((CANDIDATE, INCUMBENT)) == 0.5
    assert judge_pair((INCUMBENT, CANDIDATE)) == 0.5


def test_the_gate_cuts_answers_where_the_alias_served_them() -> None:
    def held(tokens: int | None) -> HeldoutPrompt:
        return HeldoutPrompt(
            prompt_hash=f"h{tokens}",
            alias="a",
            prompt_messages=[{"role": "user", "content": "x"}],
            traffic_request_id="r",
            served_output_tokens=tokens,
        )

    prompts = [held(n) for n in (10, 20, 40, None)]
    # 1.25 x the 95th percentile of the served lengths (40), rounded up to 16s: 64
    assert answer_max_tokens(AliasConfig(), prompts) == 64
    # none known: the cap, as the judge samples a new alias's first groups
    assert answer_max_tokens(AliasConfig(), [held(None)]) == 1024
    # an explicit sampling.max_tokens, then gate.max_tokens, win
    assert answer_max_tokens(AliasConfig(sampling={"max_tokens": 48}), prompts) == 48
    config = AliasConfig(sampling={"max_tokens": 48}, gate={"max_tokens": 32})
    assert answer_max_tokens(config, prompts) == 32


def test_the_gate_asks_the_replica_of_each_version_and_steps_past_a_dead_one(
    vllm: StandIn,
) -> None:
    """With vllm_endpoints the gate answers each version from the replica the proxy would pick
    for it; a replica that refuses connections is passed over, and no pair is lost."""
    from embedded.processes import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    settings = RatchetSettings(
        vllm_url=vllm.url,
        vllm_endpoints=[dead, vllm.url],
        learner=LearnerSettings(gate_concurrency=4, gate_timeout_s=10),
    )
    gate = Gate(settings)
    result = evaluate(gate, verifier_alias(), prompts(40), "good", "bad")
    assert result.passed and result.failed_pairs == 0, result.reason
    assert dead in gate.replicas.failed_until  # tried once, then avoided


def test_a_replica_answering_5xx_is_ejected_for_the_gate_and_the_pairs_go_elsewhere(
    vllm: StandIn,
) -> None:
    """A replica whose engine is gone behind a live server (503 to everything: a fault the
    stand-in cannot show) counts a failure per answer under the proxy's ejection policy; after
    proxy.outlier_ejection.consecutive_failures it is left out, and the gate's later pairs are
    all answered by the other replica."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Broken(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.append(self.path)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(503)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    from ratchet.fleet import choose

    for _ in range(40):  # a port the ring sends the candidate's answers to first
        server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
        broken = f"http://127.0.0.1:{server.server_address[1]}"
        if choose("good", sorted([broken, vllm.url]), {}) == broken:
            break
        server.server_close()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = RatchetSettings.model_validate(
            {
                "vllm_url": vllm.url,
                "vllm_endpoints": [broken, vllm.url],
                "learner": {"gate_concurrency": 1, "gate_timeout_s": 10},
                "proxy": {"outlier_ejection": {"consecutive_failures": 2}},
            }
        )
        gate = Gate(settings)
        result = evaluate(gate, verifier_alias(), prompts(40), "good", "bad")
        # Its first two answers failed, which ejected it: it was asked nothing more.
        assert len(asked) == 2, asked
        assert gate.replicas.outliers.replicas[broken].ejections == 1
        assert result.failed_pairs <= 2, result.reason
    finally:
        server.shutdown()
        server.server_close()

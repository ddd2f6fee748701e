"""The judge's service-side logic without a model: eligibility, split, sampling payloads and
parsing, scoring orchestration (dedupe of identical samples, retries, verifiers), calibration
statistics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from kafka.errors import KafkaTimeoutError

from embedded.processes import free_port
from judge import calibrate as cal
from judge.marks import JudgeMarks, done_key
from judge.metrics import JudgeMetrics
from judge.sampler import (
    LENGTH_WINDOW,
    SamplingError,
    client_max_tokens,
    group_seed,
    parse_group,
    prompt_of,
    sampling_body,
    sampling_max_tokens,
)
from judge.scoring import GroupScorer, ScoringError, cached_verdict
from judge.service import (
    JudgeService,
    Ready,
    Skip,
    ToSample,
    fraction_of,
    group_id_of,
    is_heldout,
)
from ratchet.answer_length import auto_max_tokens
from ratchet.bill import Bill
from ratchet.carry import Carry, write_carry
from ratchet.records import (
    TRAFFIC_TOPIC,
    DeadLetter,
    HeldoutPrompt,
    ScoredGroup,
    TrafficRecord,
    answer_as_text,
    prompt_hash,
)
from ratchet.registry import AliasRoute, RegistryWriter, alias_key
from ratchet.rewards.reward_status import RewardStatus
from ratchet.rewards.ruler import JudgeReplyError, JudgeRequest, JudgeScores
from ratchet.settings import (
    AliasConfig,
    JudgeSettings,
    RatchetSettings,
    RewardConfig,
    SamplingConfig,
)
from tests.records import build_traffic_record
from tests.unit.embedded.keyed_vllm import keyed_vllm

PROMPT = [{"role": "user", "content": "q"}]


# ---- the prompt and the split ------------------------------------------------------------------
def test_prompt_ends_at_the_last_user_or_tool_turn() -> None:
    convo = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "t"},
        {"role": "assistant", "content": "trailing answer"},
    ]
    assert prompt_of(convo) == convo[:4]
    assert prompt_of([{"role": "system", "content": "s"}]) is None


SECRET = b"the server secret"


def test_heldout_split_is_deterministic_and_near_the_fraction() -> None:
    digests = [f"{i:064x}" for i in range(4000)]
    held = [d for d in digests if is_heldout(SECRET, d, 0.1)]
    assert held == [d for d in digests if is_heldout(SECRET, d, 0.1)]
    assert 0.08 < len(held) / len(digests) < 0.12
    assert not any(is_heldout(SECRET, d, 0.0) for d in digests)
    # Raising the fraction only adds prompts to the held-out side, never moves one out.
    assert set(held) <= {d for d in digests if is_heldout(SECRET, d, 0.2)}


def test_a_client_cannot_aim_prompts_at_the_heldout_split() -> None:
    """A client that picks prompts it expects to be held out (by the public hash the split used
    to be, or by a guessed secret) lands them there no more often than the fraction: the split
    is keyed with the server secret."""
    digests = [prompt_hash([{"role": "user", "content": f"crafted {i}"}]) for i in range(40_000)]
    aimed_public = [d for d in digests if fraction_of("heldout:" + d) < 0.1]
    aimed_guess = [d for d in digests if is_heldout(b"a guess at the secret", d, 0.1)]
    for aimed in (aimed_public, aimed_guess):
        assert len(aimed) > 3000  # the attacker's chosen prompts
        landed = sum(is_heldout(SECRET, d, 0.1) for d in aimed) / len(aimed)
        # Binomial(n ~ 4000, 0.1): 3 sigmas is about 0.014.
        assert 0.085 < landed < 0.115, landed


def test_group_id_is_stable_per_record_and_version() -> None:
    assert group_id_of("req-1", 3) == group_id_of("req-1", 3)
    assert group_id_of("req-1", 3) != group_id_of("req-1", 4) != group_id_of("req-2", 3)
    assert 0 <= fraction_of("x") < 1


def held_out_request(secret: bytes, fraction: float) -> list[dict[str, str]]:
    """A prompt the split holds out under this secret."""
    for i in range(10_000):
        messages = [{"role": "user", "content": f"q{i}"}]
        if is_heldout(secret, prompt_hash(messages), fraction):
            return messages
    raise AssertionError("no held-out prompt found")


def judge_for(secret: bytes, config: AliasConfig) -> JudgeService:
    service = JudgeService.__new__(JudgeService)
    # No Redis here: no marks of judged records.
    service.settings = RatchetSettings(
        aliases={"support": config}, judge=JudgeSettings(done_ttl_s=0)
    )
    service.secret = secret
    service.marks = JudgeMarks(aioredis.Redis(), done_ttl_s=0)  # never reached: no marks
    service.metrics = JudgeMetrics()
    service.answer_lengths = {}
    return service


def test_a_held_out_prompt_carries_the_servers_request_id_and_the_key() -> None:
    config = AliasConfig(learning={"heldout_fraction": 0.5, "dedup_window_s": 0})
    messages = held_out_request(SECRET, 0.5)
    record = traffic(
        request_id="3f2a" * 8,
        client_request_id="chosen-by-the-client",
        api_key_hash="hmac-sha256:abc",
        request={"messages": messages},
    )
    ready = asyncio.run(judge_for(SECRET, config).classify(polled(record.to_json())))
    assert isinstance(ready, Ready)
    held = ready.record
    assert isinstance(held, HeldoutPrompt)
    assert held.traffic_request_id == "3f2a" * 8 and held.api_key_hash == "hmac-sha256:abc"
    assert held.prompt_hash == prompt_hash(messages) and ready.seen
    assert held.served_output_tokens == record.output_tokens


def test_a_held_out_prompt_keeps_how_the_client_asked_for_its_tools() -> None:
    """tool_choice "required" (an agent that must act): the gate answers the prompt so too."""
    config = AliasConfig(learning={"heldout_fraction": 0.5, "dedup_window_s": 0})
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    messages = next(
        m
        for i in range(10_000)
        if is_heldout(SECRET, prompt_hash(m := [{"role": "user", "content": f"q{i}"}], [tool]), 0.5)
    )
    request = {"messages": messages, "tools": [tool], "tool_choice": "required"}
    ready = asyncio.run(
        judge_for(SECRET, config).classify(polled(traffic(request=request).to_json()))
    )
    assert isinstance(ready, Ready) and isinstance(ready.record, HeldoutPrompt)
    assert ready.record.tools == [tool] and ready.record.tool_choice == "required"


def traffic(**overrides: Any) -> TrafficRecord:
    return build_traffic_record(
        **{"request": {"messages": PROMPT}, "input_tokens": 10, **overrides}
    )


@pytest.mark.parametrize(
    ("record", "config", "reason"),
    [
        (traffic(), AliasConfig(learning={"enabled": False}), "learning_disabled"),
        (traffic(alias="other"), None, "learning_disabled"),
        (traffic(status=503), AliasConfig(), "failed_exchange"),
        (traffic(endpoint="completions"), AliasConfig(), "not_chat"),
        (traffic(truncated=["logprobs", "answer", "request"]), AliasConfig(), "truncated_prompt"),
        (traffic(), AliasConfig(learning={"sample_rate": 0.0}), "sampled_out"),
        (traffic(input_tokens=5000), AliasConfig(), "prompt_too_long"),
        (
            traffic(request={"messages": [{"role": "system", "content": "s"}]}),
            AliasConfig(),
            "no_prompt",
        ),
    ],
)
def test_ineligible_records_are_skipped_with_a_reason(
    record: TrafficRecord, config: AliasConfig | None, reason: str
) -> None:
    service = JudgeService.__new__(JudgeService)
    with pytest.raises(Skip) as skipped:
        service._eligible(record, config)
    assert skipped.value.reason == reason


def test_eligible_record_gives_prompt_and_tools() -> None:
    service = JudgeService.__new__(JudgeService)
    tools = [{"type": "function", "function": {"name": "f"}}]
    prompt, got_tools = service._eligible(
        traffic(request={"messages": PROMPT, "tools": tools}), AliasConfig()
    )
    assert prompt == PROMPT and got_tools == tools


# ---- sampling ------------------------------------------------------------------------------------
def test_sampling_body_asks_for_token_ids_and_logprobs_and_keeps_tools() -> None:
    request = {
        "messages": PROMPT,
        "tools": [{"type": "function"}],
        "tool_choice": "auto",
        "temperature": 0.0,
    }
    body = sampling_body("support@v2", PROMPT, request, 4, AliasConfig().sampling)
    assert body["model"] == "support@v2" and body["n"] == 4
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert body["tools"] == request["tools"] and body["tool_choice"] == "auto"
    # The alias's sampling settings, not the client's, decide how the group is drawn.
    assert body["temperature"] == SamplingConfig().temperature


def test_a_seeded_group_is_seeded_by_prompt_and_version() -> None:
    assert "seed" not in sampling_body("support@v2", PROMPT, {}, 4, AliasConfig().sampling)
    seed = group_seed(0, "digest-a", 2)
    assert (
        sampling_body("support@v2", PROMPT, {"seed": 7}, 4, SamplingConfig(), seed)["seed"] == seed
    )
    # The same prompt on the same version: the same seed; anything else: another one.
    assert seed == group_seed(0, "digest-a", 2)
    others = {
        group_seed(1, "digest-a", 2),
        group_seed(0, "digest-b", 2),
        group_seed(0, "digest-a", 3),
    }
    assert seed not in others and len(others) == 3
    # vLLM seeds a group's k-th answer with seed + k: room under 2**31 for any group.
    assert all(0 <= s < 2**30 for s in (seed, *others))


@pytest.mark.parametrize(
    ("lengths", "client_cap", "cap", "expected"),
    [
        ([], None, 1024, 1024),  # nothing served yet: the cap
        ([], 100, 1024, 100),  # ...or what the client allowed
        ([10] * 18 + [40] * 2, None, 1024, 64),  # p95 = 40 -> 50 -> rounded up to 64
        (list(range(1, 101)), None, 1024, 128),  # p95 = 95 -> 118.75 -> 128
        ([3, 4, 5], None, 1024, 16),  # at least 16
        ([300] * 10, 200, 1024, 200),  # never above the client's own max_tokens
        ([900] * 10, None, 1024, 1024),  # never above the cap
    ],
)
def test_automatic_max_tokens_follows_the_served_answers(
    lengths: list[int], client_cap: int | None, cap: int, expected: int
) -> None:
    assert auto_max_tokens(lengths, client_cap, cap) == expected


def test_max_tokens_reads_the_clients_cap_and_an_explicit_setting_wins() -> None:
    assert client_max_tokens({"max_tokens": 300, "max_completion_tokens": 120}) == 120
    assert client_max_tokens({"max_tokens": True}) is None and client_max_tokens({}) is None
    window = [40] * 20
    assert sampling_max_tokens(SamplingConfig(), {"max_tokens": 32}, window) == 32
    assert sampling_max_tokens(SamplingConfig(), {}, window) == 64
    assert sampling_max_tokens(SamplingConfig(max_tokens_cap=48), {}, window) == 48
    assert sampling_max_tokens(SamplingConfig(max_tokens=256), {"max_tokens": 32}, window) == 256
    body = sampling_body("m", PROMPT, {}, 4, SamplingConfig(), None, 64)
    assert body["max_tokens"] == 64 and body["n"] == 4  # one request shares the prompt


def test_the_judge_keeps_a_bounded_window_of_served_lengths_per_alias() -> None:
    config = AliasConfig(learning={"heldout_fraction": 0.0, "dedup_window_s": 0})
    service = judge_for(SECRET, config)
    for i in range(LENGTH_WINDOW + 10):
        record = traffic(request_id=f"r{i}", output_tokens=i + 1)
        asyncio.run(service.classify(polled(record.to_json())))
    window = service._lengths("support")
    assert len(window) == LENGTH_WINDOW and window[-1] == LENGTH_WINDOW + 10


def vllm_choice(index: int, ids: list[int], content: str | None = "x") -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content, "refusal": None},
        "token_ids": ids,
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": "t", "logprob": -0.5 * i} for i in ids]},
    }


def test_parse_group_orders_by_index_and_keeps_exact_ids() -> None:
    data = {"prompt_token_ids": [1, 2, 3], "choices": [vllm_choice(1, [7, 8]), vllm_choice(0, [5])]}
    group = parse_group(data, 2)
    assert group.prompt_token_ids == [1, 2, 3]
    assert [s.token_ids for s in group.samples] == [[5], [7, 8]]
    assert group.samples[1].logprobs == [-3.5, -4.0]
    assert "refusal" not in group.samples[0].message  # nulls dropped


@pytest.mark.parametrize(
    "data",
    [
        {"choices": [vllm_choice(0, [1])]},  # no prompt ids
        {"prompt_token_ids": [1], "choices": []},  # too few choices
        {
            "prompt_token_ids": [1],
            "choices": [{**vllm_choice(0, [1, 2]), "logprobs": {"content": []}}],
        },  # misaligned
    ],
)
def test_parse_group_refuses_incomplete_answers(data: dict[str, Any]) -> None:
    with pytest.raises(SamplingError):
        parse_group(data, 1)


# ---- scoring -------------------------------------------------------------------------------------
class ScriptedScorer(GroupScorer):
    """GroupScorer with the network call replaced by a script of replies or exceptions."""

    def __init__(self, script: list[Any], **settings: Any) -> None:
        super().__init__(
            JudgeSettings(judge_retries=2, **settings), "http://unused", None, JudgeMetrics()
        )
        self.script = script
        self.requests: list[JudgeRequest] = []

    async def call_judge(
        self, alias: str, reward: RewardConfig, request: JudgeRequest, bill: Bill | None = None
    ) -> JudgeScores:
        self.requests.append(request)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        # Score by content so the mapping back can be checked.
        order = sorted(request.index_of.values())
        return JudgeScores(scores=[step[i] for i in order], explanations=["e"] * len(order))


def answers(*texts: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": t} for t in texts]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_identical_samples_are_judged_once_and_mapped_back(monkeypatch: Any) -> None:
    no_backoff(monkeypatch)
    scorer = ScriptedScorer([[0.9, 0.1]])
    score = run(scorer.score("a", RewardConfig(), PROMPT, None, answers("A", "B", "A", "B")))
    assert score.rewards == [0.9, 0.1, 0.9, 0.1]
    assert len(scorer.requests) == 1 and len(scorer.requests[0].ids) == 2


def test_a_group_of_one_distinct_answer_is_not_sent_to_the_judge() -> None:
    scorer = ScriptedScorer([])
    score = run(scorer.score("a", RewardConfig(), PROMPT, None, answers("same", "same")))
    assert score.rewards[0] == score.rewards[1] and not scorer.requests


def no_backoff(monkeypatch: Any) -> None:
    monkeypatch.setattr("ratchet.rewards.judge_call.backoff_s", lambda attempt: 0.0)


def test_bad_replies_are_retried_then_the_group_is_dropped_with_the_cause(
    monkeypatch: Any,
) -> None:
    no_backoff(monkeypatch)
    bad = JudgeReplyError("missing_ids", "x")
    scorer = ScriptedScorer([bad, bad, bad])
    with pytest.raises(ScoringError) as failed:
        run(scorer.score("a", RewardConfig(), PROMPT, None, answers("A", "B")))
    assert failed.value.cause == "reply_missing_ids" and len(scorer.requests) == 3
    # Each retry presents the samples under fresh ids.
    assert len({r.ids for r in scorer.requests}) == 3

    recovering = ScriptedScorer([ConnectionError("down"), [0.2, 0.8]])
    score = run(recovering.score("a", RewardConfig(), PROMPT, None, answers("A", "B")))
    assert score.rewards == [0.2, 0.8]


def test_verifier_and_mixed_rewards() -> None:
    verifier = RewardConfig(kind="verifier", verifier="ratchet.rewards.examples:exact_json_fields")
    prompt = [{"role": "user", "content": 'Extract.\nEXPECTED: {"a": 1, "b": 2}'}]
    score = run(
        ScriptedScorer([]).score(
            "a", verifier, prompt, None, answers('{"a": 1, "b": 2}', '{"a": 1}', "no")
        )
    )
    assert score.rewards == [1.0, 0.5, 0.0] and score.judge_model is None
    mixed = RewardConfig(
        kind="mixed", verifier="ratchet.rewards.examples:exact_json_fields", ruler_weight=0.5
    )
    score = run(
        ScriptedScorer([[0.0, 1.0]]).score(
            "a", mixed, prompt, None, answers('{"a": 1, "b": 2}', "no")
        )
    )
    assert score.rewards == [0.5, 0.5] and score.rubric_hash


class FixedRewardModels:
    """Stands in for RewardModels: every answer gets the same predicted rating."""

    def __init__(self, rating: float) -> None:
        self.rating = rating
        self.read: list[str] = []  # the answers as the model was given them

    def score(
        self, alias: str, status: RewardStatus | None, messages: Any, answers: list[str]
    ) -> tuple[list[float], str]:
        assert status is not None and status.usable
        self.read.extend(answers)
        return [self.rating] * len(answers), f"{alias}.reward@v{status.version}"


def test_the_reward_model_reads_an_answers_tool_calls(redis_url: str) -> None:
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    samples = [{"role": "assistant", "content": None, "tool_calls": [call]}, *answers("Sunny.")]
    models = FixedRewardModels(0.5)

    async def scored() -> list[float]:
        scorer = ScriptedScorer([])
        scorer.cache = aioredis.Redis.from_url(redis_url)
        scorer.reward_models = models  # type: ignore[assignment]
        score = await scorer.score("a", RewardConfig(kind="feedback"), PROMPT, None, samples)
        await scorer.cache.aclose()
        return score.rewards

    RewardStatus(version=1, usable=True, reason="AUC 0.8").write(
        redis.Redis.from_url(redis_url), "a"
    )
    assert run(scored()) == [0.5, 0.5]
    assert models.read == [answer_as_text(samples[0]), "Sunny."] and "Oslo" in models.read[0]


def test_mixed_weighs_in_the_reward_model_once_it_is_usable(redis_url: str) -> None:
    mixed = RewardConfig(
        kind="mixed",
        verifier="ratchet.rewards.examples:exact_json_fields",
        ruler_weight=0.5,
        feedback_weight=0.5,
    )
    prompt = [{"role": "user", "content": 'Extract.\nEXPECTED: {"a": 1, "b": 2}'}]

    async def scored() -> tuple[list[float], str | None]:
        scorer = ScriptedScorer([[0.0, 1.0]])
        scorer.cache = aioredis.Redis.from_url(redis_url)
        scorer.reward_models = FixedRewardModels(1.0)  # type: ignore[assignment]
        score = await scorer.score("a", mixed, prompt, None, answers('{"a": 1, "b": 2}', "no"))
        await scorer.cache.aclose()
        return score.rewards, score.judge_model

    # No reward model yet: RULER and the verifier alone, as without feedback_weight.
    assert run(scored()) == ([0.5, 0.5], mixed.judge_model)
    client = redis.Redis.from_url(redis_url)
    RewardStatus(version=2, usable=False, reason="AUC 0.55").write(client, "a")
    assert run(scored())[0] == [0.5, 0.5]
    RewardStatus(version=2, usable=True, reason="AUC 0.8").write(client, "a")
    rewards, judged_by = run(scored())
    assert rewards == [0.75, 0.75] and judged_by == f"{mixed.judge_model}+a.reward@v2"


def test_a_failing_verifier_drops_the_group_with_a_cause() -> None:
    broken = RewardConfig(kind="verifier", verifier="ratchet.rewards.examples:no_such_function")
    with pytest.raises(ScoringError) as failed:
        run(ScriptedScorer([]).score("a", broken, PROMPT, None, answers("x", "y")))
    assert failed.value.cause.startswith("verifier_")


# ---- calibration statistics ----------------------------------------------------------------------
def test_position_bias_measures() -> None:
    assert cal.order_flips([0.9, 0.1], [0.9, 0.1]) == (0, 1)
    assert cal.order_flips([0.9, 0.1], [0.1, 0.9]) == (1, 1)
    group = cal.LabelledGroup(PROMPT, answers("a", "b"), [1.0, 0.0])
    # A judge that always prefers whatever it reads first.
    report = cal.summarise([(group, [1.0, 0.0], [0.0, 1.0])], failed=0)
    assert report.flip_rate == 1.0 and report.first_minus_last == 1.0
    fair = cal.summarise([(group, [1.0, 0.0], [1.0, 0.0])], failed=1)
    assert fair.flip_rate == 0.0 and fair.pairwise_accuracy == 1.0 and fair.failed == 1


def test_labels_file_errors_name_the_line(tmp_path: Any) -> None:
    path = tmp_path / "labels.jsonl"
    path.write_text(
        '{"prompt": [], "samples": ["a", "b"], "labels": [1, 0]}\n'
        '{"prompt": [], "samples": ["a"], "labels": [1, 0]}\n'
    )
    with pytest.raises(ValueError, match=r"labels\.jsonl:2"):
        cal.load_labels(path)


def test_an_invalid_route_samples_from_the_last_valid_one(redis_url: str) -> None:
    """A field written by hand into the alias's hash is counted; the judge goes on sampling from
    the version it last read instead of stopping on every batch."""
    config = AliasConfig()
    settings = RatchetSettings(redis_url=redis_url, aliases={"support": config})
    service = JudgeService(settings)
    writer = RegistryWriter(redis_url, settings.aliases)
    writer.write(AliasRoute(alias="support", base_model=config.base_model, active=2))

    async def route() -> AliasRoute:
        return await service._route("support", config)

    async def both() -> tuple[AliasRoute, AliasRoute]:
        first = await route()
        redis.Redis.from_url(redis_url).hset(alias_key("support"), "active", "two")
        second = await route()
        await service.redis.aclose()
        return first, second

    first, second = asyncio.run(both())
    assert first.active == 2 and second == first
    samples = service.metrics.registry.get_sample_value(
        "ratchet_judge_failures_total", {"alias": "support", "cause": "invalid_route"}
    )
    assert samples == 1.0


def test_a_record_another_replica_judged_is_skipped(redis_url: str) -> None:
    """A judge re-reading a batch another replica finished but never committed (it was killed,
    or the group rebalanced) skips each record whose outputs Kafka acknowledged."""
    config = AliasConfig(learning={"heldout_fraction": 0.5, "dedup_window_s": 0})
    settings = RatchetSettings(
        redis_url=redis_url, secret="a-test-secret", aliases={"support": config}
    )
    first, second = JudgeService(settings), JudgeService(settings)
    record = traffic(request={"messages": held_out_request(first.secret, 0.5)})

    async def both() -> None:
        ready = await first.classify(polled(record.to_json()))
        assert isinstance(ready, Ready) and isinstance(ready.record, HeldoutPrompt)
        await first.marks.mark_done([ready.record])
        with pytest.raises(Skip) as skipped:
            await second._classify(record, polled(record.to_json()))
        assert skipped.value.reason == "already_judged"
        assert await second.redis.ttl(done_key(record.request_id)) > 0
        await first.redis.aclose()
        await second.redis.aclose()

    asyncio.run(both())


def test_a_batch_kafka_never_acknowledged_is_neither_marked_nor_committed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped while the broker is away, the judge gives its batch up: the next judge (or the
    replica that takes the partition) must read it again and judge it, not skip it as judged."""
    config = AliasConfig(learning={"heldout_fraction": 0.5, "dedup_window_s": 0})
    settings = RatchetSettings(
        redis_url=redis_url,
        secret="a-test-secret",
        aliases={"support": config},
        judge=JudgeSettings(metrics_port=free_port()),
    )
    service = JudgeService(settings)
    record = traffic(request={"messages": held_out_request(service.secret, 0.5)})
    batches = [[polled(record.to_json())]]
    committed: list[bool] = []

    class BrokerAway:
        def send(self, *args: Any, **kwargs: Any) -> None:
            service.stopping.set()  # SIGTERM while the broker is away
            raise KafkaTimeoutError("broker away")

        def close(self, timeout: float | None = None) -> None:
            pass

    class Consumer:
        def commit(self) -> None:
            committed.append(True)

        def close(self) -> None:
            pass

    monkeypatch.setattr(service, "_connect", lambda: None)
    monkeypatch.setattr(service, "_poll", lambda: batches.pop() if batches else [])
    service.producer, service.consumer = BrokerAway(), Consumer()
    asyncio.run(service.run())

    assert not batches and not committed
    assert not redis.Redis.from_url(redis_url).exists(done_key(record.request_id))


def polled(value: bytes) -> SimpleNamespace:
    """A consumed message as kafka-python hands it over, as far as the judge reads it."""
    return SimpleNamespace(topic=TRAFFIC_TOPIC, partition=0, offset=7, value=value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{not json", "malformed"),
        (b'{"schema": "traffic/1", "alias": "support"}', "invalid"),
        # Parses, but is not what the judge expects: a string where the messages go.
        (traffic(request={"messages": "hi"}).to_json(), "handler_error"),
    ],
)
def test_a_poison_record_is_dead_lettered_and_counted(value: bytes, reason: str) -> None:
    service = judge_for(SECRET, AliasConfig(learning={"heldout_fraction": 0.0}))
    ready = asyncio.run(service.classify(polled(value)))
    assert isinstance(ready, Ready) and ready.seen is None
    letter = ready.record
    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.source_topic, letter.offset) == (reason, TRAFFIC_TOPIC, 7)
    assert letter.value.encode() == value and letter.consumer == "ratchet-judge"
    alias = "support" if reason == "handler_error" else "-"
    failures = service.metrics.registry.get_sample_value(
        "ratchet_judge_failures_total", {"alias": alias, "cause": reason}
    )
    assert failures == 1.0


def test_a_record_of_another_schema_is_skipped_not_dead_lettered() -> None:
    service = judge_for(SECRET, AliasConfig())
    value = b'{"schema": "traffic/2", "alias": "support"}'
    assert asyncio.run(service.classify(polled(value))) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"scores": [1.0]}',
        b'{"scores": "ab", "explanations": ["a", "b"]}',
        b'{"scores": [1.0, "x"], "explanations": ["a", "b"]}',
        b'{"scores": [1.0, NaN], "explanations": ["a", "b"]}',
        b'{"scores": [1.0], "explanations": ["a"]}',
        b"[1, 2]",
    ],
)
def test_a_malformed_cached_verdict_is_a_miss(raw: bytes) -> None:
    assert cached_verdict(raw, 2) is None


def test_a_cached_verdict_is_read_back() -> None:
    raw = b'{"scores": [1, 0.25], "explanations": ["good", "meh"]}'
    assert cached_verdict(raw, 2) == ([1.0, 0.25], ["good", "meh"])


def test_groups_are_sampled_from_where_the_next_round_starts(redis_url: str) -> None:
    """While the learner carries on from a rejected candidate, its next round trains on that
    candidate's own answers: the judge samples from it, not from the live version, and the
    group says so. A carry gated against another live version, or one that holds its rounds
    already, is not where a round starts: the live version is."""
    key = "vllm-key"
    alias = AliasConfig(
        learning={"heldout_fraction": 0.0, "dedup_window_s": 0, "group_size": 2},
        reward={"kind": "verifier", "verifier": "tests.unit.judge.test_judge_service:longer"},
    )
    client = redis.Redis.from_url(redis_url)

    def carry(value: Carry | None) -> None:
        pipe = client.pipeline()
        write_carry(pipe, "support", value)
        pipe.execute()

    with keyed_vllm(key) as vllm:
        settings = RatchetSettings(
            vllm_url=vllm.url,
            vllm_api_key=key,
            redis_url=redis_url,
            aliases={"support": alias},
            learner={"max_candidate_rounds": 2},
        )
        RegistryWriter(redis_url, settings.aliases).write(
            AliasRoute(alias="support", base_model=alias.base_model, active=2)
        )
        versions = []
        for i, value in enumerate(
            (None, Carry(5, 2, 1, 0.6), Carry(5, 1, 1, 0.6), Carry(6, 2, 2, 0.6))
        ):
            carry(value)
            service = JudgeService(settings)
            group = asyncio.run(sample(service, f"r{i}"))
            assert isinstance(group, ScoredGroup)
            assert group.samples[0].text.startswith(f"{group.response_model} answer")
            assert group.group_id == group_id_of(f"r{i}", group.version)
            assert group.replica == vllm.url  # the replica that sampled it, for its drift
            versions.append((group.version, group.response_model))
    assert versions == [(2, "support@v2"), (5, "support@v5"), (2, "support@v2"), (2, "support@v2")]


async def sample(service: JudgeService, request_id: str) -> Any:
    """A traffic record of PROMPT classified and sampled by ``service``: its group, or None."""
    record = build_traffic_record(
        request_id=request_id, request={"messages": PROMPT}, input_tokens=3
    )
    message = SimpleNamespace(topic=TRAFFIC_TOPIC, partition=0, offset=0, value=record.to_json())
    async with aiohttp.ClientSession() as session:
        work = await service.classify(message)
        assert isinstance(work, ToSample)
        return await service.group_for(session, work)


def longer(prompt: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """A verifier for the tests: the longer answer scores higher."""
    return min(1.0, len(sample.get("content") or "") / 100)


def test_a_group_carries_its_bill_and_a_spent_daily_budget_stops_sampling(redis_url: str) -> None:
    """The group's sampling tokens are vLLM's usage and its seconds the request's, as the
    counters say; once the alias's judge spend today reaches learning.max_cost_per_day, its
    records are skipped (daily_budget) until the next UTC day's key."""
    from ratchet.spend import read_spend, spend_key, today

    key = "vllm-key"
    alias = AliasConfig(
        learning={
            "heldout_fraction": 0.0,
            "dedup_window_s": 0,
            "group_size": 2,
            "max_cost_per_day": 0.5,
        },
        reward={"kind": "verifier", "verifier": "tests.unit.judge.test_judge_service:longer"},
    )

    client = redis.Redis.from_url(redis_url)
    with keyed_vllm(key) as vllm:
        settings = RatchetSettings(
            vllm_url=vllm.url, vllm_api_key=key, redis_url=redis_url, aliases={"support": alias}
        )
        RegistryWriter(redis_url, settings.aliases).write(
            AliasRoute(alias="support", base_model=alias.base_model)
        )
        service = JudgeService(settings)
        group = asyncio.run(sample(service, "r1"))
        assert isinstance(group, ScoredGroup) and group.bill is not None
        # keyed_vllm reports usage 3 prompt + 2 completion tokens.
        assert (group.bill.sample_input_tokens, group.bill.sample_output_tokens) == (3, 2)
        assert group.bill.sample_seconds > 0 and group.bill.judge_calls == 0  # a verifier
        sampled = service.metrics.registry.get_sample_value
        assert (
            sampled("ratchet_judge_sampled_tokens_total", {"alias": "support", "kind": "output"})
            == 2
        )
        assert sampled("ratchet_judge_sampling_seconds_sum", {"alias": "support"}) == pytest.approx(
            group.bill.sample_seconds, abs=0.01
        )

        client.set(spend_key("support", today()), 0.5)  # the judge and the gate spent the cap
        service = JudgeService(settings)  # one per event loop: its Redis client binds to one
        assert asyncio.run(sample(service, "r2")) is None
        skipped = service.metrics.registry.get_sample_value(
            "ratchet_judge_skipped_total", {"alias": "support", "reason": "daily_budget"}
        )
        assert skipped == 1 and read_spend(client, "support") == 0.5
        client.set(spend_key("support", today()), 0.49)
        assert isinstance(asyncio.run(sample(JudgeService(settings), "r3")), ScoredGroup)


def test_a_group_is_sampled_from_its_versions_replica_and_past_a_dead_one() -> None:
    """sample_from asks the replica the proxy would pick for the group's version; one that
    refuses connections is marked and the next one answers."""
    from embedded.processes import free_port
    from judge.sampler import sample_from
    from ratchet.fleet import Replicas, choose

    key = "vllm-key"
    dead = f"http://127.0.0.1:{free_port()}"
    with keyed_vllm(key) as vllm:
        replicas = Replicas([dead, vllm.url], resolve=False)
        # A served name the ring sends to the dead replica first.
        served = next(
            f"support@v{i}"
            for i in range(50)
            if choose(f"support@v{i}", [dead, vllm.url], {}) == dead
        )
        body = {"model": served, "messages": PROMPT, "n": 2, "max_tokens": 4}

        async def sample() -> Any:
            async with aiohttp.ClientSession() as session:
                return await sample_from(replicas, session, body, 10.0, key)

        group = asyncio.run(sample())
        assert len(group.samples) == 2 and group.samples[0].text.startswith(f"{served} answer")
        assert dead in replicas.failed_until and replicas.outstanding[dead] == 0

"""One batch through the judge, against a real Redis, with Kafka and vLLM replaced: held-out
prompts are delivered before any sampling ends, backpressure skips (and counts) without marking
a prompt seen, and the shared produced counter moves by the groups Kafka acknowledged."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from judge.backpressure import Backpressure
from judge.marks import JudgeMarks, SeenMark, flat_key, repeat_reason
from judge.sampler import SamplingError
from judge.service import JudgeService, ToSample, is_heldout
from ratchet.progress import LearnerProgress, produced_key, progress_key, publish
from ratchet.records import TRAFFIC_TOPIC, HeldoutPrompt, Record, ScoredGroup, prompt_hash
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import AliasConfig, JudgeSettings, LearnerSettings, RatchetSettings
from tests.records import build_traffic_record

SECRET = "a-test-secret"
ALIAS = "support"


def service_for(redis_url: str, **judge: Any) -> JudgeService:
    config = AliasConfig(learning={"heldout_fraction": 0.5, "dedup_window_s": 600})
    settings = RatchetSettings(
        redis_url=redis_url,
        secret=SECRET,
        aliases={ALIAS: config},
        judge=JudgeSettings(**judge),
        learner=LearnerSettings(batch_groups=4),
    )
    return JudgeService(settings)


def prompts(service: JudgeService, heldout: bool, count: int) -> list[list[dict[str, str]]]:
    """``count`` prompts on the given side of the split under the service's secret."""
    found = []
    for i in range(10_000):
        messages = [{"role": "user", "content": f"q{i}"}]
        if is_heldout(service.secret, prompt_hash(messages), 0.5) == heldout:
            found.append(messages)
            if len(found) == count:
                return found
    raise AssertionError("not enough prompts")


def message(
    request_id: str, messages: list[dict[str, str]], output_tokens: int = 20, client: str = "k"
) -> Any:
    record = build_traffic_record(
        request_id=request_id,
        request={"messages": messages},
        input_tokens=10,
        output_tokens=output_tokens,
        api_key_hash=client,
    )
    return SimpleNamespace(topic=TRAFFIC_TOPIC, partition=0, offset=1, value=record.to_json())


def group_of(work: ToSample) -> ScoredGroup:
    return ScoredGroup(
        group_id=work.record.request_id,
        alias=work.record.alias,
        version=0,
        response_model="m",
        prompt_messages=work.prompt,
        prompt_token_ids=[1],
        samples=[],
        rewards=[],
        traffic_request_id=work.record.request_id,
    )


class FakeKafka:
    """Records what the judge produced (in order) and whether it committed."""

    def __init__(self, service: JudgeService, monkeypatch: pytest.MonkeyPatch) -> None:
        self.produced: list[list[Record]] = []
        self.commits = 0
        self.on_produce: Callable[[list[Record]], None] = lambda outputs: None
        monkeypatch.setattr(service, "_produce", self._produce)
        monkeypatch.setattr(service, "_commit", self._commit)

    def _produce(self, outputs: list[Record]) -> bool:
        self.produced.append(outputs)
        self.on_produce(outputs)
        return True

    def _commit(self) -> bool:
        self.commits += 1
        return True


def run_batch(
    service: JudgeService,
    batch: list[Any],
    sampler: Callable[[Any, ToSample], Awaitable[ScoredGroup]],
    monkeypatch: pytest.MonkeyPatch,
) -> bool:
    monkeypatch.setattr(service, "_sample_and_score", sampler)

    async def go() -> bool:
        try:
            return await asyncio.wait_for(service.judge_batch(None, batch), 20)  # type: ignore[arg-type]
        finally:
            await service.redis.aclose()

    return asyncio.run(go())


def skipped(service: JudgeService, reason: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "ratchet_judge_skipped_total", {"alias": ALIAS, "reason": reason}
    )
    return value or 0.0


def test_held_out_prompts_are_delivered_before_sampling_ends(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampler that cannot finish until the held-out prompt has been produced: the batch only
    completes if held-out prompts do not wait for the batch's sampling."""
    service = service_for(redis_url)
    kafka = FakeKafka(service, monkeypatch)
    [held] = prompts(service, True, 1)
    train = prompts(service, False, 2)
    delivered = threading.Event()

    def on_produce(outputs: list[Record]) -> None:
        if any(isinstance(r, HeldoutPrompt) for r in outputs):
            delivered.set()

    async def slow_sampler(session: Any, work: ToSample) -> ScoredGroup:
        # Sampling does not end before the held-out prompt is produced (a sampler that would
        # wait for it forever under the old order fails here after 10 s).
        assert await asyncio.to_thread(delivered.wait, 10), "held-out prompt waited on sampling"
        return group_of(work)

    kafka.on_produce = on_produce
    batch = [
        message("t0", train[0]),
        message("h0", held, output_tokens=37),
        message("t1", train[1]),
    ]
    assert run_batch(service, batch, slow_sampler, monkeypatch)

    first, second = kafka.produced
    [held_out] = first
    assert isinstance(held_out, HeldoutPrompt) and held_out.served_output_tokens == 37
    assert sorted(r.traffic_request_id for r in second if isinstance(r, ScoredGroup)) == [
        "t0",
        "t1",
    ]
    assert kafka.commits == 1
    client = redis.Redis.from_url(redis_url)
    # Held-out and sampled prompts alike are marked seen once delivered.
    for messages in (held, *train):
        assert seen_at(redis_url, prompt_hash(messages))
    # Their done marks served until the commit: no judge reads the batch again after it.
    assert not client.keys("ratchet:judge:done:*")


def seen_at(redis_url: str, digest: str, version: int | None = None) -> bool:
    """Whether the judge finds the prompt seen (at all, or sampled from ``version``)."""

    async def read() -> bool:
        marks = JudgeMarks(aioredis.Redis.from_url(redis_url), 0)
        try:
            return await marks.seen(SeenMark(ALIAS, digest, 600), version)
        finally:
            await marks.redis.aclose()

    return asyncio.run(read())


def publish_progress(redis_url: str, **fields: Any) -> None:
    publish(redis.Redis.from_url(redis_url), LearnerProgress(alias=ALIAS, **fields))


async def never_called(session: Any, work: ToSample) -> ScoredGroup:
    raise AssertionError("sampled despite backpressure")


@pytest.mark.parametrize(
    ("progress", "judge", "reason"),
    [
        # 2 rounds x 4 groups pending: the bound (max_pending_rounds 2 x batch_groups 4) is met.
        ({"waiting": 8, "batch_groups": 4}, {}, "backpressure"),
        ({"phase": "train"}, {"pause_while_training": True}, "learner_training"),
    ],
)
def test_backpressure_skips_counts_and_does_not_mark_seen(
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    progress: dict[str, Any],
    judge: dict[str, Any],
    reason: str,
) -> None:
    service = service_for(redis_url, **judge)
    kafka = FakeKafka(service, monkeypatch)
    publish_progress(redis_url, **progress)
    [train] = prompts(service, False, 1)
    assert run_batch(service, [message("t0", train)], never_called, monkeypatch)

    assert skipped(service, reason) == 1.0
    assert kafka.produced == [[]] or kafka.produced == []
    assert kafka.commits == 1  # the record is passed over: its offset is committed
    client = redis.Redis.from_url(redis_url)
    assert not seen_at(redis_url, prompt_hash(train))
    assert not client.exists("ratchet:judge:done:t0")


def test_the_produced_counter_moves_by_the_acknowledged_groups(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = service_for(redis_url)
    FakeKafka(service, monkeypatch)
    client = redis.Redis.from_url(redis_url)
    client.set(produced_key(ALIAS), 5)  # other judges' groups
    train = prompts(service, False, 3)

    async def sampler(session: Any, work: ToSample) -> ScoredGroup:
        if work.record.request_id == "t2":
            raise SamplingError("vllm_unavailable", "down")
        return group_of(work)

    batch = [message(f"t{i}", p) for i, p in enumerate(train)]
    assert run_batch(service, batch, sampler, monkeypatch)
    assert int(client.get(produced_key(ALIAS)) or 0) == 5 + 2  # the failed group is not counted
    assert service.backpressure.cleared[ALIAS] == 0


def test_groups_never_acknowledged_are_not_counted(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = service_for(redis_url)
    kafka = FakeKafka(service, monkeypatch)
    monkeypatch.setattr(service, "_produce", lambda outputs: False)  # stopped, broker away
    [train] = prompts(service, False, 1)

    async def sampler(session: Any, work: ToSample) -> ScoredGroup:
        return group_of(work)

    assert not run_batch(service, [message("t0", train)], sampler, monkeypatch)
    assert not redis.Redis.from_url(redis_url).exists(produced_key(ALIAS))
    assert kafka.commits == 0


# ---- the decision's inputs, cached ---------------------------------------------------------------
def test_backpressure_caches_a_yes_for_a_second_rereads_a_no_and_counts_its_own_groups(
    redis_url: str,
) -> None:
    now = [100.0]
    client = redis.Redis.from_url(redis_url)
    publish(client, LearnerProgress(alias=ALIAS, waiting=1))

    async def go() -> list[tuple[bool, int]]:
        import redis.asyncio as aioredis

        async_client = aioredis.Redis.from_url(redis_url)
        gate = Backpressure(
            async_client, max_pending=3, pause_while_training=False, clock=lambda: now[0]
        )
        seen = []
        for _ in range(3):  # 1 waiting + 2 cleared here = 3: the third is refused
            decision = await gate.clear(ALIAS, "k", 1.0)
            seen.append((decision.sample, decision.pending))
        client.delete(progress_key(ALIAS))  # the learner's hash expired: a "no" is read
        seen.append(
            ((await gate.clear(ALIAS, "k", 1.0)).sample, -1)
        )  # afresh, so it samples at once
        publish(client, LearnerProgress(alias=ALIAS, waiting=100))  # a "yes" is cached...
        seen.append(((await gate.clear(ALIAS, "k", 1.0)).sample, -1))
        now[0] += 1.5
        seen.append(((await gate.clear(ALIAS, "k", 1.0)).sample, -1))  # ...for a second
        await async_client.aclose()
        return seen

    assert asyncio.run(go()) == [
        (True, 1),
        (True, 2),
        (False, 3),
        (True, -1),
        (True, -1),
        (False, -1),
    ]


def test_without_redis_the_judge_samples() -> None:
    import redis.asyncio as aioredis

    from embedded.processes import free_port

    async def go() -> bool:
        client = aioredis.Redis.from_url(
            f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1
        )
        gate = Backpressure(client, max_pending=1, pause_while_training=True)
        sample = (await gate.clear(ALIAS, "k", 1.0)).sample
        await client.aclose()
        return sample

    assert asyncio.run(go())


# ---- fair across clients ------------------------------------------------------------------------
def sampled_ids(kafka: FakeKafka) -> list[str]:
    return [
        r.traffic_request_id for out in kafka.produced for r in out if isinstance(r, ScoredGroup)
    ]


def test_a_flooding_client_neither_fills_the_bound_nor_crowds_out_the_others(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is 8 groups (2 rounds of 4). One client's 8 filled it, and every other
    client's record after that was skipped while the learner waited for them: a round takes at
    most half its groups from one of two clients, so it could never start (audit M-1)."""
    service = service_for(redis_url)  # learning.max_key_share 0.25: an even split of 2 or 3
    kafka = FakeKafka(service, monkeypatch)
    publish_progress(redis_url, waiting=0, read=0, batch_groups=4)
    train = prompts(service, False, 15)

    async def sampler(session: Any, work: ToSample) -> ScoredGroup:
        return group_of(work)

    monkeypatch.setattr(service, "_sample_and_score", sampler)
    flood = [message(f"f{i}", p, client="flood") for i, p in enumerate(train[:8])]
    later = [message(f"f{8 + i}", p, client="flood") for i, p in enumerate(train[8:13])]
    others = [message("a0", train[13], client="a"), message("b0", train[14], client="b")]

    async def go() -> None:
        try:
            assert await service.judge_batch(None, flood)  # type: ignore[arg-type]
            assert await service.judge_batch(None, later + others)  # type: ignore[arg-type]
        finally:
            await service.redis.aclose()

    asyncio.run(go())
    assert sampled_ids(kafka) == [f"f{i}" for i in range(8)] + ["a0", "b0"]
    assert skipped(service, "client_share") == 5.0
    assert skipped(service, "backpressure") == 0.0


def test_a_batch_asks_least_served_client_first(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for 2 groups; the flooding client's 6 records came first. Each client's first
    record is cleared before any client's second, in arrival order among equals."""
    service = service_for(redis_url)
    kafka = FakeKafka(service, monkeypatch)
    publish_progress(redis_url, waiting=6, read=0, batch_groups=4)  # 6 of the 8 pending
    train = prompts(service, False, 7)

    async def sampler(session: Any, work: ToSample) -> ScoredGroup:
        return group_of(work)

    batch = [message(f"f{i}", p, client="flood") for i, p in enumerate(train[:6])]
    batch.append(message("a0", train[6], client="a"))
    assert run_batch(service, batch, sampler, monkeypatch)
    assert sampled_ids(kafka) == ["f0", "a0"]


def test_a_training_prompt_is_sampled_once_a_version_and_rested_after_two_flat_groups(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the dedup window a prompt gets one group per version (the live one, here), and
    one whose last two groups scored all alike is not sampled again."""
    flat, varied = prompts(service_for(redis_url), False, 2)
    rewards = {"flat": [1.0, 1.0], "varied": [0.0, 1.0]}
    skips: list[dict[str, float]] = []

    def judge(version: int) -> list[str]:
        """One batch of both prompts while ``version`` is live: those sampled."""
        service = service_for(redis_url)
        config = service.settings.aliases[ALIAS]
        RegistryWriter(redis_url, service.settings.aliases).write(
            AliasRoute(alias=ALIAS, base_model=config.base_model, active=version)
        )
        kafka = FakeKafka(service, monkeypatch)

        async def sampler(session: Any, work: ToSample) -> ScoredGroup:
            kind = work.record.request_id.split("-")[0]
            return group_of(work).model_copy(update={"version": version, "rewards": rewards[kind]})

        n = len(skips)  # each batch's records are new traffic: ids of their own
        batch = [message(f"flat-{n}", flat), message(f"varied-{n}", varied)]
        assert run_batch(service, batch, sampler, monkeypatch)
        skips.append({r: skipped(service, r) for r in ("recent_duplicate", "no_signal")})
        return sorted(
            r.traffic_request_id.split("-")[0]
            for out in kafka.produced
            for r in out
            if isinstance(r, ScoredGroup)
        )

    client = redis.Redis.from_url(redis_url)
    assert judge(1) == ["flat", "varied"]
    assert judge(1) == [] and skips[-1] == {"recent_duplicate": 2.0, "no_signal": 0.0}
    assert judge(2) == ["flat", "varied"]  # a new version: both again
    assert seen_at(redis_url, prompt_hash(flat), 2) and seen_at(redis_url, prompt_hash(flat), 1)
    assert not seen_at(redis_url, prompt_hash(flat), 3)
    assert client.get(flat_key(ALIAS, prompt_hash(flat))) == b"2"
    assert not client.exists(flat_key(ALIAS, prompt_hash(varied)))
    assert judge(3) == ["varied"] and skips[-1] == {"recent_duplicate": 0.0, "no_signal": 1.0}
    ttl = client.ttl(flat_key(ALIAS, prompt_hash(flat)))
    assert 0 < ttl <= 600  # rested for the dedup window, then tried again


def test_repeat_reason() -> None:
    assert repeat_reason(False, None, 2) is None
    assert repeat_reason(True, None, 2) == "recent_duplicate"
    assert repeat_reason(False, b"1", 2) is None
    assert repeat_reason(False, b"2", 2) == "no_signal"
    assert repeat_reason(False, b"5", 0) is None  # 0: never rested

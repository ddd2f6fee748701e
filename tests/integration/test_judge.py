"""The judge against the real stack: traffic through the proxy becomes scored groups and held-out
prompts, sampled by vLLM and judged by the local SmolLM2 through litellm with structured output."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from cli.status import agreement_line
from embedded.processes import Stack, wait_until
from embedded.stack import judge_part, learner_part
from judge.service import is_heldout
from ratchet.records import (
    DEADLETTER_TOPIC,
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    TRAFFIC_TOPIC,
    DeadLetter,
    HeldoutPrompt,
    ScoredGroup,
    TrafficRecord,
    prompt_hash,
)
from ratchet.registry import AliasRoute
from ratchet.rewards.agreement import agreement_key, decode_pair
from ratchet.secrets import vllm_api_key
from ratchet.settings import load_settings
from tests.integration.conftest import BASE_MODEL, Embedded, free_port
from tests.records import build_traffic_record

pytestmark = pytest.mark.integration

QUESTIONS = [
    f"In one short sentence: what is {thing}?"
    for thing in (
        "a river",
        "a violin",
        "rain",
        "a bridge",
        "bread",
        "a comet",
        "a tulip",
        "granite",
        "a harbour",
        "a kite",
        "a glacier",
        "a lantern",
    )
]


# For the tests whose claim is the judge's plumbing (a crash, the order of its outputs,
# backpressure), not RULER: a verifier that scores a group in microseconds, where RULER on the
# stack's own vLLM takes seconds a group (minutes a module on a slow host). RULER stays the
# reward of the tests of what it produces: groups, recovery, agreement and the Agents SDK.
HASH_REWARD = {"kind": "verifier", "verifier": "tests.integration.replica_reward:text_hash_reward"}


def judge_config(
    env: Embedded, home: Path, alias: str, reward: dict[str, Any] | None = None, **judge: Any
) -> Path:
    """A config with the session stack's addresses, one alias (RULER-judged unless `reward`
    says) and its own consumer group."""
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["judge"] = {
        "consumer_group": f"judge-{alias}",
        "metrics_port": free_port(),
        "concurrency": 4,
        "judge_retries": 1,
        # The judge model is the stack's own vLLM, sampling beside it on two shared cores: on a
        # host a few times slower than this one (CI's, with the other worker training) a
        # structured reply took over the default 60 s, and a timed-out call drops its group
        # after the sampling and the judge's work are spent. A test here waits instead.
        "judge_timeout_s": 240,
        **judge,
    }
    config["aliases"] = {
        alias: {
            "base_model": BASE_MODEL,
            "learning": {"group_size": 3, "heldout_fraction": 0.3, "dedup_window_s": 0},
            "sampling": {"max_tokens": 16, "temperature": 1.0},
            **({"reward": reward} if reward else {}),
        }
    }
    path = home / "judge.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def send_traffic(env: Embedded, alias: str, questions: list[str]) -> dict[str, str]:
    """Send each question through the proxy; return request id -> prompt hash."""
    env.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    env.wait_for_proxy_route(alias)

    async def run() -> dict[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{env.proxy_url}/v1", api_key="k", max_retries=0)

        async def one(question: str) -> tuple[str, str]:
            messages = [{"role": "user", "content": question}]
            raw = await client.chat.completions.with_raw_response.create(
                model=alias, messages=messages, max_tokens=8
            )
            return raw.headers["x-request-id"], prompt_hash(messages, None)

        pairs = await asyncio.gather(*(one(q) for q in questions))
        await client.close()
        return dict(pairs)

    return asyncio.run(run())


@contextlib.contextmanager
def running_judge(config: Path, state: Path) -> Iterator[Stack]:
    stack = Stack([judge_part(load_settings(config), config)], state)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def outputs_for(
    env: Embedded, request_ids: set[str], timeout_s: float
) -> tuple[list[ScoredGroup], list[HeldoutPrompt]]:
    """The groups and held-out prompts of ``request_ids`` found within ``timeout_s`` (at least
    one look, however short)."""
    groups: dict[str, ScoredGroup] = {}
    heldout: dict[str, HeldoutPrompt] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for record in env.find_records(
            GROUPS_TOPIC,
            lambda r: isinstance(r, ScoredGroup) and r.traffic_request_id in request_ids,
            count=len(request_ids),
            timeout_s=2,
        ):
            groups[record.traffic_request_id] = record  # type: ignore[union-attr]
        for record in env.find_records(
            HELDOUT_TOPIC,
            lambda r: isinstance(r, HeldoutPrompt) and r.traffic_request_id in request_ids,
            count=len(request_ids),
            timeout_s=2,
        ):
            heldout[record.traffic_request_id] = record  # type: ignore[union-attr]
        if len(groups) + len(heldout) >= len(request_ids) or time.monotonic() >= deadline:
            return list(groups.values()), list(heldout.values())


def by_label(scraped: str, name: str, alias: str, label: str) -> dict[str, float]:
    """The counter ``name`` of ``alias`` in a /metrics page, by the value of ``label``."""
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name == name and sample.labels.get("alias") == alias
    }


def drops_of(port: int, alias: str) -> dict[str, float]:
    """The groups of ``alias`` the judge dropped because sampling or scoring failed, by cause
    (a record this code failed on is a dead letter, not a drop)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    causes = by_label(text, "ratchet_judge_failures_total", alias, "cause")
    return {cause: count for cause, count in causes.items() if cause != "handler_error"}


def settled(
    env: Embedded, request_ids: set[str], port: int, alias: str, timeout_s: float
) -> tuple[list[ScoredGroup], list[HeldoutPrompt]]:
    """Wait, while the judge on ``port`` runs, until each of ``request_ids`` is a group or a
    held-out prompt, or a group the judge counted as dropped because sampling or scoring failed
    (SmolLM2 as the judge sometimes fails its structured reply on every attempt); return the
    outputs. A record that became neither was skipped: the wait fails, or the count below does.
    """
    found: dict[str, ScoredGroup | HeldoutPrompt] = {}

    def accounted_for() -> bool:
        groups, heldout = outputs_for(env, request_ids, timeout_s=0)
        found.update((r.traffic_request_id, r) for r in [*groups, *heldout])
        return len(found) + sum(drops_of(port, alias).values()) >= len(request_ids)

    wait_until(accounted_for, timeout_s, "every record an output or a counted drop")
    drops = drops_of(port, alias)
    missing = request_ids - found.keys()
    assert len(missing) == sum(drops.values()), f"skipped: {missing}, dropped: {drops}"
    assert len(found) >= len(request_ids) / 2, f"most records become outputs: {drops}"
    return (
        [r for r in found.values() if isinstance(r, ScoredGroup)],
        [r for r in found.values() if isinstance(r, HeldoutPrompt)],
    )


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_traffic_becomes_scored_groups_and_heldout_prompts(
    embedded: Embedded, tmp_path: Path
) -> None:
    alias = "jt-groups"
    questions = QUESTIONS[:6]
    assert any(
        is_heldout(embedded.secret, prompt_hash([{"role": "user", "content": q}], None), 0.3)
        for q in questions
    ), "pick questions so that some are held out"
    config = judge_config(embedded, tmp_path, alias)
    poison = produce_poison(embedded, alias)  # in the same batches as the real traffic
    sent = send_traffic(embedded, alias, questions)
    port = yaml.safe_load(config.read_text())["judge"]["metrics_port"]
    with running_judge(config, tmp_path / "state"):
        groups, heldout = settled(embedded, set(sent), port, alias, timeout_s=600)
        letters = embedded.find_records(
            DEADLETTER_TOPIC,
            lambda r: isinstance(r, DeadLetter) and r.consumer == f"judge-{alias}",
            count=len(poison),
        )
    # The poison was counted and kept, not retried: every real record was handled too.
    assert sorted((r.reason, r.value) for r in letters) == sorted(poison)  # type: ignore[union-attr]

    held_hashes = {h.prompt_hash for h in heldout}
    expected_held = {digest for digest in sent.values() if is_heldout(embedded.secret, digest, 0.3)}
    assert held_hashes == expected_held
    for group in groups:
        # Held-out prompts never appear in a group.
        assert prompt_hash(group.prompt_messages, group.tools) not in held_hashes
        assert group.version == 0 and group.response_model == BASE_MODEL
        # The replica that sampled it (the stack's one vLLM), for the drift per replica.
        assert group.replica == embedded.settings.vllm_url.rstrip("/")
        assert len(group.samples) == 3 and len(group.rewards) == 3
        assert all(0.0 <= r <= 1.0 for r in group.rewards)
        assert group.judge_model == f"hosted_vllm/{BASE_MODEL}" and group.rubric_hash
        for sample in group.samples:
            assert len(sample.token_ids) == len(sample.logprobs) > 0
    assert_logprobs_match_vllm(embedded, groups[0])


def produce_poison(env: Embedded, alias: str) -> list[tuple[str, str]]:
    """A value that is not JSON, and a traffic record that validates but whose messages are a
    string; (reason, value) of the dead letter each must become."""
    broken = build_traffic_record(
        request_id=f"{alias}-poison", alias=alias, request={"messages": "a string, not a list"}
    ).to_json()
    values = [(b"{not json", "malformed"), (broken, "handler_error")]
    producer = KafkaProducer(bootstrap_servers=env.settings.kafka_bootstrap_servers, acks="all")
    for value, _ in values:
        producer.send(TRAFFIC_TOPIC, key=b"poison", value=value)
    producer.flush(30)
    producer.close()
    return [(reason, value.decode()) for value, reason in values]


def assert_logprobs_match_vllm(env: Embedded, group: ScoredGroup) -> None:
    """Score the group's exact tokens again with vLLM: ids and logprobs must agree."""
    sample = group.samples[0]
    response = httpx.post(
        f"{env.settings.vllm_url}/v1/completions",
        headers=env.vllm_headers,
        timeout=60,
        json={
            "model": BASE_MODEL,
            "prompt": group.prompt_token_ids + sample.token_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0,
        },
    )
    response.raise_for_status()
    prompt_logprobs = response.json()["choices"][0]["prompt_logprobs"]
    tail = prompt_logprobs[len(group.prompt_token_ids) :]
    assert len(tail) == len(sample.token_ids)
    for token_id, logged, scored in zip(sample.token_ids, sample.logprobs, tail, strict=True):
        assert scored[str(token_id)]["logprob"] == pytest.approx(logged, abs=0.05)


class Switch:
    """A TCP forwarder to vLLM that can be cut, to take the judge model away from the judge
    alone (stopping vLLM would also stop sampling)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.open = True
        self._server: socket.socket | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def run_in_thread(self) -> None:
        import threading

        loop = asyncio.new_event_loop()

        async def serve() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            async with server:
                await server.serve_forever()

        threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True).start()


def test_judge_model_unreachable_drops_and_counts_then_recovers(
    embedded: Embedded, tmp_path: Path
) -> None:
    alias = "jt-flaky"
    vllm_port = int(embedded.settings.vllm_url.rsplit(":", 1)[1])
    switch = Switch(vllm_port)
    switch.run_in_thread()
    switch.open = False
    config = judge_config(
        embedded,
        tmp_path,
        alias,
        judge_api_base=f"http://127.0.0.1:{switch.port}/v1",
        # A judge endpoint other than Ratchet's vLLM gets no key by default; this one is vLLM.
        judge_api_key=vllm_api_key(embedded.settings),
    )
    port = yaml.safe_load(config.read_text())["judge"]["metrics_port"]
    train = [
        q
        for q in QUESTIONS
        if not is_heldout(embedded.secret, prompt_hash([{"role": "user", "content": q}], None), 0.3)
    ]
    with running_judge(config, tmp_path / "state"):
        down = send_traffic(embedded, alias, train[:2])
        wait_until(
            lambda: (
                metric(port, 'ratchet_judge_failures_total{alias="jt-flaky",cause="judge_unavail')
                >= 2
            ),
            180,
            "judge failures counted",
        )
        groups, _ = outputs_for(embedded, set(down), timeout_s=3)
        assert not groups, "no group is produced without a judge"

        switch.open = True  # the judge model is back: the same judge process goes on
        up = send_traffic(embedded, alias, train[2:4])
        groups, _ = outputs_for(embedded, set(up), timeout_s=600)
        assert {g.traffic_request_id for g in groups} == set(up)


def test_judge_killed_mid_batch_skips_no_traffic(embedded: Embedded, tmp_path: Path) -> None:
    alias = "jt-crash"
    config = judge_config(embedded, tmp_path, alias, reward=HASH_REWARD)
    port = yaml.safe_load(config.read_text())["judge"]["metrics_port"]
    sent = send_traffic(embedded, alias, QUESTIONS[:4])
    with running_judge(config, tmp_path / "state") as stack:
        wait_until(
            lambda: metric(port, "ratchet_judge_in_flight_groups") >= 1, 120, "a batch in flight"
        )
        process = stack.part("judge").process
        assert process is not None
        process.send_signal(signal.SIGKILL)  # no chance to commit or clean up
        process.wait(10)
        stack.start_part("judge")
        # The killed judge committed nothing, so the new one reads every record again: each
        # becomes an output (a held-out prompt the killed one delivered is one already) or a
        # drop the new one counts.
        settled(embedded, set(sent), port, alias, timeout_s=600)


def split(env: Embedded, questions: list[str]) -> tuple[list[str], list[str]]:
    """(held-out, training) questions under the stack's secret and the tests' fraction 0.3."""
    held = [
        q
        for q in questions
        if is_heldout(env.secret, prompt_hash([{"role": "user", "content": q}], None), 0.3)
    ]
    return held, [q for q in questions if q not in held]


def test_heldout_prompts_arrive_while_the_batch_is_still_sampling(
    embedded: Embedded, tmp_path: Path
) -> None:
    """The batch's held-out prompts are produced before its groups are sampled: one group at a
    time, with answers of up to 64 tokens, the batch's groups take tens of seconds here (with
    RULER, minutes); the held-out prompts must not wait for them."""
    alias = "jt-early"
    held, train = split(embedded, QUESTIONS)
    assert held and len(train) >= 4, "pick questions so that both sides are populated"
    # One batch holds every record of the topic so far, so none of ours waits for another batch.
    config = judge_config(
        embedded, tmp_path, alias, reward=HASH_REWARD, concurrency=1, poll_records=1000
    )
    settings = yaml.safe_load(config.read_text())
    settings["aliases"][alias]["sampling"]["max_tokens"] = 64
    config.write_text(yaml.safe_dump(settings))
    port = settings["judge"]["metrics_port"]
    sent = send_traffic(embedded, alias, held + train)  # before the judge: one batch
    held_ids = {rid for rid, digest in sent.items() if is_heldout(embedded.secret, digest, 0.3)}
    with running_judge(config, tmp_path / "state"):
        found = embedded.find_records(
            HELDOUT_TOPIC,
            lambda r: isinstance(r, HeldoutPrompt) and r.traffic_request_id in held_ids,
            count=len(held_ids),
            timeout_s=180,
        )
        groups_then = metric(port, "ratchet_judge_groups_total")
        prompts = [r for r in found if isinstance(r, HeldoutPrompt)]
        assert {r.traffic_request_id for r in prompts} == held_ids
        assert groups_then < len(train), "held-out prompts waited for the batch's sampling"
        assert all(r.served_output_tokens for r in prompts)
    # The claim is settled here; the rest of the batch's groups (minutes of sampling) are the
    # judge's ordinary output, covered by the other tests here and, for this ordering, by
    # tests/unit/judge/test_judge_batch.py.


def test_the_judge_stops_sampling_while_the_learner_has_enough_groups(
    embedded: Embedded, tmp_path: Path
) -> None:
    """A learner whose progress says a round's worth of groups is waiting stops the judge's
    sampling (counted as backpressure, prompts not marked seen); cleared, the same prompts are
    sampled when they come again, and the shared produced counter counts them."""
    import redis

    from ratchet.progress import LearnerProgress, produced_key, progress_key, publish

    alias = "jt-pressure"
    _, train = split(embedded, QUESTIONS)
    config = judge_config(embedded, tmp_path, alias, reward=HASH_REWARD, max_pending_rounds=1)
    settings = yaml.safe_load(config.read_text())
    settings["aliases"][alias]["learning"]["dedup_window_s"] = 600
    config.write_text(yaml.safe_dump(settings))
    port = settings["judge"]["metrics_port"]
    client = redis.Redis.from_url(embedded.settings.redis_url)
    publish(client, LearnerProgress(alias=alias, waiting=10_000, batch_groups=32))
    skipped = f'ratchet_judge_skipped_total{{alias="{alias}",reason="backpressure"}}'
    with running_judge(config, tmp_path / "state"):
        refused = send_traffic(embedded, alias, train[:3])
        wait_until(lambda: metric(port, skipped) >= 3, 180, "three records skipped")
        assert metric(port, "ratchet_judge_groups_total") == 0
        assert not client.exists(produced_key(alias))

        client.delete(progress_key(alias))  # the learner caught up (or went away)
        again = send_traffic(embedded, alias, train[:2])  # the same prompts, not marked seen
        groups, _ = outputs_for(embedded, set(again), timeout_s=600)
        assert {g.traffic_request_id for g in groups} == set(again)
        wait_until(lambda: int(client.get(produced_key(alias)) or 0) == 2, 30, "2 groups counted")
    assert not set(refused) & {g.traffic_request_id for g in groups}


def test_the_judge_scores_what_users_rated_to_measure_its_agreement_with_them(
    embedded: Embedded, tmp_path: Path
) -> None:
    """Users rate answers through the proxy; the learner joins each rating with its answer; the
    judge scores each rated answer among fresh re-samples with the real RULER judge, and exports
    how far it agrees with the users, with learning still off (measured before it trains)."""
    alias = "jt-agree"
    path = judge_config(embedded, tmp_path, alias)
    config = yaml.safe_load(path.read_text())
    config["aliases"][alias]["learning"]["enabled"] = False
    config["learner"] = {
        "consumer_group": f"learner-{alias}",
        "metrics_port": free_port(),
        "base_model_path": str(embedded.model_path),
    }
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(alias)
    judge_metrics = f"http://127.0.0.1:{settings.judge.metrics_port}/metrics"
    services = Stack(
        [judge_part(settings, path), learner_part(settings, path)], tmp_path / "services"
    )
    services.start()
    try:
        asyncio.run(ask_and_rate(embedded, alias, RATED_QUESTIONS))
        wait_until(
            lambda: (
                sum(probes_of(httpx.get(judge_metrics).text, alias).values())
                >= len(RATED_QUESTIONS)
            ),
            600,
            f"the judge to take every rated answer of {alias}",
        )
        scraped = httpx.get(judge_metrics).text
    finally:
        services.stop()

    outcomes = probes_of(scraped, alias)
    # SmolLM2 as a judge sometimes fails its structured reply twice; most are scored.
    assert outcomes.get("scored", 0) >= len(RATED_QUESTIONS) // 2, outcomes
    client = redis.Redis.from_url(settings.redis_url)
    pairs = [decode_pair(raw) for raw in client.lrange(agreement_key(alias), 0, -1)]
    assert len(pairs) == outcomes["scored"]
    assert all(0.0 <= judged <= 1.0 and rating in (0.0, 1.0) for judged, rating in pairs)
    assert f'ratchet_judge_user_agreement_pairs{{alias="{alias}"}} {len(pairs)}.0' in scraped
    line = agreement_line(client, alias, settings.aliases[alias])
    # Which line is determined by the ratings sent: answers rated both ways can be compared
    # (pairwise accuracy over them); all rated alike cannot.
    if len({rating for _, rating in pairs}) == 2:
        assert f"over {len(pairs)} rated answers" in line, line
    else:
        assert f"{len(pairs)} rated answers scored, not yet comparable" in line, line
    print(line, outcomes)


# Each rated answer costs the judge a RULER call over it and its re-samples: six show the
# probe's plumbing and both lines of the status report as well as twelve did.
RATED_QUESTIONS = QUESTIONS[:6]


async def ask_and_rate(env: Embedded, alias: str, questions: list[str]) -> None:
    """Each question through the proxy, all at once (as users do), and its answer rated by the
    users' criterion, unknown to the judge: 1 when it names the thing asked about."""
    async with httpx.AsyncClient(base_url=env.proxy_url, timeout=60) as client:

        async def ask_and_rate_one(question: str) -> None:
            reply = await client.post(
                "/v1/chat/completions",
                json={
                    "model": alias,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": 16,
                },
            )
            reply.raise_for_status()
            thing = question.rsplit(" ", 1)[-1].rstrip("?").lower()
            answer = reply.json()["choices"][0]["message"]["content"] or ""
            rated = await client.post(
                "/v1/feedback",
                json={"completion_id": reply.json()["id"], "score": float(thing in answer.lower())},
                timeout=10,
            )
            assert rated.status_code == 200, rated.text

        await asyncio.gather(*(ask_and_rate_one(q) for q in questions))


def probes_of(scraped: str, alias: str) -> dict[str, float]:
    return by_label(scraped, "ratchet_judge_agreement_probes_total", alias, "outcome")


def test_an_agents_sdk_conversation_with_a_tool_becomes_scored_groups(
    embedded: Embedded, tmp_path: Path
) -> None:
    """The OpenAI Agents SDK (Responses API, a function tool, two runs of one conversation)
    through the proxy: every model call it makes is logged as its chat exchange, tool calls and
    tool results included, and the judge samples and scores a group for each."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    alias = "jt-agent"
    config = judge_config(embedded, tmp_path, alias)
    settings = yaml.safe_load(config.read_text())
    settings["aliases"][alias]["learning"]["heldout_fraction"] = 0.0  # every prompt a group
    config.write_text(yaml.safe_dump(settings))
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(alias)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    async def conversation() -> list[Any]:
        set_tracing_disabled(True)
        client = openai.AsyncOpenAI(base_url=f"{embedded.proxy_url}/v1", api_key="k", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the get_weather tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=alias, openai_client=client),
            # The first call of each run must call the tool; the SDK then sets it back to auto.
            model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
        )
        first = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
        turn = [*first.to_input_list(), {"role": "user", "content": "And in Bergen?"}]
        second = await Runner.run(agent, turn, max_turns=4)
        await client.close()
        return [*first.raw_responses, *second.raw_responses]

    responses = asyncio.run(conversation())
    assert len(asked) == 2, asked  # each run called the tool once, then answered
    assert len(responses) >= 4
    completion_ids = {"chatcmpl-" + r.response_id.removeprefix("resp_") for r in responses}
    records = embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.response_id in completion_ids,
        count=len(completion_ids),
    )
    assert len(records) == len(completion_ids)
    for record in records:
        assert isinstance(record, TrafficRecord) and record.client_api == "responses"
        assert record.request["tools"][0]["function"]["name"] == "get_weather"
    # A call after the tool ran sends its call and result, as chat turns.
    after_tool = [r for r in records if r.request["messages"][-1]["role"] == "tool"]  # type: ignore[union-attr]
    assert len(after_tool) >= 2
    messages = after_tool[0].request["messages"]  # type: ignore[union-attr]
    assert messages[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[-1]["content"].startswith("It is sunny in")

    request_ids = {r.request_id for r in records}  # type: ignore[union-attr]
    port = yaml.safe_load(config.read_text())["judge"]["metrics_port"]
    with running_judge(config, tmp_path / "state"):
        groups, heldout = settled(embedded, request_ids, port, alias, timeout_s=600)
    assert not heldout and groups
    for group in groups:
        assert group.tools is not None and group.tools[0]["function"]["name"] == "get_weather"
        assert len(group.samples) == 3 and all(0.0 <= r <= 1.0 for r in group.rewards)

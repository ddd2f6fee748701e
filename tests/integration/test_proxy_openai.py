"""The official openai client, sync and async, through the proxy to the real vLLM, and the
TrafficRecord read back from the real broker matches what the client received; the Agents SDK's
chat and Responses models running an agent with a function tool."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from embedded.processes import wait_until
from proxy.log.producer import RecordProducer
from proxy.log.spool import OutgoingRecord
from ratchet.records import DEADLETTER_TOPIC, TRAFFIC_TOPIC, DeadLetter, TrafficRecord
from ratchet.secrets import hash_api_key, server_secret
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded
from tests.integration.side_proxy import side_proxy
from tests.records import build_traffic_record

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "Name one colour."}]


def traffic_record(env: Embedded, request_id: str) -> TrafficRecord:
    records = env.find_records(
        TRAFFIC_TOPIC, lambda r: isinstance(r, TrafficRecord) and r.request_id == request_id
    )
    assert records, f"no traffic record for {request_id}"
    record = records[0]
    assert isinstance(record, TrafficRecord)
    return record


@pytest.fixture
def client(base_route: Embedded) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_route.proxy_url}/v1", api_key="sk-test-key", max_retries=0
    )


def test_plain_chat_is_served_and_logged(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0.7,
        seed=3,
        extra_body={"top_k": 20},  # unknown to OpenAI, passed through to vLLM untouched
    )
    completion = raw.parse()
    assert raw.headers["x-ratchet-version"] == "0"
    assert completion.model == BASE_MODEL
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert record.response_id == completion.id
    assert record.response_model == BASE_MODEL and record.request_model == ALIAS
    assert record.version == 0 and record.canary_arm == "active" and record.status == 200
    assert record.choices[0]["message"]["content"] == completion.choices[0].message.content
    assert record.finish_reasons == [completion.choices[0].finish_reason]
    assert record.input_tokens == completion.usage.prompt_tokens
    assert record.output_tokens == completion.usage.completion_tokens
    assert record.request["top_k"] == 20 and record.request["seed"] == 3
    assert record.api_key_hash and "sk-test-key" not in record.model_dump_json()
    assert record.latency_ms > 0


def test_secrets_and_redacted_text_never_reach_kafka(
    base_route: Embedded, client: openai.OpenAI
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        max_tokens=20,
        messages=[{"role": "user", "content": "Repeat: my email is jane@example.com"}],
    )
    record = traffic_record(base_route, raw.headers["x-request-id"])
    logged = record.to_json().decode()
    assert "jane@example.com" not in logged and "[REDACTED]" in logged
    assert "sk-test-key" not in logged
    assert record.api_key_hash == hash_api_key(server_secret(base_route.settings), "sk-test-key")


def test_stream_with_usage_is_assembled(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0 and not chunks[-1].choices
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert record.stream and record.choices[0]["message"]["content"] == text
    assert record.output_tokens == usage.completion_tokens
    assert record.ttft_ms is not None and 0 < record.ttft_ms <= record.latency_ms


def test_stream_without_usage_hides_usage_chunk_but_logs_tokens(
    base_route: Embedded, client: openai.OpenAI
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=MESSAGES, max_tokens=8, stream=True
    )
    chunks = list(raw.parse())
    assert all(c.choices for c in chunks), "client did not ask for the usage chunk"
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert record.output_tokens is not None and record.output_tokens > 0


def test_n2_returns_and_logs_both_choices(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=MESSAGES, max_tokens=10, n=2, temperature=1.0
    )
    completion = raw.parse()
    assert len(completion.choices) == 2
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert [c["message"]["content"] for c in record.choices] == [
        c.message.content for c in completion.choices
    ]


def test_streamed_n2_is_assembled_per_choice(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=MESSAGES, max_tokens=8, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in raw.parse():
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert [c["message"]["content"] or "" for c in record.choices] == texts


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_tools_request_round_trips(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        max_tokens=100,
        temperature=0,
        tools=TOOLS,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    completion = raw.parse()
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert record.request["tools"] == TOOLS
    logged = record.choices[0]["message"]["tool_calls"][0]
    assert logged["function"]["arguments"] == call.function.arguments


def test_streamed_tool_call_is_assembled(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        max_tokens=100,
        temperature=0,
        tools=TOOLS,
        stream=True,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    arguments = ""
    for chunk in raw.parse():
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                arguments += delta.function.arguments or ""
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert arguments
    assert record.choices[0]["message"]["tool_calls"][0]["function"]["arguments"] == arguments


def test_response_format_and_logprobs(base_route: Embedded, client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=ALIAS,
        max_tokens=30,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Give a JSON object with a key 'a'."}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "a",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        },
    )
    assert isinstance(json.loads(completion.choices[0].message.content)["a"], int)
    assert len(completion.choices[0].logprobs.content[0].top_logprobs) == 2


def test_completions_endpoint(base_route: Embedded, client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=ALIAS, prompt="The sky is", max_tokens=5
    )
    completion = raw.parse()
    record = traffic_record(base_route, raw.headers["x-request-id"])
    assert record.endpoint == "completions"
    assert record.choices[0]["text"] == completion.choices[0].text
    streamed = client.completions.create(model=ALIAS, prompt="One, two,", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices)


def test_models_lists_aliases_with_live_version(
    base_route: Embedded, client: openai.OpenAI
) -> None:
    models = {m.id: m for m in client.models.list()}
    assert ALIAS in models
    assert models[ALIAS].model_extra["ratchet"]["active_version"] == 0
    assert client.models.retrieve(ALIAS).id == ALIAS


def test_async_client_plain_and_stream(base_route: Embedded) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{base_route.proxy_url}/v1", api_key="k", max_retries=0
        )
        plain, streamed = await asyncio.gather(
            client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=6),
            client.chat.completions.create(
                model=ALIAS,
                messages=MESSAGES,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            ),
        )
        assert plain.choices[0].message.content
        chunks = [c async for c in streamed]
        assert chunks[-1].usage is not None
        await client.close()

    asyncio.run(run())


class Colour(BaseModel):
    colour: str  # free text: a schema that fixed the answer is refused on a learning alias


def test_chat_parse_gives_the_clients_model(base_route: Embedded, client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(
        model=ALIAS,
        messages=[{"role": "user", "content": "Name one colour of the sky."}],
        response_format=Colour,
        max_tokens=40,
        temperature=0,
    )
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Colour)
    assert json.loads(message.content or "") == message.parsed.model_dump()


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agents_sdk_agent_calls_its_function_tool(base_route: Embedded, api: str) -> None:
    """The Agents SDK's Responses model and its Chat Completions model, each through the proxy:
    the model calls the tool, the SDK runs it and sends its result back, the model answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    async def run() -> Any:
        set_tracing_disabled(True)
        client = openai.AsyncOpenAI(
            base_url=f"{base_route.proxy_url}/v1", api_key="k", max_retries=0
        )
        kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="weather",
            instructions="Answer with the get_weather tool.",
            tools=[get_weather],
            model=kind(model=ALIAS, openai_client=client),
            # The first call must call the tool; the SDK then sets tool_choice back to auto.
            model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
        )
        result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
        await client.close()
        return result

    result = asyncio.run(run())
    assert len(asked) == 1, asked
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) >= 2  # the call, then the answer after the tool's result


def test_feedback_is_written(base_route: Embedded, client: openai.OpenAI) -> None:
    from ratchet.records import FEEDBACK_TOPIC, FeedbackRecord

    completion = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=4)
    feedback = {"completion_id": completion.id, "thumbs": "down", "comment": "too short"}
    # Only the key that got the answer may rate it, also with auth off (any other: 404).
    stranger = httpx.post(f"{base_route.proxy_url}/v1/feedback", json=feedback)
    assert stranger.status_code == 404, stranger.text
    response = httpx.post(
        f"{base_route.proxy_url}/v1/feedback",
        json=feedback,
        headers={"authorization": f"Bearer {client.api_key}"},
    )
    assert response.status_code == 200, response.text
    records = base_route.find_records(
        FEEDBACK_TOPIC, lambda r: isinstance(r, FeedbackRecord) and r.completion_id == completion.id
    )
    assert records and records[0].score == 0.0 and records[0].thumbs == "down"


def test_adapter_admin_routes_are_not_reachable(base_route: Embedded) -> None:
    for path in (
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/adapters",
        "/v1/adapters",
        "/health",
        "/tokenize",
        "/v1/embeddings",
    ):
        response = httpx.post(
            f"{base_route.proxy_url}{path}", json={"lora_name": "evil", "lora_path": "/tmp"}
        )
        assert response.status_code in (404, 405), path
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    served = httpx.get(
        f"{base_route.settings.vllm_url}/v1/models", headers=base_route.vllm_headers
    ).json()["data"]
    assert "evil" not in {m["id"] for m in served}


def test_vllm_itself_requires_its_key(base_route: Embedded) -> None:
    """Anything that reaches vLLM's port directly, past the proxy, can neither generate nor load
    or unload adapters without the key; its health check stays open for probes."""
    vllm = base_route.settings.vllm_url
    adapter = {"lora_name": "evil", "lora_path": "/tmp"}
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": BASE_MODEL, "messages": MESSAGES}),
        ("POST", "/v1/load_lora_adapter", adapter),
        ("POST", "/v1/unload_lora_adapter", adapter),
        ("POST", "/adapters", adapter),
        ("POST", "/tokenize", {"model": BASE_MODEL, "prompt": "hi"}),
    ):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            response = httpx.request(method, f"{vllm}{path}", json=body, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text[:200])
    assert httpx.get(f"{vllm}/health").status_code == 200
    keyed = httpx.get(f"{vllm}/v1/models", headers=base_route.vllm_headers)
    assert keyed.status_code == 200 and BASE_MODEL in {m["id"] for m in keyed.json()["data"]}


def test_upstream_rejection_is_reshaped(base_route: Embedded) -> None:
    # Valid for the proxy, refused by vLLM (longer than the model's context): a 400 envelope.
    response = httpx.post(
        f"{base_route.proxy_url}/v1/chat/completions",
        json={"model": ALIAS, "messages": MESSAGES, "max_tokens": 100_000},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text


def test_metrics_move_with_each_request(base_route: Embedded) -> None:
    """Each sample moves with a request: counters by one (or by its tokens), the in-flight gauge
    while it streams, and the routing table's age between two scrapes."""
    env = base_route
    call = {"alias": ALIAS, "version": "0", "arm": "active"}
    counters = {
        "requests": ("ratchet_proxy_requests_total", {"alias": ALIAS}),
        "added": ("ratchet_proxy_added_seconds_count", {"alias": ALIAS}),
        "ttft": ("ratchet_proxy_time_to_first_token_seconds_count", call),
        "input": ("ratchet_proxy_tokens_total", {**call, "direction": "input"}),
        "output": ("ratchet_proxy_tokens_total", {**call, "direction": "output"}),
        "sent": ("ratchet_proxy_log_records_total", {"outcome": "sent"}),
    }

    def count(key: str) -> float:
        name, labels = counters[key]
        return env.sample(name, **labels)

    in_flight = "ratchet_proxy_in_flight_requests"
    before = {key: count(key) for key in counters}
    assert env.sample(in_flight) == 0
    body = {
        "model": ALIAS,
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Long enough that the proxy is still relaying when the client has read the first chunk.
        "min_tokens": 48,
        "max_tokens": 48,
    }
    with httpx.stream(
        "POST", f"{env.proxy_url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert env.sample(in_flight) == 1, first
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    usage = events[-1]["usage"]
    wait_until(lambda: env.sample(in_flight) == 0, 10, "the request to leave the in-flight gauge")
    moved = {"requests": 1, "added": 1, "ttft": 1, "sent": 1}
    moved |= {"input": usage["prompt_tokens"], "output": usage["completion_tokens"]}
    # The log worker sends the record and counts its tokens after the answer: wait for those.
    wait_until(
        lambda: count("sent") > before["sent"] and count("output") > before["output"],
        30,
        "the log worker's counts",
    )
    after = {key: count(key) for key in counters}
    assert {key: after[key] - before[key] for key in moved} == moved
    # Computed at each scrape: it grows until the next read of Redis resets it.
    age = env.sample("ratchet_proxy_registry_age_seconds")
    wait_until(
        lambda: env.sample("ratchet_proxy_registry_age_seconds") != age, 10, "the registry age"
    )
    text = httpx.get(f"{env.proxy_url}/metrics").text
    assert re.search(r"^ratchet_proxy_log_queue_depth \d", text, re.MULTILINE), text


def test_an_answer_too_large_for_kafka_is_logged_cut_and_blocks_nothing(
    base_route: Embedded, tmp_path: Path
) -> None:
    """An answer whose record passes proxy.max_record_bytes (there to stay below Kafka's 1 MiB)
    is stored cut to it, and the records after it still arrive. On a proxy whose limit is the
    smallest allowed, 64 KiB, two answers of 64 tokens with 20 top logprobs each pass it; the
    default 900 KiB took 16."""
    limit = 64 * 1024
    # Redacting 2,700 logprob strings takes ~30 ms here, but a loaded CI host once took past the
    # default 0.5 s, and the record was then replaced (truncated ["answer", ...]) before any cut:
    # this test is about the cut, so redaction gets all the time it may.
    with side_proxy(base_route, tmp_path, max_record_bytes=limit, redact_budget_s=60) as url:
        small = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test-key", max_retries=0)
        raw = small.chat.completions.with_raw_response.create(
            model=ALIAS,
            messages=MESSAGES,
            n=2,
            max_tokens=64,
            logprobs=True,
            top_logprobs=20,
            temperature=1.0,
            extra_body={"ignore_eos": True},  # every answer its full length
        )
        assert len(raw.parse().choices) == 2
        after = [
            small.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, max_tokens=4
            ).headers["x-request-id"]
            for _ in range(5)
        ]
    big = traffic_record(base_route, raw.headers["x-request-id"])
    assert big.truncated and big.truncated[0] == "logprobs", big.truncated
    assert big.original_bytes is not None and big.original_bytes > limit
    assert len(big.to_json()) <= limit
    assert len(big.choices) == 2 and all("logprobs" not in c for c in big.choices)
    for request_id in after:
        traffic_record(base_route, request_id)


def test_a_record_the_broker_refuses_is_dead_lettered_and_the_next_delivered(
    embedded: Embedded, tmp_path: Path
) -> None:
    """Past the producer's request limit kafka-python refuses a record for what it is: sending it
    again can only fail again, so it goes to ratchet.deadletter, not to the spool."""
    producer = RecordProducer(
        embedded.settings.kafka_bootstrap_servers,
        embedded.settings.kafka,
        tmp_path / "spool",
        topics=[TRAFFIC_TOPIC, DEADLETTER_TOPIC],
        max_record_bytes=64 * 1024,
    )
    huge = OutgoingRecord(TRAFFIC_TOPIC, b"refused", b'"' + b"x" * 300_000 + b'"')
    small = build_traffic_record(request_id="after-the-refused-one", alias=ALIAS)
    producer.start()
    try:
        producer.submit(huge)
        producer.submit(OutgoingRecord(TRAFFIC_TOPIC, b"after", small.to_json()))
        wait_until(lambda: producer.sent == 1 and producer.dead_lettered == 1, 60, "delivery")
    finally:
        producer.close()
    assert producer.spooled == 0 and producer.dropped == 0
    traffic_record(embedded, "after-the-refused-one")
    [letter] = embedded.find_records(
        DEADLETTER_TOPIC,
        lambda r: isinstance(r, DeadLetter) and r.value_bytes == len(huge.value),
    )
    assert isinstance(letter, DeadLetter)
    assert (letter.source_topic, letter.reason) == (TRAFFIC_TOPIC, "refused")
    assert "MessageSizeTooLarge" in letter.error and len(letter.value) <= 64 * 1024

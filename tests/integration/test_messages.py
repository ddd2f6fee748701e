"""The Anthropic Messages API (``POST /v1/messages``) against the real stack, driven by the
official ``anthropic`` client: create, stream and a tool round trip answer as the same chat
would, each exchange is logged as the chat exchange vLLM served (``client_api: messages``), the
real judge makes those exchanges into scored groups, and a rating of a Message joins its record."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, TrafficRecord
from ratchet.registry import AliasRoute
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.integration.test_judge import judge_config, running_judge, settled

ALIAS = "messages"
QUESTION = "Name one colour of the sky."
# The newest client has no sampling parameters of its own: they go as extra body fields, which
# the proxy passes on (temperature, top_p, top_k).
GREEDY = {"temperature": 0}
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(embedded: Embedded) -> Iterator[anthropic.Anthropic]:
    embedded.registry.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(ALIAS)
    # The key goes as x-api-key, as Anthropic's clients send it.
    with anthropic.Anthropic(base_url=embedded.proxy_url, api_key="k", max_retries=0) as c:
        yield c


def logged(env: Embedded, message_id: str) -> TrafficRecord:
    completion_id = "chatcmpl-" + message_id.removeprefix("msg_")
    (record,) = env.find_records(
        TRAFFIC_TOPIC, lambda r: isinstance(r, TrafficRecord) and r.response_id == completion_id
    )
    assert isinstance(record, TrafficRecord)
    return record


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_as_chat_would_and_is_logged_as_that_chat(
    embedded: Embedded, client: anthropic.Anthropic
) -> None:
    message = client.messages.create(
        model=ALIAS,
        system="Answer in one word.",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    with openai.OpenAI(base_url=f"{embedded.proxy_url}/v1", api_key="k", max_retries=0) as chat:
        same = chat.chat.completions.create(
            model=ALIAS,
            messages=[
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": QUESTION},
            ],
            max_tokens=8,
            temperature=0,
        )
    assert text_of(message) == same.choices[0].message.content
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == BASE_MODEL  # as chat names it
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8

    record = logged(embedded, message.id)
    assert record.client_api == "messages" and record.endpoint == "chat.completions"
    assert record.request["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    assert record.choices[0]["message"]["content"] == text_of(message)
    assert record.input_tokens == message.usage.input_tokens


def test_the_clients_stream_helper_gives_the_same_answer_as_create(
    embedded: Embedded, client: anthropic.Anthropic
) -> None:
    asked: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**asked)
    kinds: list[str] = []
    with client.messages.stream(**asked) as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    record = logged(embedded, streamed.id)
    assert record.client_api == "messages" and record.stream


def test_a_stop_sequence_ends_the_answer_with_its_stop_reason(
    client: anthropic.Anthropic,
) -> None:
    asked: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Count from 1 to 9, separated by commas."}],
        "max_tokens": 40,
        "extra_body": GREEDY,
    }
    free = text_of(client.messages.create(**asked))
    # The first character the model wrote after its first: a stop that must match.
    stop = next(ch for ch in free[1:] if not ch.isspace())
    stopped = client.messages.create(**asked, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stop not in text_of(stopped)[1:]


def tool_round_trip(client: anthropic.Anthropic) -> list[anthropic.types.Message]:
    """Ask, run the tool the model called, send its result, get the answer."""
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.messages.create(
        model=ALIAS,
        messages=asked,
        tools=[WEATHER],
        tool_choice={"type": "any"},  # chat's "required": a call the model must make
        max_tokens=100,
        extra_body=GREEDY,
    )
    calls = [block for block in first.content if block.type == "tool_use"]
    assert len(calls) == 1, first.content
    (call,) = calls
    assert call.name == "get_weather" and isinstance(call.input, dict)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "It is sunny."}
    turn = [*asked, {"role": "assistant", "content": first.content}]
    second = client.messages.create(
        model=ALIAS,
        messages=[*turn, {"role": "user", "content": [result]}],
        tools=[WEATHER],
        max_tokens=20,
        extra_body=GREEDY,
    )
    return [first, second]


def test_a_tool_round_trip_is_logged_as_chat_and_the_judge_scores_it(
    embedded: Embedded, client: anthropic.Anthropic, tmp_path: Path
) -> None:
    first, second = tool_round_trip(client)
    assert first.stop_reason == "tool_use"
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")

    records = [logged(embedded, m.id) for m in (first, second)]
    assert all(r.client_api == "messages" for r in records)
    assert records[0].request["tool_choice"] == "required"
    assert records[0].choices[0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    called, answered = records[1].request["messages"][-2:]
    assert called["tool_calls"][0]["id"] == answered["tool_call_id"]
    assert answered == {
        "role": "tool",
        "tool_call_id": answered["tool_call_id"],
        "content": "It is sunny.",
    }

    # The real judge replays each logged chat exchange as a group and scores it.
    config = judge_config(embedded, tmp_path, ALIAS)
    settings = yaml.safe_load(config.read_text())
    settings["aliases"][ALIAS]["learning"]["heldout_fraction"] = 0.0  # every prompt a group
    config.write_text(yaml.safe_dump(settings))
    port = settings["judge"]["metrics_port"]
    request_ids = {r.request_id for r in records}
    with running_judge(config, tmp_path / "state"):
        groups, heldout = settled(embedded, request_ids, port, ALIAS, timeout_s=600)
    assert not heldout and groups
    for group in groups:
        assert group.tools is not None and group.tools[0]["function"]["name"] == "get_weather"
        assert len(group.samples) == 3 and all(0.0 <= r <= 1.0 for r in group.rewards)


def test_a_message_id_is_rated_as_its_logged_answer(
    embedded: Embedded, client: anthropic.Anthropic
) -> None:
    message = client.messages.create(
        model=ALIAS, messages=[{"role": "user", "content": QUESTION}], max_tokens=4
    )
    rated = httpx.post(
        f"{embedded.proxy_url}/v1/feedback",
        json={"completion_id": message.id, "score": 0.8},
        headers={"Authorization": "Bearer k"},  # the key that got it, sent as x-api-key then
        timeout=10,
    )
    assert rated.status_code == 200, rated.text
    logged_id = logged(embedded, message.id).response_id
    (rating,) = embedded.find_records(
        FEEDBACK_TOPIC,
        lambda r: isinstance(r, FeedbackRecord) and r.completion_id == logged_id,
    )
    assert isinstance(rating, FeedbackRecord) and rating.score == 0.8


def test_refusals_are_anthropics_errors_the_client_raises_by_status(
    client: anthropic.Anthropic,
) -> None:
    asked: dict[str, Any] = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-alias", **asked)
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(
            model=ALIAS, thinking={"type": "enabled", "budget_tokens": 1024}, **asked
        )
    assert "thinking" in thinking.value.message

"""The Responses API through the real proxy and vLLM, with the official client's Responses methods
checked field by field, every answer and streamed event validated against the Open Responses
specification's published types (tests/open_responses.py), and each exchange logged to
ratchet.traffic as the chat exchange it was."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, TrafficRecord
from ratchet.registry import AliasRoute
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.open_responses import (
    check_sequence,
    conforming_events,
    conforming_item,
    conforming_response,
)

pytestmark = pytest.mark.integration

ALIAS = "responses"
QUESTION = "Name one colour of the sky."


@pytest.fixture(scope="module")
def client(embedded: Embedded) -> Iterator[openai.OpenAI]:
    embedded.registry.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(ALIAS)
    with openai.OpenAI(base_url=f"{embedded.proxy_url}/v1", api_key="k", max_retries=0) as c:
        yield c


def logged(env: Embedded, completion_id: str) -> TrafficRecord:
    (record,) = env.find_records(
        TRAFFIC_TOPIC, lambda r: isinstance(r, TrafficRecord) and r.response_id == completion_id
    )
    assert isinstance(record, TrafficRecord)
    return record


def completion_id(response_id: str) -> str:
    return "chatcmpl-" + response_id.removeprefix("resp_")


def test_create_answers_as_chat_would_and_is_logged_as_that_chat(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    response = client.responses.create(
        model=ALIAS,
        input=QUESTION,
        instructions="Answer in one word.",
        max_output_tokens=8,
        temperature=0,
        metadata={"case": "plain"},
    )
    # The same conversation as chat, greedy: the translation changed nothing the model saw.
    chat = client.chat.completions.create(
        model=ALIAS,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.model == BASE_MODEL  # v0, no canary: the served name, as chat shows it
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.instructions == "Answer in one word."
    assert (response.max_output_tokens, response.temperature) == (8, 0)
    assert response.metadata == {"case": "plain"}
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    record = logged(embedded, completion_id(response.id))
    assert record.client_api == "responses" and record.endpoint == "chat.completions"
    assert record.request["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    assert record.choices[0]["message"]["content"] == response.output_text
    assert record.input_tokens == usage.input_tokens


def test_a_streamed_response_is_the_event_sequence_of_the_same_answer(
    client: openai.OpenAI,
) -> None:
    """Cut at max_output_tokens, it ends ``response.incomplete`` as OpenAI's does (the client's
    ``responses.stream()`` helper then finds no ``response.completed``: openai-python#3538), so
    the plain stream of ``create(stream=True)`` is read here."""
    whole = client.responses.create(
        model=ALIAS, input=QUESTION, max_output_tokens=8, temperature=0, store=False
    )
    events = list(
        client.responses.create(
            model=ALIAS,
            input=QUESTION,
            max_output_tokens=8,
            temperature=0,
            store=False,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
    assert kinds[-1] == terminal[whole.status]  # type: ignore[index]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("resp_") and final.id != whole.id
    assert final.store is False


class Colour(BaseModel):
    model_config = ConfigDict(extra="forbid")
    colour: str


def test_a_json_schema_answer_parses_into_the_clients_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=ALIAS, input=QUESTION, text_format=Colour, max_output_tokens=40, temperature=0
    )
    assert isinstance(parsed.output_parsed, Colour)
    assert json.loads(parsed.output_text) == parsed.output_parsed.model_dump()
    assert parsed.text is not None and parsed.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_previous_response_id_continues_and_stored_responses_are_read_and_deleted(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model=ALIAS, input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    assert first.store is True
    second = client.responses.create(
        model=ALIAS,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    record = logged(embedded, completion_id(second.id))
    assert record.request["messages"] == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    again = client.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as continued:
        client.responses.create(model=ALIAS, input="x", previous_response_id=first.id)
    assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ],
)
def test_what_vllm_cannot_do_is_refused_naming_the_parameter(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=ALIAS, input="hi", **extra)
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert body["code"] == "unsupported_parameter"


def test_a_response_id_is_rated_as_its_logged_answer(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    response = client.responses.create(model=ALIAS, input=QUESTION, max_output_tokens=4)
    rated = httpx.post(
        f"{embedded.proxy_url}/v1/feedback",
        json={"completion_id": response.id, "score": 0.9},
        headers={"Authorization": "Bearer k"},  # the key that got it, as the client sent
        timeout=10,
    )
    assert rated.status_code == 200, rated.text
    logged_id = logged(embedded, completion_id(response.id)).response_id
    (rating,) = embedded.find_records(
        FEEDBACK_TOPIC,
        lambda r: isinstance(r, FeedbackRecord) and r.completion_id == logged_id,
    )
    assert isinstance(rating, FeedbackRecord) and rating.score == 0.9


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
SHADE = {
    "type": "object",
    "properties": {"shade": {"enum": ["blue", "grey"]}},
    "required": ["shade"],
}
CASES: dict[str, dict[str, Any]] = {
    "plain": {"input": QUESTION, "max_output_tokens": 8},  # completed or cut: either conforms
    "tools": {
        "input": "What is the weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 100,
    },
    "json_schema": {
        "input": QUESTION,
        "text": {"format": {"type": "json_schema", "name": "shade", "schema": SHADE}},
        "max_output_tokens": 20,
    },
}


def post(env: Embedded, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{env.proxy_url}/v1/responses",
        json=body,
        headers={"Authorization": "Bearer k"},
        timeout=120,
    )


@pytest.mark.parametrize("case", CASES)
def test_every_answer_and_streamed_event_is_what_the_specification_defines(
    client: openai.OpenAI, embedded: Embedded, case: str
) -> None:
    """The bytes the proxy sends, whole and streamed, for a plain, a tool-calling and a
    JSON-schema request: each Response and event valid as the specification's type, the events
    in its order (tests/open_responses.py check_sequence)."""
    body = {"model": ALIAS, "temperature": 0, **CASES[case]}
    whole = post(embedded, body)
    assert whole.status_code == 200, whole.text
    response = conforming_response(whole.content)
    with httpx.stream(
        "POST",
        f"{embedded.proxy_url}/v1/responses",
        json={**body, "stream": True},
        headers={"Authorization": "Bearer k"},
        timeout=120,
    ) as streamed:
        assert streamed.status_code == 200
        raw = streamed.read()
    final = check_sequence(conforming_events(raw))
    assert final["status"] == response.status
    if case == "plain" and response.status == "incomplete":
        assert response.completed_at is None
        return
    assert response.status == "completed"  # greedy, and long enough to finish
    assert [item["type"] for item in final["output"]] == [i.type for i in response.output]
    if case == "tools":
        call = final["output"][-1]
        assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
    if case == "json_schema":
        assert json.loads(whole.json()["output"][0]["content"][0]["text"])["shade"] in (
            "blue",
            "grey",
        )
    assert response.completed_at is not None and response.completed_at >= response.created_at


class Shade(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shade: Literal["blue", "grey"]


def test_the_clients_stream_helper_runs_to_completion(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=ALIAS, input=QUESTION, text_format=Shade, max_output_tokens=20, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert isinstance(final.output_parsed, Shade)
    assert "response.output_text.done" in kinds and "response.content_part.done" in kinds


def test_input_items_list_the_conversation_for_the_key_that_made_it(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model=ALIAS, input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=ALIAS,
        input=[{"role": "user", "content": "What is my name?"}],
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    listed = client.responses.input_items.list(second.id, order="asc")
    texts = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert texts == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert listed.data[2].content[0].text == "What is my name?"  # type: ignore[union-attr]
    raw = httpx.get(
        f"{embedded.proxy_url}/v1/responses/{second.id}/input_items",
        params={"limit": 1},
        headers={"Authorization": "Bearer k"},
        timeout=10,
    )
    assert raw.json()["has_more"] is True and len(raw.json()["data"]) == 1
    for item in raw.json()["data"]:
        conforming_item(item)
    stranger = httpx.get(
        f"{embedded.proxy_url}/v1/responses/{second.id}/input_items",
        headers={"Authorization": "Bearer someone-else"},
        timeout=10,
    )
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"team": "v" * 513}, "metadata.team"),
    ],
)
def test_metadata_past_openais_bounds_is_a_400_naming_it(
    client: openai.OpenAI, metadata: dict[str, str], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=ALIAS, input="hi", metadata=metadata)
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_metadata_at_openais_bounds_is_echoed(client: openai.OpenAI) -> None:
    metadata = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}
    response = client.responses.create(
        model=ALIAS, input="hi", metadata=metadata, max_output_tokens=1, store=False
    )
    assert response.metadata == metadata


def test_input_tokens_are_the_prompt_tokens_the_same_request_is_charged(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    """The official client's ``responses.input_tokens.count``: vLLM's tokenization of the chat
    the request becomes, equal to the prompt_tokens of that request's answer and of the same
    conversation sent as chat; counted without an exchange on ratchet.traffic."""
    request: dict[str, Any] = {
        "model": ALIAS,
        "input": "What is the weather in Oslo?",
        "instructions": "Use the tool.",
        "tools": [WEATHER],
    }
    counted = client.responses.input_tokens.count(
        **request, extra_headers={"x-request-id": "count-oslo"}
    )
    assert counted.object == "response.input_tokens" and counted.input_tokens > 0
    answer = client.responses.create(**request, max_output_tokens=1, store=False)
    assert answer.usage is not None and answer.usage.input_tokens == counted.input_tokens
    function: Any = {key: value for key, value in WEATHER.items() if key != "type"}
    chat = client.chat.completions.create(
        model=ALIAS,
        messages=[
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "What is the weather in Oslo?"},
        ],
        tools=[{"type": "function", "function": function}],
        max_tokens=1,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == counted.input_tokens
    plain = client.responses.input_tokens.count(model=ALIAS, input="What is the weather?")
    assert 0 < plain.input_tokens < counted.input_tokens  # no tool, no instructions

    logged(embedded, completion_id(answer.id))  # the log worker is past the count by now
    counts = embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.client_request_id == "count-oslo",
        timeout_s=5,
    )
    assert counts == []


def test_input_tokens_continue_a_stored_response_for_its_key_only(
    embedded: Embedded, client: openai.OpenAI
) -> None:
    first = client.responses.create(model=ALIAS, input="My name is Ada.", max_output_tokens=6)
    follow_up: dict[str, Any] = {
        "model": ALIAS,
        "input": "What is my name?",
        "previous_response_id": first.id,
    }
    counted = client.responses.input_tokens.count(**follow_up)
    second = client.responses.create(**follow_up, max_output_tokens=1, store=False)
    assert second.usage is not None and second.usage.input_tokens == counted.input_tokens
    stranger = httpx.post(
        f"{embedded.proxy_url}/v1/responses/input_tokens",
        json=follow_up,
        headers={"Authorization": "Bearer someone-else"},
        timeout=30,
    )
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_tokens.count(model=ALIAS, input="hi", truncation="auto")
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "truncation"

"""The Responses API's pure core (proxy/responses_api.py, proxy/responses_stream.py): requests
made chat requests, chat answers and streams made Responses, each checked against the official
client's own types (strict pydantic validation, not the client's lenient construct) and the Open
Responses specification's published types (tests/open_responses.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from proxy.errors import ProxyError
from proxy.responses_api import (
    assistant_message,
    completion_id_of_response,
    response_id_of,
    response_object,
    to_chat,
)
from proxy.responses_stream import ResponsesStream
from tests.open_responses import check_sequence, conforming_events, conforming_response

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def test_a_string_input_with_instructions_is_a_system_and_a_user_turn() -> None:
    req = to_chat(
        {
            "model": "support",
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 20,
            "temperature": 0.2,
            "top_p": 0.9,
            "user": "u1",
        },
        None,
    )
    assert req.chat == {
        "model": "support",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 20,
        "user": "u1",
    }
    # The next turn continues the conversation without the instructions, as OpenAI's does.
    assert req.conversation == [{"role": "user", "content": "hi"}]
    assert req.store and not req.stream


def test_agent_items_become_the_chat_turns_of_a_tool_loop() -> None:
    """What the Agents SDK sends on its second turn: the user's message, the model's function
    call (as the SDK keeps it, with ids and status) and the tool's output."""
    req = to_chat(
        {
            "model": "support",
            "input": [
                {"role": "developer", "content": "use tools"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Oslo?"}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"Oslo"}',
                    "status": "completed",
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "sun"}],
                },
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "include": [],
            "prompt_cache_key": "support-42",
            "service_tier": "ignored",
        },
        None,
    )
    assert req.chat["messages"] == [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    function = {k: v for k, v in WEATHER_TOOL.items() if k != "type"}
    assert req.chat["tools"] == [{"type": "function", "function": function}]
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert req.chat["parallel_tool_calls"] is False
    assert "include" not in req.chat and "service_tier" not in req.chat
    assert req.chat["prompt_cache_key"] == "support-42"  # the conversation's replica key


def test_previous_turns_come_first_and_a_json_schema_is_a_response_format() -> None:
    previous = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    req = to_chat(
        {
            "model": "support",
            "input": "c",
            "text": {
                "format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
            },
            "stream": True,
        },
        previous,
    )
    assert req.chat["messages"] == [*previous, {"role": "user", "content": "c"}]
    assert req.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema, "strict": True},
    }
    assert req.chat["stream"] is True and req.stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"seed": 1}, "seed"),  # not a Responses parameter: not passed on to vLLM either
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"stream": "yes"}, "stream"),
        # Malformed rather than unsupported: each names the field that is wrong.
        ({"instructions": 3}, "instructions"),
        ({"metadata": {"team": 1}}, "metadata.team"),
        ({"metadata": [["team", "a"]]}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"team": "v" * 513}}, "metadata.team"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"safety_identifier": "u" * 65}, "safety_identifier"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
            "input[0].output",
        ),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"text": "json"}, "text"),
        ({"text": {"format": "json"}}, "text.format"),  # a string where an object goes
        ({"text": {"format": ["json_object"]}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)
def test_what_has_no_chat_equivalent_is_refused_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ProxyError) as raised:
        to_chat({"model": "support", "input": "hi", **body}, None)
    assert raised.value.status == 400
    assert raised.value.param == param


CHAT_ANSWER = {
    "id": "chatcmpl-abc123",
    "object": "chat.completion",
    "created": 1767225600,
    "model": "support@v2",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
}


def test_a_chat_answer_is_a_response_the_client_parses() -> None:
    req = to_chat(
        {"model": "support", "input": "Oslo?", "tools": [WEATHER_TOOL], "metadata": {"k": "v"}},
        None,
    )
    body = response_object(CHAT_ANSWER, req.echo)
    parsed = Response.model_validate(body)  # strict: every field the client reads is right
    assert parsed.id == "resp_abc123" == response_id_of("chatcmpl-abc123")
    assert completion_id_of_response(parsed.id) == "chatcmpl-abc123"
    assert parsed.status == "completed" and parsed.model == "support@v2"
    assert parsed.output_text == "Let me look."
    call = parsed.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_9", "get_weather", '{"city":"Oslo"}')
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (
        11,
        7,
        18,
    )
    assert parsed.metadata == {"k": "v"} and parsed.tools[0].name == "get_weather"
    # The next turn continues from the same message as chat.
    assert assistant_message(body) == CHAT_ANSWER["choices"][0]["message"] | {"role": "assistant"}


def test_an_answer_cut_at_max_tokens_is_incomplete() -> None:
    answer = {
        **CHAT_ANSWER,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "length",
            }
        ],
    }
    parsed = Response.model_validate(
        response_object(answer, to_chat({"model": "a", "input": "q"}, None).echo)
    )
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"


def sse(*chunks: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (c.encode() if isinstance(c, str) else orjson.dumps(c)) + b"\n\n"
        for c in chunks
    )


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    head = {
        "id": "chatcmpl-s1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "support",
    }
    return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def events_of(raw: bytes) -> list[Any]:
    events = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        kind, data = block.split(b"\n")
        event = EVENTS.validate_python(orjson.loads(data.removeprefix(b"data: ")))
        assert kind == b"event: " + event.type.encode()
        events.append(event)
    return events


STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
    chunk({}, "tool_calls"),
    {
        "id": "chatcmpl-s1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "support",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
    },
    "[DONE]",
)


@pytest.mark.parametrize("cut", [1, 7, 64, len(STREAM)])
def test_a_chat_stream_is_the_responses_event_sequence_however_it_is_cut(cut: int) -> None:
    stream = ResponsesStream(to_chat({"model": "support", "input": "hi"}, None).echo, lambda: 7.9)
    raw = b"".join(stream.feed(STREAM[i : i + cut]) for i in range(0, len(STREAM), cut))
    assert b"response.completed" not in raw  # it waits to say whether the store kept it
    raw += stream.closing_event()
    events = events_of(raw)
    # Each item in turn, as OpenAI streams them: the message is done before the call begins.
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert check_sequence(conforming_events(raw)) == stream.final
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    completed = events[-1].response
    assert completed.id == "resp_s1" and completed.output_text == "Hello"
    assert completed.output[1].arguments == '{"city":"Oslo"}'
    assert completed.usage is not None and completed.usage.total_tokens == 14
    assert stream.final is not None and Response.model_validate(stream.final) == completed
    assert stream.final["completed_at"] == 7


def test_the_final_event_says_store_false_when_the_store_refused_the_response() -> None:
    stream = ResponsesStream(to_chat({"model": "support", "input": "hi"}, None).echo)
    stream.feed(STREAM)
    assert stream.final is not None and stream.final["store"] is True
    completed = events_of(stream.closing_event(stored=False))[-1]
    assert completed.type == "response.completed" and completed.response.store is False
    assert stream.closing_event() == b""  # sent once


def test_a_stream_vllm_breaks_off_ends_failed() -> None:
    stream = ResponsesStream(to_chat({"model": "support", "input": "hi"}, None).echo)
    error = {
        "error": {
            "message": "upstream closed",
            "type": "server_error",
            "param": None,
            "code": "upstream_disconnected",
        }
    }
    raw = stream.feed(sse(chunk({"content": "Hel"}), error))
    check_sequence(conforming_events(raw))
    events = events_of(raw)
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "upstream_disconnected"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == "upstream closed"
    assert stream.final is not None and stream.final["status"] == "failed"


def test_a_response_has_every_field_the_specification_requires() -> None:
    """The request's echo at OpenAI's defaults, or as given; completed_at from the caller."""
    req = to_chat(
        {
            "model": "support",
            "input": "Oslo?",
            "tools": [{"type": "function", "name": "get_weather"}, WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "metadata": {f"k{i}" + "x" * 60: "v" * 512 for i in range(16)},  # at the bounds
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "safety_identifier": "user-7",
            "prompt_cache_key": "conv-7",
            "service_tier": "auto",
            "top_logprobs": 0,
            "reasoning": {"effort": None},
            "stream_options": {"include_obfuscation": False},
            "text": {"verbosity": "medium"},
        },
        None,
    )
    assert (req.chat["presence_penalty"], req.chat["frequency_penalty"]) == (0.5, -1)
    assert "safety_identifier" not in req.chat and "service_tier" not in req.chat
    body = response_object(CHAT_ANSWER, req.echo, completed_at=1767225601)
    spec = conforming_response(body)
    assert (spec.created_at, spec.completed_at) == (1767225600, 1767225601)
    assert (spec.presence_penalty, spec.frequency_penalty, spec.top_logprobs) == (0.5, -1, 0)
    assert (spec.background, spec.service_tier, spec.max_tool_calls) == (False, "default", None)
    assert (spec.safety_identifier, spec.prompt_cache_key) == ("user-7", "conv-7")
    assert spec.reasoning is not None and spec.reasoning.effort is None
    assert spec.tools[0].root.description is None and spec.tools[1].root.strict is True
    assert spec.text.format.type == "text" and spec.truncation == "disabled"
    assert len(spec.metadata) == 16
    Response.model_validate(body)  # and the official client's type still reads it


def test_defaults_and_a_json_schema_format_conform_as_openai_gives_them() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    req = to_chat({"model": "support", "input": "c", "text": {"format": fmt}}, None)
    assert req.chat["response_format"]["json_schema"]["schema"] == schema  # applied
    body = response_object(CHAT_ANSWER, req.echo, completed_at=1767225601)
    spec = conforming_response(body)
    assert body["text"]["format"] == {**fmt, "schema": None, "description": None}
    assert (spec.temperature, spec.top_p, spec.presence_penalty) == (1.0, 1.0, 0.0)
    assert (spec.tool_choice, spec.parallel_tool_calls, spec.tools) == ("auto", True, [])
    assert spec.metadata == {} and spec.store is True and body["user"] is None


def test_only_a_completed_response_has_completed_at() -> None:
    cut = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
    answer = {**CHAT_ANSWER, "choices": [cut]}
    echo = to_chat({"model": "a", "input": "q"}, None).echo
    incomplete = conforming_response(response_object(answer, echo, completed_at=5))
    assert incomplete.status == "incomplete" and incomplete.completed_at is None


def call_chunk(index: int, call_id: str | None, arguments: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call |= {"id": call_id, "type": "function", "function": {"name": "f", "arguments": ""}}
    return chunk({"tool_calls": [call]})


def test_parallel_calls_stream_one_after_another_and_a_cut_answer_ends_incomplete() -> None:
    stream = ResponsesStream(to_chat({"model": "support", "input": "hi"}, None).echo)
    raw = stream.feed(
        sse(
            call_chunk(0, "call_a", ""),
            call_chunk(0, None, '{"x":1}'),
            call_chunk(1, "call_b", ""),
            call_chunk(1, None, '{"x":2}'),
            call_chunk(0, None, "late"),  # for a call already done: dropped, never reopened
            chunk({}, "length"),
            "[DONE]",
        )
    )
    raw += stream.closing_event()
    final = check_sequence(conforming_events(raw))
    assert [(i["call_id"], i["arguments"]) for i in final["output"]] == [
        ("call_a", '{"x":1}'),
        ("call_b", '{"x":2}'),
    ]
    assert final["status"] == "incomplete" and final["completed_at"] is None
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}

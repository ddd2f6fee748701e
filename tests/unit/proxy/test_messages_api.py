"""The Messages API's pure core (proxy/messages_api.py, proxy/messages_stream.py): a Messages
request as the chat request vLLM gets, vLLM's chat answer and chat stream as a Message and as
Anthropic's events, and what has no chat form refused naming the parameter."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.errors import ProxyError
from proxy.messages_api import completion_id_of_message, message_object, to_chat
from proxy.messages_stream import MessagesStream

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def test_a_tool_round_trip_is_the_chat_conversation_of_calls_and_tool_messages() -> None:
    payload = {
        "model": "support",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"],
        "temperature": 0,
        "top_k": 5,
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u-1"},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                    {"type": "text", "text": "And Bergen?", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
    }
    chat = to_chat(payload)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {"role": "user", "content": "And Bergen?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_k"]) == (
        64,
        ["\n\n"],
        0,
        5,
    )
    assert chat["user"] == "u-1" and "stream" not in chat


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": None}, "max_tokens"),
        ({"mcp_servers": []}, "mcp_servers"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"metadata": {"user_id": "u", "other": 1}}, "metadata"),
        ({"stop_sequences": "END"}, "stop_sequences"),
    ],
)
def test_what_has_no_chat_form_is_a_400_naming_the_parameter(
    change: dict[str, Any], param: str
) -> None:
    payload = {"model": "support", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ProxyError) as raised:
        to_chat(payload | change)
    assert (raised.value.status, raised.value.param) == (400, param)


def test_accepted_without_effect_thinking_disabled_and_cache_hints() -> None:
    payload = {
        "model": "support",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
        "service_tier": "auto",
        "cache_control": {"type": "ephemeral"},
    }
    assert to_chat(payload) == {
        "model": "support",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }


def answer(message: dict[str, Any], finish: str, stop: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop}
    return {
        "id": "chatcmpl-abc",
        "model": "support",
        "choices": [choice],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3},
    }


@pytest.mark.parametrize(
    ("finish", "stop", "called", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("length", None, False, ("max_tokens", None)),
        ("tool_calls", None, True, ("tool_use", None)),
        ("stop", None, True, ("tool_use", None)),  # a named tool call finishes as "stop"
    ],
)
def test_a_chat_answer_is_a_message_with_anthropics_stop_reason(
    finish: str, stop: str | None, called: bool, expected: tuple[str, str | None]
) -> None:
    calls = [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    message = {"content": "Hi", "tool_calls": calls if called else []}
    got = message_object(answer(message, finish, stop))
    assert (got["stop_reason"], got["stop_sequence"]) == expected
    assert got["id"] == "msg_abc" and completion_id_of_message(got["id"]) == "chatcmpl-abc"
    assert got["usage"] == {"input_tokens": 11, "output_tokens": 3}
    assert got["content"][0] == {"type": "text", "text": "Hi"}
    if called:
        assert got["content"][1] == {
            "type": "tool_use",
            "id": "c1",
            "name": "get_weather",
            "input": {"city": "Oslo"},
        }


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n")
            kind = head.removeprefix(b"event: ").decode()
            body = orjson.loads(data.removeprefix(b"data: "))
            assert body["type"] == kind
            events.append((kind, body))
    return events


def test_a_chat_stream_is_anthropics_event_sequence_whatever_its_cuts() -> None:
    head = {"id": "chatcmpl-abc", "model": "support"}
    raw = sse(
        head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        head | {"choices": [{"index": 0, "delta": {"content": "Let"}}]},
        head | {"choices": [{"index": 0, "delta": {"content": " me"}}]},
        head
        | {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "function": {"name": "get_weather", "arguments": '{"ci'},
                            }
                        ]
                    },
                }
            ]
        },
        head
        | {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]
                    },
                }
            ]
        },
        head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        head | {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}},
    )
    whole = MessagesStream().feed(raw)
    cut = MessagesStream()
    assert b"".join(cut.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) == whole
    events = events_of(whole)
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["id"] == "msg_abc"
    assert events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "c1",
        "name": "get_weather",
        "input": {},
    }
    arguments = "".join(e["delta"]["partial_json"] for k, e in events[6:8])
    assert arguments == '{"city":"Oslo"}' and events[6][1]["index"] == 1
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"input_tokens": 9, "output_tokens": 7}
    assert cut.stop_reason == "tool_use"


def test_an_error_mid_stream_is_anthropics_error_event_and_the_last() -> None:
    head = {"id": "chatcmpl-abc", "model": "support"}
    error = {"message": "vLLM broke off", "type": "server_error", "code": "upstream_dropped"}
    raw = (
        b"data: " + orjson.dumps(head | {"choices": [{"index": 0, "delta": {"content": "a"}}]})
    ) + (b"\n\ndata: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n")
    events = events_of(MessagesStream().feed(raw))
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "vLLM broke off"}},
    )
    assert "message_stop" not in [kind for kind, _ in events]

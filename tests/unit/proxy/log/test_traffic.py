"""proxy/log/exchange.py: folding streamed chunks into a body, redaction, records.

SSE parsing itself is tests/unit/proxy/test_sse.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest

from proxy.log.exchange import REDACTED, Exchange, Redactor, assemble_stream
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord, decode
from ratchet.secrets import hash_api_key


def sse(events: list[dict[str, Any]], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def chat_chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any):
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    choice.update(extra)
    return {"id": "chatcmpl-7", "object": "chat.completion.chunk", "choices": [choice]}


SECRET = b"unit-test-server-secret"
USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
USAGE_CHUNK = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "choices": [], "usage": USAGE}


# ---- assemble_stream: chat ----------------------------------------------------------------------


def test_chat_content_role_and_usage() -> None:
    events = [
        chat_chunk(0, {"role": "assistant", "content": ""}),
        chat_chunk(0, {"content": "Hel"}),
        chat_chunk(0, {"content": "lo"}),
        chat_chunk(0, {"content": "!"}, finish="stop"),
        USAGE_CHUNK,
    ]
    body = assemble_stream(events, "chat.completions")
    assert body["id"] == "chatcmpl-7"
    assert body["usage"] == USAGE
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "finish_reason": "stop",
        }
    ]


def test_chat_two_choices_interleaved() -> None:
    events = [
        chat_chunk(1, {"role": "assistant", "content": ""}),
        chat_chunk(0, {"role": "assistant", "content": ""}),
        chat_chunk(1, {"content": "B1"}),
        chat_chunk(0, {"content": "A1"}),
        chat_chunk(0, {"content": "A2"}),
        chat_chunk(1, {"content": "B2"}, finish="length"),
        chat_chunk(0, {"content": "A3"}, finish="stop"),
        USAGE_CHUNK,
    ]
    body = assemble_stream(events, "chat.completions")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["A1A2A3", "B1B2"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]


def test_chat_tool_calls_split_across_chunks() -> None:
    events = [
        chat_chunk(0, {"role": "assistant"}),
        chat_chunk(
            0,
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
        ),
        chat_chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}),
        chat_chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]}),
        chat_chunk(
            0,
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            },
        ),
        chat_chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}),
        chat_chunk(0, {}, finish="tool_calls"),
        USAGE_CHUNK,
    ]
    body = assemble_stream(events, "chat.completions")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert orjson.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_chat_logprobs_concatenated() -> None:
    def lp(token: str, value: float) -> dict[str, Any]:
        return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}

    events = [
        chat_chunk(0, {"role": "assistant", "content": "a"}, logprobs={"content": [lp("a", -0.1)]}),
        chat_chunk(1, {"role": "assistant", "content": "x"}, logprobs={"content": [lp("x", -1.0)]}),
        chat_chunk(0, {"content": "bc"}, logprobs={"content": [lp("b", -0.2), lp("c", -0.3)]}),
        chat_chunk(0, {}, finish="stop", logprobs=None),
        USAGE_CHUNK,
    ]
    body = assemble_stream(events, "chat.completions")
    first, second = body["choices"]
    assert [t["token"] for t in first["logprobs"]["content"]] == ["a", "b", "c"]
    assert [t["logprob"] for t in first["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert [t["token"] for t in second["logprobs"]["content"]] == ["x"]
    plain = assemble_stream([chat_chunk(0, {"content": "a"}, logprobs=None)], "chat.completions")
    assert "logprobs" not in plain["choices"][0]


def test_chat_usage_only_final_chunk_does_not_add_a_choice() -> None:
    body = assemble_stream(
        [chat_chunk(0, {"content": "x"}, finish="stop"), USAGE_CHUNK], "chat.completions"
    )
    assert len(body["choices"]) == 1
    assert body["usage"]["completion_tokens"] == 5


def test_chat_without_usage() -> None:
    body = assemble_stream([chat_chunk(0, {"content": "x"}, finish="stop")], "chat.completions")
    assert "usage" not in body


def test_empty_stream() -> None:
    assert assemble_stream([], "chat.completions")["choices"] == []


# ---- assemble_stream: completions ---------------------------------------------------------------


def cmpl_chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None):
    return {
        "id": "cmpl-9",
        "object": "text_completion",
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def test_completions_text_and_choices() -> None:
    events = [
        cmpl_chunk(0, "Once"),
        cmpl_chunk(1, "In"),
        cmpl_chunk(0, " upon"),
        cmpl_chunk(1, " a", finish="length"),
        cmpl_chunk(0, " a time", finish="stop"),
        {"id": "cmpl-9", "object": "text_completion", "choices": [], "usage": USAGE},
    ]
    body = assemble_stream(events, "completions")
    assert body["id"] == "cmpl-9"
    assert body["usage"] == USAGE
    assert body["choices"] == [
        {"index": 0, "text": "Once upon a time", "finish_reason": "stop"},
        {"index": 1, "text": "In a", "finish_reason": "length"},
    ]
    assert all("message" not in c for c in body["choices"])


def test_completions_logprobs_concatenated() -> None:
    """Completions logprobs are {tokens, token_logprobs, top_logprobs, text_offset} lists."""
    events = [
        cmpl_chunk(
            0,
            "Hi",
            logprobs={
                "tokens": ["Hi"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{"Hi": -0.5}],
                "text_offset": [0],
            },
        ),
        cmpl_chunk(
            0,
            " there",
            finish="stop",
            logprobs={
                "tokens": [" there"],
                "token_logprobs": [-0.25],
                "top_logprobs": [{" there": -0.25}],
                "text_offset": [2],
            },
        ),
    ]
    (choice,) = assemble_stream(events, "completions")["choices"]
    assert choice["text"] == "Hi there"
    assert choice["logprobs"]["tokens"] == ["Hi", " there"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.25]
    assert choice["logprobs"]["text_offset"] == [0, 2]


# ---- Redactor -----------------------------------------------------------------------------------


def test_redactor_nested() -> None:
    redact = Redactor([r"[\w.+-]+@[\w-]+\.[\w.]+", r"sk-[A-Za-z0-9]{8,}"])
    value = {
        "messages": [
            {"role": "user", "content": "mail ann@example.com or bob@x.org, key sk-ABCDEFGH12"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "cc carol@example.net"}, {"n": 3}],
            },
        ],
        "temperature": 0.5,
        "stream": True,
        "user": None,
        "ann@example.com": "keys are redacted too",
        "deep": [[["dave@example.com"]]],
    }
    original = copy.deepcopy(value)
    out = redact(value)
    assert value == original  # the input is not mutated
    assert out["messages"][0]["content"] == f"mail {REDACTED} or {REDACTED}, key {REDACTED}"
    assert out["messages"][1]["content"][0]["text"] == f"cc {REDACTED}"
    assert out["messages"][1]["content"][1] == {"n": 3}
    assert out["temperature"] == 0.5 and out["stream"] is True and out["user"] is None
    assert out[REDACTED] == "keys are redacted too"
    assert out["deep"] == [[[REDACTED]]]
    assert "example.com" not in orjson.dumps(out["messages"]).decode()


def test_redactor_without_patterns_is_identity() -> None:
    value = {"a": ["ann@example.com"]}
    assert Redactor([])(value) is value


SHIPPED = r"[\p{L}\p{N}_.+-]+@[\p{L}\p{N}_-]+\.[\p{L}\p{N}_.]+"  # embedded/ratchet.yaml
EARLIER = r"[\w.+-]+@[\w-]+\.[\w.]+"  # shipped before: Python's re took hours on one token


@pytest.mark.parametrize("pattern", [SHIPPED, EARLIER], ids=["shipped", "earlier"])
def test_a_4_mib_run_of_letters_is_redacted_within_the_default_budget(pattern: str) -> None:
    """Audit C-1: with Python's re this took about 15 hours (each start position scanned to
    the end of the run); RE2 is linear, well within the default per-record budget."""
    text = "a" * (4 << 20) + " mail ann@example.com"
    redaction = Redactor([pattern]).begin()
    out = redaction({"messages": [{"role": "user", "content": text}]})
    assert out["messages"][0]["content"] == "a" * (4 << 20) + f" mail {REDACTED}"
    assert not redaction.over_budget and redaction.failed == []


def test_the_shipped_pattern_redacts_addresses_in_any_script() -> None:
    # RE2's \w is ASCII only: the shipped pattern says \p{L} so that these stay redacted.
    assert Redactor([SHIPPED])("to müller@exämple.de or ann@example.com") == (
        f"to {REDACTED} or {REDACTED}"
    )


def test_past_the_budget_every_string_left_is_replaced_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fail closed: what was not redacted in time is never logged as it came."""
    clock = iter([0.0, 0.1, 0.2] + [99.0] * 100)  # the deadline passes after two strings
    monkeypatch.setattr("proxy.log.redaction.time.monotonic", lambda: next(clock))
    ex = exchange(
        request={"model": "support", "messages": [{"role": "user", "content": "ann@example.com"}]},
        response_body=orjson.dumps(NON_STREAM_BODY),
    )
    ex.redactor = Redactor([r"[\w.+-]+@[\w-]+\.[\w.]+"], budget_s=1.0)
    record = ex.to_record()
    value = record.to_json()
    assert b"example.com" not in value and b"hello" not in value
    assert record.request["model"] == "support"  # redacted in time: kept
    assert record.choices == [{REDACTED: REDACTED}]  # keys too, merged: nobody learns from it
    assert record.truncated == ["request", "answer"]


def test_a_key_seen_before_is_redacted_again() -> None:
    """Keys are remembered redacted, across records: never the key as sent."""
    redact = Redactor([r"[\w.+-]+@[\w-]+\.[\w.]+"])
    for _ in range(2):
        assert redact({"ann@example.com": 1, "role": "user"}) == {REDACTED: 1, "role": "user"}
    assert redact.keys == {"ann@example.com": REDACTED, "role": "role"}


def test_keys_user_and_error_are_redacted() -> None:
    """The previous audit's L4: dict keys, the top-level ``user`` and ``error`` went through."""
    error = {
        "message": "prompt from bob@example.org is too long",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }
    ex = exchange(
        request={
            "model": "support",
            "messages": [{"role": "user", "content": "hi"}],
            "user": "ann@example.com",
            "metadata": {"carol@example.net": "x"},
        },
        status=400,
        error=error,
    )
    record = ex.to_record()
    assert record.user == REDACTED and record.request["user"] == REDACTED
    assert record.request["metadata"] == {REDACTED: "x"}
    assert record.error == {**error, "message": f"prompt from {REDACTED} is too long"}
    assert b"example" not in record.to_json() and record.truncated == []


# ---- Exchange.to_record -------------------------------------------------------------------------


def exchange(**overrides: Any) -> Exchange:
    fields: dict[str, Any] = dict(
        request_id="req-42",
        endpoint="chat.completions",
        alias="support",
        served_name="support@v2",
        version=2,
        canary_arm="canary",
        request={
            "model": "support",
            "messages": [{"role": "user", "content": "I am ann@example.com"}],
            "user": "end-user-1",
        },
        stream=False,
        api_key_hash=hash_api_key(SECRET, "sk-very-secret-key"),
        redactor=Redactor([r"[\w.+-]+@[\w-]+\.[\w.]+"]),
        status=200,
        latency_ms=12.34567,
    )
    fields.update(overrides)
    return Exchange(**fields)


NON_STREAM_BODY = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "support@v2",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hello ann@example.com"},
            "finish_reason": "stop",
        }
    ],
    "usage": USAGE,
}


def test_to_record_non_stream() -> None:
    ex = exchange(response_body=orjson.dumps(NON_STREAM_BODY))
    request_before = copy.deepcopy(ex.request)
    record = ex.to_record()
    assert isinstance(record, TrafficRecord)
    assert record.request_id == "req-42"
    assert record.endpoint == "chat.completions"
    assert record.alias == "support"
    assert record.request_model == "support"
    assert record.response_model == "support@v2"
    assert record.version == 2
    assert record.canary_arm == "canary"
    assert record.response_id == "chatcmpl-1"
    assert record.input_tokens == 11
    assert record.output_tokens == 5
    assert record.finish_reasons == ["stop"]
    assert record.stream is False
    assert record.status == 200
    assert record.error is None
    assert record.latency_ms == pytest.approx(12.346)
    assert record.user == "end-user-1"
    # Redaction on both the request and the answer; the original request is untouched.
    assert record.request["messages"][0]["content"] == f"I am {REDACTED}"
    assert record.choices[0]["message"]["content"] == f"hello {REDACTED}"
    assert ex.request == request_before


def test_to_record_stream() -> None:
    events = [
        chat_chunk(0, {"role": "assistant", "content": ""}),
        chat_chunk(0, {"content": "hi "}),
        chat_chunk(0, {"content": "ann@example.com"}, finish="stop"),
        USAGE_CHUNK,
    ]
    ex = exchange(stream=True, response_chunks=split_every(sse(events), 9), ttft_ms=4.56789)
    record = ex.to_record()
    assert record.stream is True
    assert record.response_id == "chatcmpl-7"
    assert record.choices == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": f"hi {REDACTED}"},
            "finish_reason": "stop",
        }
    ]
    assert record.finish_reasons == ["stop"]
    assert (record.input_tokens, record.output_tokens) == (11, 5)
    assert record.ttft_ms == pytest.approx(4.568)


def test_to_record_completions_stream() -> None:
    events = [cmpl_chunk(0, "a"), cmpl_chunk(0, "b", finish="length")]
    ex = exchange(
        endpoint="completions",
        request={"model": "support", "prompt": "x"},
        stream=True,
        response_chunks=[sse(events)],
    )
    record = ex.to_record()
    assert record.endpoint == "completions"
    assert record.choices[0]["text"] == "ab"
    assert record.finish_reasons == ["length"]
    assert record.input_tokens is None and record.user is None


@pytest.mark.parametrize("stream", [False, True])
def test_to_record_error_status(stream: bool) -> None:
    error = {
        "message": "the model server is unavailable; retry shortly",
        "type": "server_error",
        "param": None,
        "code": "upstream_unavailable",
    }
    ex = exchange(
        status=503,
        stream=stream,
        error=error,
        # Whatever bytes were captured are not parsed as an answer for a failed exchange.
        response_body=b"not json",
        response_chunks=[b"data: garbage"],
    )
    record = ex.to_record()
    assert record.status == 503
    assert record.error == error
    assert record.choices == []
    assert record.finish_reasons == []
    assert record.response_id is None
    assert record.input_tokens is None and record.output_tokens is None


def test_record_has_key_hash_not_key() -> None:
    ex = exchange(response_body=orjson.dumps(NON_STREAM_BODY))
    value = ex.to_record().to_json()
    assert b"sk-very-secret-key" not in value
    assert orjson.loads(value)["api_key_hash"] == hash_api_key(SECRET, "sk-very-secret-key")
    back = decode(TRAFFIC_TOPIC, value)
    assert isinstance(back, TrafficRecord)
    assert back.api_key_hash == hash_api_key(SECRET, "sk-very-secret-key")
    assert back.choices[0]["message"]["content"] == f"hello {REDACTED}"


def test_non_string_user_is_dropped() -> None:
    record = exchange(request={"model": "support", "messages": [], "user": 5}).to_record()
    assert record.user is None


def test_usage_of_a_sampled_out_stream_with_pretty_json() -> None:
    """Token counts of an exchange log_rate left out, read from spaced JSON (``"usage": {``)."""
    events = [chat_chunk(0, {"content": "hi"}, finish="stop"), USAGE_CHUNK]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    assert b'"usage": {' in raw
    ex = exchange(stream=True, logged=False, response_chunks=split_every(raw, 7))
    assert ex.usage() == (11, 5)
    assert exchange(response_body=orjson.dumps(NON_STREAM_BODY)).usage() == (11, 5)
    no_usage = [sse([chat_chunk(0, {"content": "x"})])]
    assert exchange(stream=True, response_chunks=no_usage).usage() == (None, None)

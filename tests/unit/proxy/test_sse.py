"""proxy/sse.py: reading SSE streams by their data: JSON, whatever its spacing."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.sse import is_usage_only, iter_sse_data, last_usage, without_usage_only


def sse(events: list[dict[str, Any]], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


# ---- iter_sse_data ------------------------------------------------------------------------------


EVENTS = [
    {"id": "x", "choices": [{"index": 0, "delta": {"content": "héllo\nworld"}}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"content": " data: not a field"}}]},
    {"id": "x", "choices": [], "usage": USAGE},
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13, 64, 10_000])
def test_iter_sse_data_reassembles_split_chunks(size: int) -> None:
    assert iter_sse_data(split_every(sse(EVENTS), size)) == EVENTS


def test_iter_sse_data_split_inside_multibyte_char_and_separator() -> None:
    raw = sse(EVENTS)
    cut_utf8 = raw.index("é".encode()) + 1  # between the two bytes of é
    cut_sep = raw.index(b"\n\n") + 1  # between the two newlines ending an event
    cut_prefix = raw.index(b"data:", 10) + 2  # inside the "data:" of the second event
    cuts = sorted({cut_utf8, cut_sep, cut_prefix})
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert b"".join(chunks) == raw
    assert iter_sse_data(chunks) == EVENTS


def test_iter_sse_data_ignores_done_comments_and_other_fields() -> None:
    raw = (
        b": keep-alive\n\n"
        b'event: message\ndata: {"a": 1}\n\n'
        b'data:{"b": 2}\n\n'  # no space after the colon
        b"data: \n\n"
        b"data: [DONE]\n\n"
    )
    assert iter_sse_data([raw]) == [{"a": 1}, {"b": 2}]


def test_iter_sse_data_crlf() -> None:
    raw = b'data: {"a": 1}\r\n\r\ndata: {"b": 2}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert iter_sse_data(split_every(raw, 3)) == [{"a": 1}, {"b": 2}]


def test_iter_sse_data_torn_last_event_skipped() -> None:
    raw = sse(EVENTS[:1], done=False) + b'data: {"id": "x", "cho'
    assert iter_sse_data([raw]) == EVENTS[:1]


def test_iter_sse_data_empty() -> None:
    assert iter_sse_data([]) == []
    assert iter_sse_data([b""]) == []


# ---- the usage event, compact or spaced ---------------------------------------------------------


def content(text: str) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE_EVENT = {"id": "x", "choices": [], "usage": USAGE}


def pretty(event: dict[str, Any]) -> bytes:
    """One event as other servers write it: ``json.dumps`` spacing, ``"usage": {...}``."""
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def test_pretty_usage_event_is_spaced() -> None:
    raw = pretty(USAGE_EVENT)
    assert b'"usage": {' in raw and b'"choices": []' in raw
    assert b'"usage":{' not in raw and b'"choices":[]' not in raw


@pytest.mark.parametrize("encode", [pretty, lambda e: sse([e], done=False)])
def test_usage_only_event_found_however_spaced(encode: Any) -> None:
    assert is_usage_only(encode(USAGE_EVENT))
    assert not is_usage_only(encode(content("hi")))
    # continuous_usage_stats: usage on a content event, which must reach the client.
    assert not is_usage_only(encode({**content("hi"), "usage": USAGE}))
    assert not is_usage_only(b"data: [DONE]\n\n")
    assert not is_usage_only(b"data: usage\n\n")  # not JSON


@pytest.mark.parametrize("encode", [pretty, lambda e: sse([e], done=False)])
def test_without_usage_only_leaves_out_just_the_usage_event(encode: Any) -> None:
    kept = encode(content("the usage of words")) + encode(content("!"))
    block = kept + encode(USAGE_EVENT) + b"data: [DONE]\n\n"
    assert without_usage_only(block) == kept + b"data: [DONE]\n\n"
    assert without_usage_only(kept) == kept


def test_last_usage_from_pretty_json_split_anywhere() -> None:
    raw = pretty(content("a")) + pretty(content("b")) + pretty(USAGE_EVENT) + b"data: [DONE]\n\n"
    assert last_usage(raw) == USAGE
    assert last_usage(b"".join(split_every(raw, 5))) == USAGE


def test_last_usage_takes_the_last_and_ignores_nulls() -> None:
    first = {**USAGE, "completion_tokens": 1}
    raw = sse([{**content("a"), "usage": first}, {**content("b"), "usage": None}, USAGE_EVENT])
    assert last_usage(raw) == USAGE
    assert last_usage(sse([{**content("a"), "usage": first}, content("b")])) == first
    assert last_usage(sse([content("a")])) is None
    assert last_usage(b"") is None

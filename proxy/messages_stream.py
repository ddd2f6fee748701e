"""The Messages API's stream (``POST /v1/messages`` with ``stream``): vLLM's chat stream as
Anthropic's event sequence. Pure, like proxy/messages_api.py, whose block and Message shapes it
emits.

The sequence: ``message_start`` (a Message with no content yet), then each content block in turn
(``content_block_start``, its ``content_block_delta`` events: ``text_delta`` or
``input_json_delta``, ``content_block_stop``: a block is closed before the next opens), then
``message_delta`` (stop_reason, stop_sequence, usage) and ``message_stop``. An error vLLM or the
relay reports mid-stream becomes an ``error`` event, the last.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.errors import anthropic_error_type
from proxy.messages_api import message_id_of, stop_of, usage_of
from proxy.sse import complete_events

TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
TEXT_FIELD = b',"delta":{"type":"text_delta","text":'


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


@dataclass(slots=True)
class MessagesStream:
    """vLLM's chat stream (SSE bytes, in any cuts) as Messages events. ``stop_reason`` is the
    Message's once the stream ended (None until then, or after an error)."""

    stop_reason: str | None = None
    ended: bool = False
    _pending: bytes = b""
    _started: bool = False
    _index: int = -1  # the open block's index; -1: none open yet
    _open: str | None = None  # "text", or the vLLM tool call index the open block streams
    _choice: dict[str, Any] = field(default_factory=dict)  # the finish of choice 0
    _called: bool = False
    _usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> bytes:
        payloads, self._pending = complete_events(self._pending, data)
        out: list[bytes] = []
        for payload in payloads:
            if not self.ended:
                out.extend(self._on_data(payload))
        return b"".join(out)

    def _on_data(self, data: bytes) -> Iterator[bytes]:
        if data == b"[DONE]":
            yield from self._close()
            return
        chunk = orjson.loads(data)
        if "error" in chunk and "choices" not in chunk:
            yield from self._fail(chunk["error"])
            return
        if not self._started:
            self._started = True
            yield self._message_start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                yield from self._on_choice(choice)

    def _message_start(self, chunk: dict[str, Any]) -> bytes:
        message: dict[str, Any] = {
            "id": message_id_of(str(chunk.get("id", ""))),
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(None),
        }
        return event("message_start", {"message": message})

    def _on_choice(self, choice: dict[str, Any]) -> Iterator[bytes]:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            yield from self._open_block("text", {"type": "text", "text": ""})
            # The most frequent event, written from a template rather than a dict dumped.
            yield b"".join(
                (TEXT_DELTA, str(self._index).encode(), TEXT_FIELD, orjson.dumps(text), b"}}\n\n")
            )
        for call in delta.get("tool_calls") or []:
            yield from self._on_tool_call(call)
        if choice.get("finish_reason") is not None:
            self._choice = choice

    def _on_tool_call(self, call: dict[str, Any]) -> Iterator[bytes]:
        function = call.get("function") or {}
        key = f"call{call.get('index', 0)}"
        if key != self._open:
            self._called = True
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": {},
            }
            yield from self._open_block(key, block)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": arguments})

    def _open_block(self, key: str, block: dict[str, Any]) -> Iterator[bytes]:
        if self._open == key:
            return
        yield from self._close_block()
        self._index += 1
        self._open = key
        yield event("content_block_start", {"index": self._index, "content_block": block})

    def _close_block(self) -> Iterator[bytes]:
        if self._open is not None:
            self._open = None
            yield event("content_block_stop", {"index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> Iterator[bytes]:
        self.ended = True
        yield from self._close_block()
        stop_reason, stop_sequence = stop_of(self._choice, self._called)
        self.stop_reason = stop_reason
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield event("message_delta", {"delta": delta, "usage": usage_of(self._usage)})
        yield event("message_stop", {})

    def _fail(self, error: dict[str, Any]) -> Iterator[bytes]:
        self.ended = True
        code = error.get("code")
        status = int(code) if isinstance(code, int) else 500
        kind = anthropic_error_type(status, str(error.get("type") or ""))
        body = {"type": kind, "message": str(error.get("message") or "the stream broke off")}
        yield event("error", {"error": body})

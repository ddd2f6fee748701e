"""The Responses API's stream (``POST /v1/responses`` with ``stream``): vLLM's chat stream as the
Responses event sequence. Pure, like proxy/responses_api.py, whose item and Response shapes it
emits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.responses_api import (
    RESPONSE_PREFIX,
    function_call_item,
    message_item,
    response_id_of,
    response_object,
    text_part,
)


@dataclass(slots=True)
class _ToolCall:
    output_index: int
    call_id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ResponsesStream:
    """vLLM's chat stream (SSE bytes, in any cuts) as the Responses event sequence: created, in
    progress, per output item its added / delta / done events, then completed (or incomplete,
    or failed after an error event), each with a ``sequence_number``. ``final`` is the whole
    Response once the stream ended."""

    echo: dict[str, Any]
    final: dict[str, Any] | None = None
    _pending: bytes = b""
    _sequence: int = 0
    _head: dict[str, Any] | None = None
    _text: str | None = None  # the open message item's text
    _text_index: int = -1
    _calls: dict[int, _ToolCall] = field(default_factory=dict)
    _items: int = 0
    _finish: str | None = None
    _usage: dict[str, Any] | None = None
    _parts: list[dict[str, Any]] = field(default_factory=list)  # closed items, in order

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out: list[bytes] = []
        while (cut := self._pending.find(b"\n\n")) >= 0:
            event, self._pending = self._pending[:cut], self._pending[cut + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.extend(self._on_data(line[5:].strip()))
        return b"".join(out)

    def _on_data(self, data: bytes) -> Iterator[bytes]:
        if data == b"[DONE]":
            yield from self._close()
            return
        chunk = orjson.loads(data)
        if "error" in chunk and "choices" not in chunk:
            yield from self._fail(chunk["error"])
            return
        if self._head is None:
            self._head = chunk
            yield from self._started()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield from self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._tool_delta(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    @property
    def _id(self) -> str:
        return response_id_of(str((self._head or {}).get("id", "")))

    def _snapshot(self, status: str) -> dict[str, Any]:
        head = self._head or {}
        answer = {"id": head.get("id", ""), "created": head.get("created", 0)}
        response = response_object(
            {**answer, "model": head.get("model"), "usage": self._usage}, self.echo, status=status
        )
        response["output"] = list(self._parts)
        return response

    def _started(self) -> Iterator[bytes]:
        snapshot = self._snapshot("in_progress")
        snapshot["usage"] = None
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)

    def _text_delta(self, delta: str) -> Iterator[bytes]:
        if self._text is None:
            self._text, self._text_index = "", self._items
            self._items += 1
            item = message_item(self._message_id, "", "in_progress")
            yield self._event(
                "response.output_item.added", output_index=self._text_index, item=item
            )
            yield self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=self._text_index,
                content_index=0,
                part=text_part(""),
            )
        self._text += delta
        yield self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=self._text_index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    @property
    def _message_id(self) -> str:
        return "msg_" + self._id.removeprefix(RESPONSE_PREFIX)

    def _tool_delta(self, delta: dict[str, Any]) -> Iterator[bytes]:
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        call = self._calls.get(index)
        if call is None:
            call = _ToolCall(self._items, delta.get("id") or "", function.get("name") or "")
            self._items += 1
            self._calls[index] = call
            item = function_call_item(call.call_id, call.name, "", "in_progress")
            yield self._event(
                "response.output_item.added", output_index=call.output_index, item=item
            )
        if function.get("arguments"):
            call.arguments += function["arguments"]
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=f"fc_{call.call_id}",
                output_index=call.output_index,
                delta=function["arguments"],
            )

    def _close(self) -> Iterator[bytes]:
        """The done events of every open item, in output order, then the final Response."""
        items: list[tuple[int, dict[str, Any]]] = []
        if self._text is not None:
            items.append(
                (self._text_index, message_item(self._message_id, self._text, "completed"))
            )
        for call in self._calls.values():
            item = function_call_item(call.call_id, call.name, call.arguments)
            items.append((call.output_index, item))
        items.sort(key=lambda pair: pair[0])
        for at, item in items:
            if item["type"] == "message":
                yield from self._message_done(at, item)
            else:
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            yield self._event("response.output_item.done", output_index=at, item=item)
        self._parts = [item for _, item in items]
        incomplete = self._finish == "length"
        self.final = self._snapshot("incomplete" if incomplete else "completed")
        if incomplete:
            self.final["incomplete_details"] = {"reason": "max_output_tokens"}
        kind = "response.incomplete" if incomplete else "response.completed"
        yield self._event(kind, response=self.final)

    def _message_done(self, at: int, item: dict[str, Any]) -> Iterator[bytes]:
        text = item["content"][0]["text"]
        where = {"item_id": item["id"], "output_index": at, "content_index": 0}
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=text_part(text))

    def _fail(self, error: dict[str, Any]) -> Iterator[bytes]:
        if self._head is None:
            self._head = {}
            yield from self._started()
        yield self._event(
            "error", code=error.get("code"), message=error.get("message", ""), param=None
        )
        failed = self._snapshot("failed")
        # A Response's error code is one of OpenAI's fixed few: ours is in the error event.
        failed["error"] = {"code": "server_error", "message": error.get("message", "")}
        self.final = failed
        yield self._event("response.failed", response=failed)

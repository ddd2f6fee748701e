"""The Responses API's stream (``POST /v1/responses`` with ``stream``): vLLM's chat stream as the
Responses event sequence. Pure, like proxy/responses_api.py, whose item and Response shapes it
emits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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
from proxy.sse import complete_events


@dataclass(slots=True)
class _Item:
    """The output item being streamed: a message's text, or a function call's arguments."""

    output_index: int
    item_id: str
    text: str = ""  # a message's text, or a call's arguments
    call_id: str | None = None  # None: a message
    name: str = ""


@dataclass(slots=True)
class ResponsesStream:
    """vLLM's chat stream (SSE bytes, in any cuts) as the Responses event sequence: created, in
    progress, then each output item in turn (added, its deltas, done: an item is closed before
    the next one opens), then completed (or incomplete, or failed after an error event), each
    event with its ``sequence_number``. ``final`` is the whole Response once the stream ended;
    its event waits for :meth:`closing_event`, which says whether the store kept it. ``clock``
    gives its ``completed_at``."""

    echo: dict[str, Any]
    clock: Callable[[], float] = time.time
    final: dict[str, Any] | None = None
    _pending: bytes = b""
    _sequence: int = 0
    _head: dict[str, Any] | None = None
    _open: _Item | None = None
    _calls: dict[int, str] = field(default_factory=dict)  # vLLM's tool call index: its call id
    _finish: str | None = None
    _usage: dict[str, Any] | None = None
    _done: list[dict[str, Any]] = field(default_factory=list)  # closed items, in order
    _closing: str | None = None  # the final event's kind, until closing_event sends it

    def feed(self, data: bytes) -> bytes:
        payloads, self._pending = complete_events(self._pending, data)
        return b"".join(event for payload in payloads for event in self._on_data(payload))

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
    def _suffix(self) -> str:
        return response_id_of(str((self._head or {}).get("id", ""))).removeprefix(RESPONSE_PREFIX)

    def _snapshot(self, status: str) -> dict[str, Any]:
        head = self._head or {}
        answer = {"id": head.get("id", ""), "created": head.get("created", 0)}
        response = response_object(
            {**answer, "model": head.get("model"), "usage": self._usage},
            self.echo,
            status=status,
            completed_at=int(self.clock()),
        )
        response["output"] = list(self._done)
        return response

    def _started(self) -> Iterator[bytes]:
        snapshot = self._snapshot("in_progress")
        snapshot["usage"] = None
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)

    def _text_delta(self, delta: str) -> Iterator[bytes]:
        if self._open is None or self._open.call_id is not None:
            yield from self._close_item()
            # The first message item's id is msg_<id> as in a whole Response; text after a
            # tool call (rare) is a message item of its own.
            texts = sum(item["type"] == "message" for item in self._done)
            item_id = f"msg_{self._suffix}" + (f"_{texts}" if texts else "")
            self._open = _Item(len(self._done), item_id)
            at = self._open.output_index
            item = message_item(item_id, "", "in_progress")
            yield self._event("response.output_item.added", output_index=at, item=item)
            where: dict[str, Any] = {"item_id": item_id, "output_index": at, "content_index": 0}
            yield self._event("response.content_part.added", **where, part=text_part(""))
        self._open.text += delta
        yield self._event(
            "response.output_text.delta",
            item_id=self._open.item_id,
            output_index=self._open.output_index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _tool_delta(self, delta: dict[str, Any]) -> Iterator[bytes]:
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        if index not in self._calls:
            yield from self._close_item()
            call_id, name = delta.get("id") or "", function.get("name") or ""
            self._calls[index] = call_id
            self._open = _Item(len(self._done), f"fc_{call_id}", call_id=call_id, name=name)
            item = function_call_item(call_id, name, "", "in_progress")
            yield self._event(
                "response.output_item.added", output_index=self._open.output_index, item=item
            )
        call = self._open
        if call is None or call.call_id != self._calls[index]:
            return  # a delta for a call already closed: vLLM streams one call after another
        if function.get("arguments"):
            call.text += function["arguments"]
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=call.item_id,
                output_index=call.output_index,
                delta=function["arguments"],
            )

    def _close_item(self) -> Iterator[bytes]:
        """The done events of the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.call_id is None:
            done = message_item(item.item_id, item.text, "completed")
            at = where | {"content_index": 0}
            yield self._event("response.output_text.done", **at, text=item.text, logprobs=[])
            yield self._event("response.content_part.done", **at, part=text_part(item.text))
        else:
            done = function_call_item(item.call_id, item.name, item.text)
            yield self._event(
                "response.function_call_arguments.done",
                **where,
                name=item.name,
                arguments=item.text,
            )
        self._done.append(done)
        yield self._event("response.output_item.done", output_index=item.output_index, item=done)

    def _close(self) -> Iterator[bytes]:
        """The open item's done events, then the final Response."""
        yield from self._close_item()
        incomplete = self._finish == "length"
        self.final = self._snapshot("incomplete" if incomplete else "completed")
        if incomplete:
            self.final["incomplete_details"] = {"reason": "max_output_tokens"}
        self._closing = "response.incomplete" if incomplete else "response.completed"

    def closing_event(self, stored: bool | None = None) -> bytes:
        """The final event, once its Response is complete; ``stored`` False (the store's quotas
        refused it) makes it say ``store: false``, as the whole answer does. Empty before the
        end, and after the event was sent."""
        if self._closing is None or self.final is None:
            return b""
        if stored is False:
            self.final["store"] = False
        kind, self._closing = self._closing, None
        return self._event(kind, response=self.final)

    def _fail(self, error: dict[str, Any]) -> Iterator[bytes]:
        if self._head is None:
            self._head = {}
            yield from self._started()
        code, message = error.get("code"), error.get("message", "")
        yield self._event(
            "error",
            # OpenAI's event carries the error's fields flat, the specification's nested.
            code=code,
            message=message,
            param=None,
            error={"type": "server_error", "code": code, "message": message, "param": None},
        )
        failed = self._snapshot("failed")
        # A Response's error code is one of OpenAI's fixed few: ours is in the error event.
        failed["error"] = {"code": "server_error", "message": message}
        self.final = failed
        yield self._event("response.failed", response=failed)

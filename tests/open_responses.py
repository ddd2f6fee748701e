"""What the proxy sends on the Responses API, checked against the Open Responses specification's
own published types (the ``openresponses-types`` package, generated from the specification's
OpenAPI document): strict validation of the JSON as sent, so a required field that is missing, a
null where the specification wants a value, or a streamed event it does not define fails."""

from __future__ import annotations

from typing import Any

import orjson
from openresponses_types import types as spec
from pydantic import BaseModel

EVENT_TYPES: dict[str, type[BaseModel]] = {
    "response.created": spec.ResponseCreatedStreamingEvent,
    "response.in_progress": spec.ResponseInProgressStreamingEvent,
    "response.completed": spec.ResponseCompletedStreamingEvent,
    "response.incomplete": spec.ResponseIncompleteStreamingEvent,
    "response.failed": spec.ResponseFailedStreamingEvent,
    "response.output_item.added": spec.ResponseOutputItemAddedStreamingEvent,
    "response.output_item.done": spec.ResponseOutputItemDoneStreamingEvent,
    "response.content_part.added": spec.ResponseContentPartAddedStreamingEvent,
    "response.content_part.done": spec.ResponseContentPartDoneStreamingEvent,
    "response.output_text.delta": spec.ResponseOutputTextDeltaStreamingEvent,
    "response.output_text.done": spec.ResponseOutputTextDoneStreamingEvent,
    "response.function_call_arguments.delta": spec.ResponseFunctionCallArgumentsDeltaStreamingEvent,
    "response.function_call_arguments.done": spec.ResponseFunctionCallArgumentsDoneStreamingEvent,
    "error": spec.ErrorStreamingEvent,
}
# What an input item may be (the specification's ItemField, less the kinds never made here).
ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": spec.Message,
    "function_call": spec.FunctionCall,
    "function_call_output": spec.FunctionCallOutput,
}


def conforming_response(body: bytes | dict[str, Any]) -> spec.ResponseResource:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return spec.ResponseResource.model_validate_json(raw, strict=True)


def conforming_events(stream: bytes) -> list[dict[str, Any]]:
    """Every event of an SSE body, each valid as the specification's type for its ``type``
    (which its ``event:`` line repeats), numbered 0, 1, 2, ... Returns them as sent."""
    events = []
    for block in stream.split(b"\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        event = orjson.loads(lines[b"data"])
        assert lines[b"event"].decode() == event["type"], block
        assert event["type"] in EVENT_TYPES, f"not an event of the specification: {event}"
        EVENT_TYPES[event["type"]].model_validate_json(lines[b"data"], strict=True)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def conforming_item(item: dict[str, Any]) -> BaseModel:
    return ITEM_TYPES[item["type"]].model_validate_json(orjson.dumps(item), strict=True)


def check_sequence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The specification's order: created, in_progress; then each output item in turn (added,
    its content part added, deltas, text or arguments done, part done, item done), its events
    naming the same ``item_id`` and ``output_index``; then the terminal event, whose Response's
    output is the items as done. Returns that Response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete", "response.failed"), kinds
    done: list[dict[str, Any]] = []
    body = events[2:-1]
    while body and body[0]["type"] == "response.output_item.added":
        at = len(done)
        added = body[0]
        assert added["output_index"] == at, added
        ends = [i for i, e in enumerate(body) if e["type"] == "response.output_item.done"]
        if not ends and kinds[-1] == "response.failed":
            break  # an item cut off by the failure is never done
        end = ends[0]
        finished = body[end]["item"]
        item_events, body = body[1:end], body[end + 1 :]
        assert finished["id"] == added["item"]["id"] and finished["type"] == added["item"]["type"]
        for event in item_events:
            assert event["output_index"] == at and event["item_id"] == finished["id"], event
        _check_item_events(finished, [e["type"] for e in item_events], item_events)
        done.append(finished)
    assert kinds[-2] == "error" if kinds[-1] == "response.failed" else not body, kinds
    final: dict[str, Any] = events[-1]["response"]
    if final["status"] != "failed":
        assert final["output"] == done
    return final


def _check_item_events(
    item: dict[str, Any], kinds: list[str], events: list[dict[str, Any]]
) -> None:
    if item["type"] == "message":
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert kinds[0] == "response.content_part.added", kinds
        assert kinds[-2:] == ["response.output_text.done", "response.content_part.done"], kinds
        assert set(kinds[1:-2]) <= {"response.output_text.delta"}, kinds
        assert all(e["content_index"] == 0 for e in events)
        assert events[-2]["text"] == events[-1]["part"]["text"] == text
        assert item["content"] == [events[-1]["part"]]
    else:
        delta = "response.function_call_arguments.delta"
        arguments = "".join(e["delta"] for e in events if e["type"] == delta)
        assert kinds[-1] == "response.function_call_arguments.done", kinds
        assert set(kinds[:-1]) <= {delta}, kinds
        assert events[-1]["arguments"] == item["arguments"] == arguments

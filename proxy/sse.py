"""Server-sent events as vLLM streams them: one JSON object per ``data:`` line, ``[DONE]`` last.

Shared by the relay (which leaves out the usage-only event a client did not ask for) and the log
worker (which reads token counts and assembles streamed answers). Events are found by parsing
their ``data:`` JSON, never by matching bytes, so any spacing of the JSON is understood.
"""

from __future__ import annotations

from typing import Any

import orjson


def data_payload(line: bytes) -> bytes | None:
    """The payload of a ``data:`` line; None for other lines, empty data and ``[DONE]``."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()  # also drops the \r of CRLF line ends
    return payload if payload and payload != b"[DONE]" else None


def complete_events(pending: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the events ``pending + data`` completes (each stripped,
    ``[DONE]`` included), and what is left pending: an event ends at a blank line, and a stream
    comes in any cuts."""
    *events, pending = (pending + data).split(b"\n\n")
    payloads = [
        line[5:].strip()
        for event in events
        for line in event.split(b"\n")
        if line.startswith(b"data:")
    ]
    return payloads, pending


def _data_json(line: bytes) -> Any:
    """The JSON of a ``data:`` line, or None when the line has none that parses."""
    payload = data_payload(line)
    if payload is None:
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def iter_sse_data(chunks: list[bytes]) -> list[Any]:
    """The JSON payloads of an SSE byte stream, in order; torn or non-JSON payloads are skipped."""
    events = []
    for line in b"".join(chunks).split(b"\n"):
        payload = data_payload(line)
        if payload is None:
            continue
        try:
            events.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
    return events


def is_usage_only(event: bytes) -> bool:
    """True for the event ``stream_options.include_usage`` adds: a usage object and no choices.

    Choices are checked too: with ``continuous_usage_stats`` every content event carries usage.
    """
    for line in event.split(b"\n"):
        data = _data_json(line)
        if data is not None:
            return (
                isinstance(data, dict)
                and isinstance(data.get("usage"), dict)
                and not data.get("choices")
            )
    return False


def without_usage_only(events: bytes) -> bytes:
    """Whole events (``\\n\\n``-separated) minus the usage-only ones."""
    # Any JSON spells the key out, however it is spaced: only events that hold it are parsed.
    if b"usage" not in events:
        return events
    kept = (e for e in events.split(b"\n\n") if b"usage" not in e or not is_usage_only(e))
    return b"\n\n".join(kept)


def last_usage(stream: bytes) -> dict[str, Any] | None:
    """The usage object of the last event that has one, looked for from the stream's end (the
    usage event is the last before ``[DONE]``, so a whole stream is rarely parsed)."""
    for line in reversed(stream.split(b"\n")):
        if b"usage" not in line:
            continue
        data = _data_json(line)
        usage = data.get("usage") if isinstance(data, dict) else None
        if usage and isinstance(usage, dict):
            return usage
    return None

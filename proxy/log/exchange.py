"""Turning one proxied exchange into a TrafficRecord, in the log worker process.

The request handler only passes on raw bytes and timings (proxy/log/pipe.py); the log worker
(proxy/log/worker.py) rebuilds an :class:`Exchange` from them and calls
:meth:`Exchange.to_record`, which parses the upstream answer (assembling streamed chunks into
whole choices), applies redaction, and makes the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.answer_ids import redacted_answer_id
from proxy.log.redaction import REDACTED, Redaction, Redactor
from proxy.sse import iter_sse_data, last_usage
from ratchet.records import CLIENT_REQUEST_ID_MAX, TrafficRecord

# Where the redactor lived first: the Responses store and the tests import it from here too.
__all__ = ["REDACTED", "Exchange", "Redactor", "assemble_stream", "bounded"]


def _merge_tool_calls(target: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for delta in deltas:
        index = delta.get("index", len(target))
        while len(target) <= index:
            target.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        call = target[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]


# Completions stream logprobs as parallel lists; chat streams them under "content".
_COMPLETION_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _merge_logprobs(choice: dict[str, Any], logprobs: dict[str, Any], endpoint: str) -> None:
    keys = _COMPLETION_LOGPROB_LISTS if endpoint == "completions" else ("content",)
    merged = choice.setdefault("logprobs", {key: [] for key in keys})
    for key in keys:
        merged[key].extend(logprobs.get(key) or [])


def assemble_stream(events: list[dict[str, Any]], endpoint: str) -> dict[str, Any]:
    """Fold streamed chunks into the body a non-streamed call would have returned."""
    choices: dict[int, dict[str, Any]] = {}
    body: dict[str, Any] = {"choices": []}
    for event in events:
        body.setdefault("id", event.get("id"))
        if event.get("usage"):
            body["usage"] = event["usage"]
        for delta_choice in event.get("choices") or []:
            index = delta_choice.get("index", 0)
            choice = choices.setdefault(index, _empty_choice(index, endpoint))
            if delta_choice.get("finish_reason") is not None:
                choice["finish_reason"] = delta_choice["finish_reason"]
            if endpoint == "completions":
                choice["text"] += delta_choice.get("text") or ""
            else:
                delta = delta_choice.get("delta") or {}
                message = choice["message"]
                if delta.get("role"):
                    message["role"] = delta["role"]
                if delta.get("content"):
                    message["content"] = (message["content"] or "") + delta["content"]
                if delta.get("reasoning_content"):
                    message["reasoning_content"] = (message.get("reasoning_content") or "") + delta[
                        "reasoning_content"
                    ]
                if delta.get("tool_calls"):
                    _merge_tool_calls(message.setdefault("tool_calls", []), delta["tool_calls"])
            logprobs = delta_choice.get("logprobs")
            if logprobs:
                _merge_logprobs(choice, logprobs, endpoint)
    body["choices"] = [choices[i] for i in sorted(choices)]
    return body


def _empty_choice(index: int, endpoint: str) -> dict[str, Any]:
    if endpoint == "completions":
        return {"index": index, "text": "", "finish_reason": None}
    return {
        "index": index,
        "message": {"role": "assistant", "content": None},
        "finish_reason": None,
    }


@dataclass(slots=True)
class Exchange:
    """Everything the request path captured about one exchange, still unparsed."""

    request_id: str
    endpoint: str
    alias: str
    served_name: str
    version: int
    canary_arm: str
    request: dict[str, Any]
    stream: bool
    api_key_hash: str | None
    redactor: Redactor
    source: str | None = None
    # False when the alias's log_rate left this exchange out of ratchet.traffic.
    logged: bool = True
    status: int = 0
    response_body: bytes = b""
    response_chunks: list[bytes] = field(default_factory=list)
    error: dict[str, Any] | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    client_request_id: str | None = None
    client_api: str | None = None

    def usage(self) -> tuple[int | None, int | None]:
        """(input, output) tokens, read without assembling the whole answer."""
        usage: dict[str, Any] = {}
        if self.stream:
            usage = last_usage(b"".join(self.response_chunks)) or {}
        elif self.status == 200 and self.response_body:
            usage = orjson.loads(self.response_body).get("usage") or {}
        return usage.get("prompt_tokens"), usage.get("completion_tokens")

    def to_record(self) -> TrafficRecord:
        body: dict[str, Any] = {}
        if self.stream and self.response_chunks:
            # Also for a stream cut short: what the client did receive is kept with the error.
            body = assemble_stream(iter_sse_data(self.response_chunks), self.endpoint)
        elif self.status == 200 and self.response_body:
            body = orjson.loads(self.response_body)
        choices = body.get("choices") or []
        usage = body.get("usage") or {}
        user = self.request.get("user")
        # Every string a client or the model wrote: the request (keys too), `user`, the error
        # (upstream messages quote the prompt), the answers, and the identifiers a client
        # chooses: its x-request-id, and its part of the answer's id (proxy/answer_ids.py).
        redact = self.redactor.begin()
        request = redact.part("request", self.request)
        user = redact.part("request", user) if isinstance(user, str) else None
        error = redact.part("error", self.error)
        redacted_choices = redact.part("answer", choices)
        response_id = body.get("id")
        return TrafficRecord(
            request_id=self.request_id,
            client_request_id=_redacted_id(redact, self.client_request_id, CLIENT_REQUEST_ID_MAX),
            response_id=(
                redacted_answer_id(response_id, redact.string)
                if isinstance(response_id, str)
                else None
            ),
            endpoint=self.endpoint,
            alias=self.alias,
            request_model=self.alias,
            response_model=self.served_name,
            version=self.version,
            canary_arm=self.canary_arm,
            request=request,
            choices=redacted_choices,
            input_tokens=usage.get("prompt_tokens"),
            output_tokens=usage.get("completion_tokens"),
            finish_reasons=[c.get("finish_reason") for c in choices],
            stream=self.stream,
            status=self.status,
            error=error,
            latency_ms=round(self.latency_ms, 3),
            ttft_ms=None if self.ttft_ms is None else round(self.ttft_ms, 3),
            api_key_hash=self.api_key_hash,
            source=self.source,
            user=user,
            client_api=self.client_api,
            # Replaced whole past the redaction budget: not what the model saw.
            truncated=redact.failed,
        )


def _redacted_id(redact: Redaction, value: Any, max_chars: int | None = None) -> str | None:
    """An identifier as the record keeps it: redacted like the text (then cut to
    ``max_chars``: each match grows to REDACTED), a string or None."""
    return redact.string(value)[:max_chars] if isinstance(value, str) else None


# Strings shorter than this are never cut: cutting many short ones saves little and garbles all.
CUT_STRINGS_OVER = 256
CUT_MARK = "…[truncated]"


def bounded(record: TrafficRecord, max_bytes: int) -> bytes:
    """The record's JSON in at most ``max_bytes``, cut down in steps until it fits: first the
    answers' logprobs (n x top_logprobs is where most size comes from), then the long strings of
    the answers, then those of the request (each halved as often as it takes, up to
    HALVINGS times), then the request and answers whole. What was cut is listed in
    ``truncated``, with the whole record's size in ``original_bytes``.

    Linear in the record: how many halvings a step needs is worked out from its long strings'
    JSON lengths, so the record is walked and serialized a few times, not once a halving (130k
    tiny dicts took 3 s that way)."""
    value = record.to_json()
    if len(value) <= max_bytes:
        return value
    original = len(value)
    record = record.model_copy(
        update={"truncated": list(record.truncated), "original_bytes": original}
    )
    record.truncated.append("logprobs")
    if _drop_logprobs(record):
        value = record.to_json()
    for part in ("answer", "request"):
        if len(value) <= max_bytes:
            return value
        record.truncated.append(part)
        whole = record.choices if part == "answer" else record.request
        times = _halvings_to_save(whole, len(value) - max_bytes)
        if times == 0:
            continue  # no string long enough to cut: the record is as it was
        while True:  # once, unless the JSON lengths were not additive after all
            cut = _halve_long_strings(whole, times)
            if part == "answer":
                record.choices = cut
            else:
                record.request = cut
            value = record.to_json()
            if len(value) <= max_bytes or times >= HALVINGS:
                break
            times += 1
    if len(value) <= max_bytes:
        return value
    record.request, record.choices = {}, []
    record.truncated.append("all")
    return record.to_json()


def _drop_logprobs(record: TrafficRecord) -> bool:
    """Whether there were any to drop."""
    had = "prompt_logprobs" in record.request or any("logprobs" in c for c in record.choices)
    if had:
        record.choices = [{k: v for k, v in c.items() if k != "logprobs"} for c in record.choices]
        record.request = {k: v for k, v in record.request.items() if k != "prompt_logprobs"}
    return had


HALVINGS = 16  # the most times a step halves each long string


def _halved(text: str, times: int) -> str:
    """``text`` halved (and marked) ``times`` times, or until it is no longer long."""
    for _ in range(times):
        if len(text) <= CUT_STRINGS_OVER:
            break
        text = text[: len(text) // 2] + CUT_MARK
    return text


def _long_strings(value: Any) -> list[str]:
    """Every string value (not dict key) in ``value`` longer than CUT_STRINGS_OVER."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if len(item) > CUT_STRINGS_OVER:
                found.append(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def _halvings_to_save(value: Any, excess: int) -> int:
    """The fewest halvings of ``value``'s long strings that take ``excess`` bytes off its JSON
    (a string's JSON length is all that changes), HALVINGS if none does; 0: it has none."""
    saved = [0] * (HALVINGS + 1)
    strings = _long_strings(value)
    if not strings:
        return 0
    for text in strings:
        whole = len(orjson.dumps(text))
        cut = text
        for times in range(1, HALVINGS + 1):
            if len(cut) > CUT_STRINGS_OVER:
                cut = cut[: len(cut) // 2] + CUT_MARK
            saved[times] += whole - len(orjson.dumps(cut))
    return next((t for t in range(1, HALVINGS + 1) if saved[t] >= excess), HALVINGS)


def _halve_long_strings(value: Any, times: int = 1) -> Any:
    """``value`` with every string longer than CUT_STRINGS_OVER halved ``times`` times."""
    if isinstance(value, str):
        return _halved(value, times)
    if isinstance(value, list):
        return [_halve_long_strings(item, times) for item in value]
    if isinstance(value, dict):
        return {key: _halve_long_strings(item, times) for key, item in value.items()}
    return value

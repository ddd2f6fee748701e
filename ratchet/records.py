"""The record types of the Kafka topics: one class per topic, defined here and nowhere else.

Every value is JSON with ``"schema": "<name>/<int>"`` and ``"ts"`` (RFC 3339, UTC). Field names
follow the OpenTelemetry GenAI conventions where one exists; those are dotted
(``gen_ai.request.model``), so the Python attribute has a plain name and the dotted one is the
serialised alias. Consumers call :func:`decode` which skips unknown schemas with a counted warning.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ratchet.bill import Bill

log = logging.getLogger(__name__)

TRAFFIC_TOPIC = "ratchet.traffic"
FEEDBACK_TOPIC = "ratchet.feedback"
GROUPS_TOPIC = "ratchet.groups"
HELDOUT_TOPIC = "ratchet.heldout"
EVENTS_TOPIC = "ratchet.events"
DEADLETTER_TOPIC = "ratchet.deadletter"

# A dead letter keeps this much of the original value; value_bytes says how much there was.
DEADLETTER_VALUE_MAX = 64 * 1024

# The longest client x-request-id kept (as a correlation field only); the rest is cut off.
CLIENT_REQUEST_ID_MAX = 128


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def prompt_hash(messages: list[Any], tools: list[Any] | None = None) -> str:
    """Stable hash of a prompt (messages + tools), used for dedup and the held-out split."""
    blob = orjson.dumps({"messages": messages, "tools": tools or []}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()


class Record(BaseModel):
    """Base of every topic's value. Subclasses set SCHEMA and TOPIC."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    SCHEMA: ClassVar[str]
    TOPIC: ClassVar[str]

    schema_: str = Field(default="", alias="schema")
    ts: str = Field(default_factory=utc_now)

    def model_post_init(self, context: Any) -> None:
        if not self.schema_:
            self.schema_ = self.SCHEMA

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(by_alias=True, mode="json"))


ANONYMOUS_CLIENT = "-"  # every request of a stack without API keys is this one client
UNKNOWN_REPLICA = "unknown"  # the replica of a group logged before groups named theirs


def client_of(source: str | None, api_key_hash: str | None) -> str:
    """The client a record counts for in the per-client caps: its ``source`` (the key, or the
    key and the user it vouched for), else its key hash (records from before ``source``)."""
    return source or api_key_hash or ANONYMOUS_CLIENT


class TrafficRecord(Record):
    """One client exchange as the proxy saw it: request as sent, answer as received.

    ``request_id`` is made by the proxy for every request; group ids and sampling derive from it.
    The client's own ``x-request-id`` is only kept as ``client_request_id``, for correlation: a
    client that reuses another's id cannot make that one's group look like a duplicate.
    """

    SCHEMA = "traffic/1"
    TOPIC = TRAFFIC_TOPIC

    request_id: str
    client_request_id: str | None = Field(default=None, max_length=CLIENT_REQUEST_ID_MAX)
    endpoint: Literal["chat.completions", "completions"]
    # The API the client called, when the proxy translated it to ``endpoint``: a Responses
    # request (``POST /v1/responses``) or an Anthropic Messages request (``POST /v1/messages``)
    # is logged as the chat exchange vLLM served, so ``request`` and ``choices`` are chat-shaped
    # whichever API the client used.
    client_api: Literal["responses", "messages"] | None = None
    alias: str
    request_model: str = Field(alias="gen_ai.request.model")
    response_model: str = Field(alias="gen_ai.response.model")  # the served name
    version: int
    canary_arm: Literal["active", "canary"]
    request: dict[str, Any]  # the body as the client sent it (after redaction)
    response_id: str | None = None
    choices: list[dict[str, Any]] = []
    input_tokens: int | None = Field(default=None, alias="gen_ai.usage.input_tokens")
    output_tokens: int | None = Field(default=None, alias="gen_ai.usage.output_tokens")
    finish_reasons: list[str | None] = Field(default=[], alias="gen_ai.response.finish_reasons")
    stream: bool = False
    status: int
    error: dict[str, Any] | None = None
    latency_ms: float
    ttft_ms: float | None = None
    api_key_hash: str | None = None
    # The client for the per-client caps (ratchet.secrets.client_source); read it with .client.
    source: str | None = None
    user: str | None = None
    # Set when the record was cut to fit proxy.max_record_bytes: what was cut ("logprobs",
    # "answer", "request"), and the size of the whole record in bytes. A cut request is not
    # the prompt the model saw, so the judge does not learn from it.
    truncated: list[str] = []
    original_bytes: int | None = None

    @property
    def client(self) -> str:
        return client_of(self.source, self.api_key_hash)

    @property
    def request_cut(self) -> bool:
        """Whether the request was cut to fit: then it is not the prompt the model saw."""
        return bool({"request", "all"} & set(self.truncated))


class FeedbackRecord(Record):
    SCHEMA = "feedback/1"
    TOPIC = FEEDBACK_TOPIC

    completion_id: str
    score: float = Field(ge=0.0, le=1.0)
    thumbs: Literal["up", "down"] | None = None
    comment: str | None = None
    api_key_hash: str | None = None
    source: str | None = None  # as TrafficRecord's: who rated, for the per-client caps

    @property
    def client(self) -> str:
        return client_of(self.source, self.api_key_hash)


class Sample(BaseModel):
    """One answer in a group, with the exact tokens and behaviour logprobs that produced it."""

    message: dict[str, Any]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


def tool_calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    """Each tool call of an answer as (function name, arguments), as the model wrote them; ""
    where one is missing."""
    calls = message.get("tool_calls")
    out = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        out.append((str(function.get("name") or ""), str(function.get("arguments") or "")))
    return out


def answer_identity(message: dict[str, Any], *, fold_text: bool = False) -> bytes:
    """What makes two answers the same one: their text and their tool calls (each call's name
    and arguments as the model wrote them), so two calls with different arguments and empty
    text are two answers. ``fold_text``: the text without case and surrounding space, for
    answers that are the same but for those (the learner's collapse guard)."""
    text = message.get("content") or ""
    if fold_text:
        text = text.strip().lower()
    calls = [name + arguments for name, arguments in tool_calls_of(message)]
    return orjson.dumps([text, calls])


def answer_as_text(message: dict[str, Any]) -> str:
    """An answer as one text, for what reads answers as text (a reward model's features): its
    content, then each tool call on a line of its own as ``<tool_call>{"name": ..., "arguments":
    ...}</tool_call>``. An agent's answer is often a call with no text at all; read as its text
    alone, every such answer would look the same."""
    text = message.get("content")
    parts = [text] if isinstance(text, str) and text else []
    for name, arguments in tool_calls_of(message):
        named = orjson.dumps({"name": name, "arguments": arguments}).decode()
        parts.append(f"<tool_call>{named}</tool_call>")
    return "\n".join(parts)


class ScoredGroup(Record):
    SCHEMA = "scored_group/1"
    TOPIC = GROUPS_TOPIC

    group_id: str
    alias: str
    version: int
    response_model: str = Field(alias="gen_ai.response.model")
    prompt_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int]
    samples: list[Sample]
    rewards: list[float]
    explanations: list[str] = []
    judge_model: str | None = None
    rubric_hash: str | None = None
    traffic_request_id: str
    # The key of the client whose prompt it is (learning.max_key_share); None: no key (auth off).
    api_key_hash: str | None = None
    source: str | None = None  # the traffic record's: the client, for the per-client caps
    # What the group cost to make: its sampling request and judge calls (ratchet/bill.py).
    # None in groups from before the field.
    bill: Bill | None = None
    # The vLLM replica that sampled it (its URL, as the proxy's per-replica metrics name it),
    # for the served drift per replica (learner/drift.py). None in groups from before the field.
    replica: str | None = None

    @property
    def client(self) -> str:
        return client_of(self.source, self.api_key_hash)

    @property
    def served_by(self) -> str:
        """The replica that sampled it; ``UNKNOWN_REPLICA`` for a group from before the field."""
        return self.replica or UNKNOWN_REPLICA


class HeldoutPrompt(Record):
    SCHEMA = "heldout_prompt/1"
    TOPIC = HELDOUT_TOPIC

    prompt_hash: str
    alias: str
    prompt_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # How the client asked for the tools to be used ("required", a named function): the gate
    # answers the prompt as the client asked, as the judge samples it.
    tool_choice: str | dict[str, Any] | None = None
    traffic_request_id: str
    api_key_hash: str | None = None  # whose prompt it is, as for ScoredGroup
    source: str | None = None
    # The served answer's length in tokens (None: unknown, or a record from before this field),
    # so the gate can size its own max_tokens to the task's answers.
    served_output_tokens: int | None = None

    @property
    def client(self) -> str:
        return client_of(self.source, self.api_key_hash)


class LifecycleEvent(Record):
    SCHEMA = "lifecycle_event/1"
    TOPIC = EVENTS_TOPIC

    alias: str
    kind: Literal[
        "candidate", "gate", "promote", "reject", "canary", "rollback", "pause", "resume", "route"
    ]
    version: int | None = None
    previous_version: int | None = None
    actor: str = "ratchet"
    detail: dict[str, Any] = {}

    def key(self) -> bytes:
        return self.alias.encode()


class DeadLetter(Record):
    """A record a consumer could not handle: counted, kept here for a person, never retried.

    ``value`` is the original value as text, cut at DEADLETTER_VALUE_MAX bytes (``value_bytes``
    is its whole size); ``source_topic``, ``partition`` and ``offset`` point at the original.
    """

    SCHEMA = "dead_letter/1"
    TOPIC = DEADLETTER_TOPIC

    source_topic: str
    partition: int | None = None
    offset: int | None = None
    consumer: str  # the consumer group that gave up on it
    reason: str  # malformed, invalid (schema validation), handler_error (the consumer's own code)
    error: str = ""
    value: str
    value_bytes: int

    @classmethod
    def of(
        cls,
        topic: str,
        value: bytes,
        consumer: str,
        reason: str,
        error: str = "",
        partition: int | None = None,
        offset: int | None = None,
    ) -> DeadLetter:
        return cls(
            source_topic=topic,
            partition=partition,
            offset=offset,
            consumer=consumer,
            reason=reason,
            error=error[:1000],
            value=value[:DEADLETTER_VALUE_MAX].decode(errors="replace"),
            value_bytes=len(value),
        )

    @classmethod
    def of_message(
        cls, message: SourceMessage, consumer: str, reason: str, error: str = ""
    ) -> DeadLetter:
        """The dead letter of a consumed message."""
        return cls.of(
            message.topic,
            message.value,
            consumer,
            reason,
            error,
            partition=message.partition,
            offset=message.offset,
        )

    def key(self) -> bytes:
        return f"{self.source_topic}:{self.partition}:{self.offset}".encode()


class SourceMessage(Protocol):
    """What a dead letter needs of a consumed message (kafka-python's ConsumerRecord has it)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def value(self) -> bytes: ...


RECORD_TYPES: dict[str, type[Record]] = {
    cls.TOPIC: cls
    for cls in (
        TrafficRecord,
        FeedbackRecord,
        ScoredGroup,
        HeldoutPrompt,
        LifecycleEvent,
        DeadLetter,
    )
}
ALL_TOPICS = tuple(RECORD_TYPES)

# Records skipped by decode(), by reason; exported as a metric by the services that consume.
skipped_records: Counter[str] = Counter()


def decode(topic: str, value: bytes) -> Record | None:
    """Parse a topic's value; None (and a counted warning) for unknown schemas or bad records."""
    record = parse(topic, value)
    return record if isinstance(record, Record) else None


def parse(topic: str, value: bytes) -> Record | str:
    """Parse a topic's value, or say why not: ``malformed`` (not JSON), ``unknown_schema``
    (another record type or version: skipped, as the contract says) or ``invalid`` (the schema's
    fields do not validate). Each is counted in ``skipped_records`` and logged."""
    record_type = RECORD_TYPES.get(topic)
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        skipped_records["malformed"] += 1
        log.warning("skipping a malformed record on %s", topic)
        return "malformed"
    schema = data.get("schema") if isinstance(data, dict) else None
    if record_type is None or schema != record_type.SCHEMA:
        skipped_records["unknown_schema"] += 1
        log.warning("skipping a record of unknown schema %r on %s", schema, topic)
        return "unknown_schema"
    try:
        return record_type.model_validate(data)
    except ValidationError as exc:
        skipped_records["invalid"] += 1
        log.warning("skipping an invalid %s record: %s", record_type.SCHEMA, exc.error_count())
        return "invalid"

"""ratchet.records: JSON round trips, dotted GenAI names, decode's counted skips, hashes."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from types import SimpleNamespace

import orjson
import pytest

from ratchet.records import (
    ALL_TOPICS,
    DEADLETTER_TOPIC,
    DEADLETTER_VALUE_MAX,
    EVENTS_TOPIC,
    FEEDBACK_TOPIC,
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    TRAFFIC_TOPIC,
    DeadLetter,
    FeedbackRecord,
    HeldoutPrompt,
    LifecycleEvent,
    Record,
    Sample,
    ScoredGroup,
    TrafficRecord,
    answer_as_text,
    decode,
    parse,
    prompt_hash,
    skipped_records,
)
from ratchet.secrets import hash_api_key
from tests.records import build_traffic_record

SECRET = b"unit-test-server-secret"

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
]


def traffic() -> TrafficRecord:
    return build_traffic_record(
        request_id="req-1",
        response_model="support@v3",
        version=3,
        canary_arm="canary",
        request={"model": "support", "messages": MESSAGES, "temperature": 0.7},
        response_id="chatcmpl-1",
        choices=[{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
        input_tokens=12,
        output_tokens=3,
        finish_reasons=["stop"],
        stream=True,
        status=200,
        latency_ms=12.5,
        ttft_ms=3.25,
        api_key_hash=hash_api_key(SECRET, "sk-secret"),
        user="u-1",
    )


def feedback() -> FeedbackRecord:
    return FeedbackRecord(completion_id="chatcmpl-1", score=0.75, thumbs="up", comment="nice")


def group() -> ScoredGroup:
    sample = Sample(
        message={"role": "assistant", "content": "a"},
        text="a",
        token_ids=[1, 2],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
    )
    return ScoredGroup(
        group_id="g-1",
        alias="support",
        version=2,
        response_model="support@v2",
        prompt_messages=MESSAGES,
        prompt_token_ids=[5, 6, 7],
        samples=[sample, sample.model_copy(update={"text": "b"})],
        rewards=[0.25, 0.75],
        explanations=["meh", "good"],
        judge_model="hosted_vllm/judge",
        rubric_hash="abc",
        traffic_request_id="req-1",
    )


def heldout() -> HeldoutPrompt:
    return HeldoutPrompt(
        prompt_hash=prompt_hash(MESSAGES),
        alias="support",
        prompt_messages=MESSAGES,
        traffic_request_id="req-1",
    )


def event() -> LifecycleEvent:
    return LifecycleEvent(
        alias="support", kind="promote", version=4, previous_version=3, detail={"win_rate": 0.6}
    )


def message(value: bytes) -> SimpleNamespace:
    """What kafka-python hands a consumer, as far as a dead letter needs it."""
    return SimpleNamespace(topic=TRAFFIC_TOPIC, partition=2, offset=41, value=value)


def dead_letter() -> DeadLetter:
    return DeadLetter.of_message(
        message(b'{"schema": "traffic/1"}'), "judge", "invalid", "no alias"
    )


EXPECTED = [
    (traffic, TRAFFIC_TOPIC, "traffic/1"),
    (feedback, FEEDBACK_TOPIC, "feedback/1"),
    (group, GROUPS_TOPIC, "scored_group/1"),
    (heldout, HELDOUT_TOPIC, "heldout_prompt/1"),
    (event, EVENTS_TOPIC, "lifecycle_event/1"),
    (dead_letter, DEADLETTER_TOPIC, "dead_letter/1"),
]


def test_every_topic_has_a_record_type() -> None:
    assert set(ALL_TOPICS) == {topic for _, topic, _ in EXPECTED}


@pytest.mark.parametrize(("make", "topic", "schema"), EXPECTED)
def test_round_trip(make, topic: str, schema: str) -> None:
    record: Record = make()
    assert topic == record.TOPIC
    raw = record.to_json()
    data = orjson.loads(raw)
    assert data["schema"] == schema
    assert "schema_" not in data
    ts = datetime.fromisoformat(data["ts"].replace("Z", "+00:00"))
    offset = ts.utcoffset()
    assert offset is not None and offset.total_seconds() == 0
    assert abs((datetime.now(UTC) - ts).total_seconds()) < 60
    back = decode(topic, raw)
    assert back is not None
    assert type(back) is type(record)
    assert back.model_dump() == record.model_dump()
    assert back.to_json() == raw


def test_traffic_uses_dotted_genai_names() -> None:
    data = orjson.loads(traffic().to_json())
    assert data["gen_ai.request.model"] == "support"
    assert data["gen_ai.response.model"] == "support@v3"
    assert data["gen_ai.usage.input_tokens"] == 12
    assert data["gen_ai.usage.output_tokens"] == 3
    assert data["gen_ai.response.finish_reasons"] == ["stop"]
    for plain in ("request_model", "response_model", "input_tokens", "output_tokens"):
        assert plain not in data
    assert data["canary_arm"] == "canary"
    assert data["version"] == 3


def test_scored_group_uses_dotted_response_model() -> None:
    data = orjson.loads(group().to_json())
    assert data["gen_ai.response.model"] == "support@v2"
    assert "response_model" not in data
    assert data["samples"][1]["text"] == "b"
    assert data["samples"][0]["logprobs"] == [-0.5, -0.25]


def test_records_accept_dotted_names_on_input() -> None:
    data = orjson.loads(traffic().to_json())
    assert TrafficRecord.model_validate(data).response_model == "support@v3"


def test_explicit_ts_kept() -> None:
    record = LifecycleEvent(alias="a", kind="pause", ts="2024-01-02T03:04:05.000Z")
    assert orjson.loads(record.to_json())["ts"] == "2024-01-02T03:04:05.000Z"


def skipped_total() -> int:
    return sum(skipped_records.values())


@pytest.mark.parametrize(
    ("topic", "value", "reason"),
    [
        (TRAFFIC_TOPIC, b"{not json", "malformed"),
        (TRAFFIC_TOPIC, b"", "malformed"),
        (TRAFFIC_TOPIC, b'{"schema": "traffic/2", "request_id": "x"}', "unknown_schema"),
        (TRAFFIC_TOPIC, b'{"request_id": "x"}', "unknown_schema"),
        (TRAFFIC_TOPIC, orjson.dumps(feedback().model_dump(by_alias=True)), "unknown_schema"),
        ("ratchet.unknown", feedback().to_json(), "unknown_schema"),
        (TRAFFIC_TOPIC, b"[1, 2]", "unknown_schema"),
        (TRAFFIC_TOPIC, b'{"schema": "traffic/1", "request_id": "x"}', "invalid"),
        (
            FEEDBACK_TOPIC,
            b'{"schema": "feedback/1", "completion_id": "c", "score": 1.5}',
            "invalid",
        ),
        (
            EVENTS_TOPIC,
            b'{"schema": "lifecycle_event/1", "alias": "a", "kind": "explode"}',
            "invalid",
        ),
    ],
)
def test_decode_skips_and_counts(topic: str, value: bytes, reason: str) -> None:
    before_reason, before_total = skipped_records[reason], skipped_total()
    assert decode(topic, value) is None
    assert skipped_records[reason] == before_reason + 1
    assert skipped_total() == before_total + 1


def test_decode_ignores_unknown_fields_of_a_known_schema() -> None:
    data = orjson.loads(feedback().to_json())
    data["added_in_a_later_minor"] = True
    before = skipped_total()
    record = decode(FEEDBACK_TOPIC, orjson.dumps(data))
    assert isinstance(record, FeedbackRecord)
    assert record.score == 0.75
    assert skipped_total() == before


def test_hash_api_key_is_keyed_by_the_server_secret() -> None:
    key = "sk-live-0123456789abcdef"
    hashed = hash_api_key(SECRET, key)
    assert hashed is not None
    assert key not in hashed
    assert "0123456789abcdef" not in hashed
    assert hashed.startswith("hmac-sha256:")
    assert len(hashed) == len("hmac-sha256:") + 64
    assert hash_api_key(SECRET, key) == hashed
    assert hash_api_key(SECRET, key + "x") != hashed
    # Keyed: the same key under another secret is another hash, and neither is the plain
    # SHA-256 anyone could compute from a guessed key.
    assert hash_api_key(b"another-server-secret", key) != hashed
    assert hashlib.sha256(key.encode()).hexdigest() not in hashed
    assert hash_api_key(SECRET, None) is None
    assert hash_api_key(SECRET, "") is None


def test_records_no_longer_offer_an_unkeyed_hash() -> None:
    import ratchet.records

    assert not hasattr(ratchet.records, "hash_api_key")


def test_record_json_never_contains_key() -> None:
    raw = traffic().to_json()
    assert b"sk-secret" not in raw
    hashed = hash_api_key(SECRET, "sk-secret")
    assert hashed is not None and hashed.encode() in raw


def test_prompt_hash_stable_and_order_sensitive() -> None:
    h = prompt_hash(MESSAGES)
    assert h == prompt_hash([dict(m) for m in MESSAGES])
    assert len(h) == 64 and int(h, 16) >= 0
    # Key order inside a message does not matter...
    reordered_keys = [{"content": m["content"], "role": m["role"]} for m in MESSAGES]
    assert prompt_hash(reordered_keys) == h
    # ...message order does.
    assert prompt_hash(list(reversed(MESSAGES))) != h
    # Tools are part of the prompt; None and [] are the same.
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert prompt_hash(MESSAGES, tools) != h
    assert prompt_hash(MESSAGES, []) == h
    assert prompt_hash(MESSAGES, None) == h
    # Content matters.
    changed = [MESSAGES[0], {"role": "user", "content": "hi!"}]
    assert prompt_hash(changed) != h


def test_prompt_hash_is_a_fixed_function() -> None:
    """The hash decides the held-out split, so it must not change between releases."""
    assert prompt_hash([{"role": "user", "content": "hi"}]) == prompt_hash(
        [{"content": "hi", "role": "user"}], None
    )
    blob = b'{"messages":[{"content":"hi","role":"user"}],"tools":[]}'
    assert prompt_hash([{"role": "user", "content": "hi"}]) == hashlib.sha256(blob).hexdigest()


def test_a_dead_letter_points_at_its_original_and_keeps_a_bounded_copy() -> None:
    huge = b"\xff" + b"x" * (2 * DEADLETTER_VALUE_MAX)  # not UTF-8 either
    letter = DeadLetter.of_message(message(huge), "judge", "malformed", "e" * 5000)
    assert (letter.source_topic, letter.partition, letter.offset) == (TRAFFIC_TOPIC, 2, 41)
    assert letter.key() == f"{TRAFFIC_TOPIC}:2:41".encode()
    assert letter.value_bytes == len(huge)
    assert len(letter.value.encode()) <= DEADLETTER_VALUE_MAX + 2  # U+FFFD for the first byte
    assert len(letter.error) == 1000


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"{not json", "malformed"),
        (b'{"schema": "traffic/99"}', "unknown_schema"),
        (b'{"schema": "traffic/1", "alias": 3}', "invalid"),
    ],
)
def test_parse_says_why_a_value_is_not_a_record(value: bytes, why: str) -> None:
    assert parse(TRAFFIC_TOPIC, value) == why
    assert decode(TRAFFIC_TOPIC, value) is None


def call(name: str, arguments: str) -> dict[str, object]:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_an_answer_as_text_reads_its_tool_calls_as_well_as_its_text() -> None:
    assert answer_as_text({"role": "assistant", "content": "Hi."}) == "Hi."
    alone = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"x": 1}')]}
    assert answer_as_text(alone) == '<tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call>'
    other = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"x": 2}')]}
    assert answer_as_text(other) != answer_as_text(alone)  # calls alone still tell answers apart
    both = {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [call("f", "{}"), call("g", "{}")],
    }
    assert answer_as_text(both).split("\n") == [
        "Looking.",
        '<tool_call>{"name":"f","arguments":"{}"}</tool_call>',
        '<tool_call>{"name":"g","arguments":"{}"}</tool_call>',
    ]
    assert answer_as_text({"role": "assistant", "content": None, "tool_calls": ["odd"]}) == (
        '<tool_call>{"name":"","arguments":""}</tool_call>'
    )

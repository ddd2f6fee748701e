"""Answer ids under a broad redaction pattern (proxy/answer_ids.py): a hex or UUID pattern
redacts only the client's part of an id, never the part the proxy made, so distinct answers keep
distinct ids in their records; a rating's ``completion_id`` (and its record's key) is redacted
exactly as its answer's id, so the two still join."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import orjson

from embedded.processes import wait_until_async
from proxy.answer_ids import redacted_answer_id, upstream_request_id
from proxy.generation import forward
from proxy.log.exchange import REDACTED
from proxy.log.pipe import TrafficLog
from proxy.log.redaction import Redactor
from ratchet.records import FEEDBACK_TOPIC, FeedbackRecord
from tests.unit.proxy.log.test_redaction import exchange
from tests.unit.proxy.log.test_traffic_log import config, spooled

HEX_OR_UUID = r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}|[0-9a-f]{16,}"
SECRET = "deadbeefdeadbeefdeadbeef"  # the client's request_id: a hex secret


def answer_id(client_request_id: str | None = None) -> str:
    """An id as vLLM makes it of the request_id the proxy forwards."""
    return "chatcmpl-" + upstream_request_id(uuid.uuid4().hex, client_request_id)


def traffic_response_id(answer: str) -> str | None:
    body = {"id": answer, "choices": [{"index": 0, "message": {"content": "ok"}}]}
    record = exchange(
        response_body=orjson.dumps(body), redactor=Redactor([HEX_OR_UUID])
    ).to_record()
    return record.response_id


def test_vllm_gets_the_proxys_request_id_then_the_clients() -> None:
    payload = {"model": "support", "messages": [], "request_id": SECRET}
    forwarded, _, _ = forward(payload, "support@v1", False, request_id="a" * 32)
    assert orjson.loads(forwarded)["request_id"] == f"{'a' * 32}-{SECRET}"
    forwarded, _, _ = forward({"model": "support", "messages": []}, "x", False, request_id="b" * 32)
    assert orjson.loads(forwarded)["request_id"] == "b" * 32


def test_a_broad_pattern_leaves_the_proxys_part_and_redacts_the_clients() -> None:
    redact = Redactor([HEX_OR_UUID]).begin().string
    plain = [answer_id() for _ in range(3)]
    assert [redacted_answer_id(i, redact) for i in plain] == plain  # distinct, unredacted
    mine = answer_id(SECRET)
    redacted = redacted_answer_id(mine, redact)
    assert redacted == f"{mine[: len('chatcmpl-') + 32]}-{REDACTED}"
    assert SECRET not in redacted
    assert redacted_answer_id("chatcmpl-" + SECRET, redact) == f"chatcmpl-{REDACTED}"  # not ours


def test_traffic_records_keep_distinct_ids_under_a_hex_pattern() -> None:
    ids = [answer_id() for _ in range(3)] + [answer_id(SECRET) for _ in range(2)]
    recorded = [traffic_response_id(i) for i in ids]
    assert len(set(recorded)) == len(ids)
    assert recorded[:3] == ids[:3]
    assert not any(SECRET in str(r) for r in recorded)


async def test_a_rating_joins_its_answer_under_a_hex_pattern(tmp_path: Path) -> None:
    rated = answer_id(SECRET)
    log = TrafficLog(dataclasses.replace(config(tmp_path), redact_patterns=[HEX_OR_UUID]))
    await log.start()
    assert log.submit(FeedbackRecord(completion_id=rated, score=1.0), key=rated)
    await wait_until_async(lambda: log.spooled == 1, 30, "the rating spooled")
    await log.close()
    [(topic, key, record)] = spooled(tmp_path)
    assert topic == FEEDBACK_TOPIC
    joined = traffic_response_id(rated)
    assert joined is not None and SECRET not in joined
    assert record["completion_id"] == joined and key == joined.encode()

"""Hostile clients that try to write their own answers, or to get text past redaction, against
the real proxy, vLLM, broker and Redis (issue 54; audit N-4, N-5, N-6, N-12).

- Answer shaping: every spelling vLLM's pydantic reads as a shaping value (``echo: 1``,
  ``"yes"``, ``add_generation_prompt: "off"`` ...) and every constraint that fixes the answer is
  refused with a 400 naming the parameter on the session's alias, which learns; the harmless
  spelling is served.
- Redaction: 4 MiB of ``a@a.`` (half a million matches: 5-11 s of RE2 before the deadline was
  checked per match) does not hold up the next exchange's record; the identifiers a client
  chooses and a rating's comment are redacted in the records and in ``ratchet export``, whose
  files are its owner's alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, TrafficRecord
from tests.integration.conftest import Embedded, ratchet_cli
from tests.integration.hostile_attacks import (
    GET_HEALTHZ,
    ONE,
    Case,
    Env,
    assert_all_clean,
    assert_answered,
    assert_no_traceback,
    choices,
    hostile_proxies,
    then_logged_within,
)
from tests.integration.hostile_http import chat, completion, exchange, post

pytestmark = pytest.mark.integration

REDACTED = "[REDACTED]"
SHAPING = "unsupported_parameter"
ASSISTANT_LAST = [
    {"role": "user", "content": "Which product is best?"},
    {"role": "assistant", "content": "Product X, clearly. Buy it"},
]


@pytest.fixture(scope="module")
def hostile(embedded: Embedded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with hostile_proxies(embedded, lambda name: tmp_path_factory.mktemp(f"shaping-{name}")) as env:
        yield env


def schema(fixed: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": fixed}}


# fmt: off
N = "open"  # the session's proxy: no keys; its alias `support` learns from its answers
SPELLINGS: list[tuple[str, Any]] = [
    ("echo", 1), ("echo", "true"), ("echo", "yes"), ("echo", "on"), ("echo", 1.0),
    ("continue_final_message", "yes"), ("continue_final_message", 1),
    ("continue_final_message", "T"),
    ("add_generation_prompt", 0), ("add_generation_prompt", "false"),
    ("add_generation_prompt", "off"), ("add_generation_prompt", "n"),
]
CONSTRAINTS: list[tuple[str, str, dict[str, Any]]] = [
    ("enum", "response_format", {"response_format": schema({"enum": ["Buy X now."]})}),
    ("const-object", "response_format", {"response_format": schema({
        "type": "object", "properties": {"a": {"const": "Buy X"}}, "required": ["a"],
        "additionalProperties": False})}),
    ("one-string-pattern", "response_format", {"response_format": schema(
        {"type": "string", "pattern": "^Buy X now$"})}),
    ("regex", "structured_outputs", {"structured_outputs": {"regex": "Buy X now"}}),
    ("choice", "structured_outputs", {"structured_outputs": {"choice": ["Buy X", "Buy Y"]}}),
    ("json-const", "structured_outputs", {"structured_outputs": {"json": {"const": "x"}}}),
    ("grammar", "structured_outputs", {"structured_outputs": {"grammar": 'root ::= "X"'}}),
    ("chat-template", "chat_template", {"chat_template": "{{ 'Buy X' }}"}),
    ("one-allowed-token", "allowed_token_ids", {"allowed_token_ids": [42]}),
    ("positive-bias", "logit_bias", {"logit_bias": {"42": 100}}),
    ("ban-all-but-a-few", "logit_bias", {"logit_bias": {str(t): -100 for t in range(1025)}}),
]
SHAPING_CASES = [
    *[Case(f"shaping-{param}-{value!r}", N, chat(messages=ASSISTANT_LAST, **{param: value}), 400,
           SHAPING, param) for param, value in SPELLINGS],
    *[Case(f"shaping-{name}", N, chat(**fields), 400, SHAPING, param)
      for name, param, fields in CONSTRAINTS],
    Case("shaping-completions-echo", N, completion(echo=True), 400, SHAPING, "echo"),
    Case("shaping-completions-regex", N, completion(structured_outputs={"regex": "(?i)buy x"}),
         400, SHAPING, "structured_outputs"),
    # The Responses API names its own field, not the chat one it became (Messages, in
    # Anthropic's envelope: tests/unit/proxy/test_messages_route.py).
    Case("shaping-responses-text-format", N, post("/v1/responses", {
        "model": "support", "input": "Which product?", "max_output_tokens": 2,
        "text": {"format": {"type": "json_schema", "name": "a",
                            "schema": {"enum": ["Buy X now."]}}}}), 400, SHAPING, "text.format"),
    # What leaves the answer to the model is served.
    Case("served-echo-no", N, chat(echo="no"), 200, check=choices(1)),
    Case("served-generation-prompt-on", N, chat(add_generation_prompt="on"), 200,
         check=choices(1)),
    Case("served-ban-bias", N, chat(logit_bias={"42": -100}), 200, check=choices(1)),
]
# Four MiB of matches of the session's e-mail pattern. vLLM refuses the prompt as too long; the
# refused exchange is logged (redacted) too, and the next one must follow within 5 s.
ADDRESSES = "a@a." * ((4 * 1024 * 1024 - 256) // 4)
LOGGING = [
    Case("log-4mib-of-addresses", N, then_logged_within(
        chat(messages=[{"role": "user", "content": ADDRESSES}])), 400),
]
CASES = [*SHAPING_CASES, *LOGGING]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_shaping(hostile: Env, case: Case) -> None:
    proxy = hostile.proxies[case.target]
    logged_from = hostile.log_size(proxy)
    result = case.send(hostile, proxy)
    assert_answered(case, result)
    if case.check is not None:
        case.check(result)
    health = exchange(proxy.port, [GET_HEALTHZ])
    assert health.first.status == 200
    assert_no_traceback(hostile.logged_since(proxy, logged_from))


def test_identifiers_and_comments_are_redacted_in_the_records_and_the_export(
    hostile: Env, tmp_path: Path
) -> None:
    """Audit N-5: the x-request-id, the answer's id (the client's request_id is in it)
    and a rating's comment were logged, and exported, as the client sent them. Each reaches
    ratchet.traffic, ratchet.feedback and the ratings export redacted; the rating still joins
    its answer (both ids are redacted alike), and the export's files are 0600 (N-12)."""
    embedded = hostile.embedded
    keyed = hostile.proxies["keyed"]
    marker = uuid.uuid4().hex
    url = f"http://127.0.0.1:{keyed.port}/v1"
    headers = {"Authorization": f"Bearer {ONE}", "x-request-id": f"{marker} alice@example.com"}
    body = {
        "model": "support",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Say hi."}],
        "request_id": f"{marker}:bob@example.com",
    }
    answer = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    completion_id = answer.json()["id"]
    # vLLM's id: the proxy's request id, then the client's own (proxy/answer_ids.py)
    proxy_part = completion_id[: len("chatcmpl-") + 32]
    assert completion_id == f"{proxy_part}-{marker}:bob@example.com"
    rating = {"completion_id": completion_id, "score": 1, "comment": "mail carol@example.com"}
    rated = httpx.post(f"{url}/feedback", json=rating, headers=headers, timeout=30)
    assert rated.status_code == 200, rated.text

    redacted_id = f"{proxy_part}-{marker}:{REDACTED}"  # the client's part alone redacted
    [traffic] = embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.client_request_id == f"{marker} {REDACTED}",
    )
    assert isinstance(traffic, TrafficRecord) and traffic.response_id == redacted_id
    [feedback] = embedded.find_records(
        FEEDBACK_TOPIC, lambda r: isinstance(r, FeedbackRecord) and r.completion_id == redacted_id
    )
    assert isinstance(feedback, FeedbackRecord) and feedback.comment == f"mail {REDACTED}"
    assert b"example.com" not in traffic.to_json() + feedback.to_json()

    out = tmp_path / "ratings"
    done = ratchet_cli(
        "export", "support", "--what", "ratings", "--format", "jsonl", "--since", "30m",
        "--out", str(out), "--config", str(embedded.config_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    shards = sorted((out / "data").glob("*.jsonl"))
    rows = [orjson.loads(line) for shard in shards for line in shard.read_bytes().splitlines()]
    [row] = [row for row in rows if row["completion_id"] == redacted_id]
    assert row["comment"] == f"mail {REDACTED}" and row["rater"] == row["client"]
    assert not any(b"example.com" in shard.read_bytes() for shard in shards)
    written = [*shards, out / "README.md", out / "ratchet-export.json"]
    assert {path.stat().st_mode & 0o777 for path in written} == {0o600}


def test_nothing_left_in_flight_and_no_internal_error(hostile: Env) -> None:
    assert_all_clean(hostile)

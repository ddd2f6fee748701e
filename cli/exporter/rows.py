"""Rows of an export, one schema per kind, and the dataset card that describes them. Pure.

Each kind is one Arrow schema, written once here, so every shard of an export (and of a resumed
one) has the same columns and `datasets.load_dataset("parquet", data_files=...)` reads them as one
table. Chat turns are in the columns `datasets` users expect (``prompt``: a list of
``{role, content}`` with the content as text); the full message JSON (tool calls, content parts)
rides beside them in a ``*_json`` column, so nothing of the record is lost. Redaction was applied
by the proxy's log worker before any of these records reached Kafka; clients are the keyed hashes
the records carry, never a key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import orjson
import pyarrow as pa

from ratchet.gate_pairs import GatePair
from ratchet.records import FeedbackRecord, ScoredGroup, TrafficRecord

Kind = Literal["groups", "ratings", "pairs", "traffic"]
KINDS: tuple[Kind, ...] = ("groups", "ratings", "pairs", "traffic")

_TURNS = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

SCHEMAS: dict[Kind, pa.Schema] = {
    "groups": pa.schema(
        [
            ("group_id", pa.string()),
            ("ts", pa.string()),
            ("alias", pa.string()),
            ("version", pa.int64()),
            ("prompt", _TURNS),
            ("completions", pa.list_(pa.string())),
            ("rewards", pa.list_(pa.float64())),
            ("explanations", pa.list_(pa.string())),
            ("finish_reasons", pa.list_(pa.string())),
            ("prompt_token_ids", pa.list_(pa.int64())),
            ("completion_token_ids", pa.list_(pa.list_(pa.int64()))),
            ("completion_logprobs", pa.list_(pa.list_(pa.float64()))),
            ("judge_model", pa.string()),
            ("rubric_hash", pa.string()),
            ("traffic_request_id", pa.string()),
            ("client", pa.string()),
            ("prompt_json", pa.string()),
            ("completions_json", pa.string()),
        ]
    ),
    "ratings": pa.schema(
        [
            ("completion_id", pa.string()),
            ("ts", pa.string()),
            ("alias", pa.string()),
            ("version", pa.int64()),
            ("prompt", _TURNS),
            ("completion", pa.string()),
            ("score", pa.float64()),
            ("thumbs", pa.string()),
            ("comment", pa.string()),
            ("rater", pa.string()),
            ("client", pa.string()),
            ("request_id", pa.string()),
            ("prompt_json", pa.string()),
            ("completion_json", pa.string()),
        ]
    ),
    "pairs": pa.schema(
        [
            ("alias", pa.string()),
            ("version", pa.int64()),
            ("prompt", _TURNS),
            ("candidate", pa.string()),
            ("incumbent", pa.string()),
            ("outcome", pa.float64()),
            ("verdict", pa.string()),
            ("prompt_json", pa.string()),
        ]
    ),
    "traffic": pa.schema(
        [
            ("request_id", pa.string()),
            ("ts", pa.string()),
            ("alias", pa.string()),
            ("version", pa.int64()),
            ("served_model", pa.string()),
            ("canary_arm", pa.string()),
            ("endpoint", pa.string()),
            ("client_api", pa.string()),
            ("prompt", _TURNS),
            ("completion", pa.string()),
            ("finish_reason", pa.string()),
            ("status", pa.int64()),
            ("input_tokens", pa.int64()),
            ("output_tokens", pa.int64()),
            ("latency_ms", pa.float64()),
            ("client", pa.string()),
            ("truncated", pa.list_(pa.string())),
            ("request_json", pa.string()),
            ("choices_json", pa.string()),
        ]
    ),
}

# What each column means, for the dataset card (README.md of the export).
DESCRIPTIONS: dict[str, str] = {
    "group_id": "the scored group's id (one prompt, K sampled answers)",
    "ts": "when the record was written (RFC 3339, UTC)",
    "alias": "the model name clients sent",
    "version": "the adapter version that answered (0: the base model)",
    "prompt": "the conversation up to the answer, as {role, content} turns (content as text)",
    "completions": "the K sampled answers' text",
    "rewards": "each answer's reward in [0, 1] (RULER, a verifier or the reward model)",
    "explanations": "the judge's reason per answer, where it gave one",
    "finish_reasons": "why each answer stopped",
    "prompt_token_ids": "the prompt as the served model's tokens",
    "completion_token_ids": "each answer's tokens, as sampled",
    "completion_logprobs": "each answer token's log-probability under the sampling version",
    "judge_model": "the judge that scored the group (empty: a verifier)",
    "rubric_hash": "hash of the rubric the judge graded against",
    "traffic_request_id": "the request whose prompt was re-sampled",
    "client": "keyed hash of the API key (and vouched user) the prompt came from",
    "prompt_json": "the prompt's full messages (and tools) as JSON: tool calls, content parts",
    "completions_json": "the K answers as JSON messages: their tool calls (the text is empty)",
    "completion_json": "the answer as a JSON message: its tool calls (the text is empty)",
    "completion_id": "the answer's id, as the client rated it",
    "completion": "the answer's text",
    "score": "the user's rating in [0, 1]",
    "thumbs": "up or down, where the user gave thumbs",
    "comment": "the user's comment, redacted as the traffic is",
    "rater": "keyed hash of the client that rated",
    "request_id": "the proxy's id of the exchange",
    "candidate": "the candidate version's answer (cut to 4,000 characters)",
    "incumbent": "the live version's answer to the same prompt",
    "outcome": "1: the candidate won the pair, 0: the live version won, 0.5: a tie",
    "verdict": "the outcome in words",
    "served_model": "the served name that answered (alias@vN, or the base model)",
    "canary_arm": "active or canary",
    "endpoint": "chat.completions or completions",
    "client_api": "responses or messages: the API the client called (logged as chat)",
    "finish_reason": "why the first choice stopped",
    "status": "the HTTP status the client got",
    "input_tokens": "prompt tokens",
    "output_tokens": "answer tokens",
    "latency_ms": "time to the whole answer",
    "truncated": "what the proxy cut to fit the record size limit",
    "request_json": "the request body as the client sent it (redacted) as JSON",
    "choices_json": "the answer's choices as JSON",
}


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def turns(messages: list[Any]) -> list[dict[str, str]]:
    return [
        {"role": str(m.get("role", "")), "content": text_of(m.get("content"))}
        for m in messages
        if isinstance(m, dict)
    ]


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def group_row(group: ScoredGroup) -> dict[str, Any]:
    return {
        "group_id": group.group_id,
        "ts": group.ts,
        "alias": group.alias,
        "version": group.version,
        "prompt": turns(group.prompt_messages),
        "completions": [s.text for s in group.samples],
        "rewards": list(group.rewards),
        "explanations": list(group.explanations),
        "finish_reasons": [s.finish_reason or "" for s in group.samples],
        "prompt_token_ids": list(group.prompt_token_ids),
        "completion_token_ids": [list(s.token_ids) for s in group.samples],
        "completion_logprobs": [list(s.logprobs) for s in group.samples],
        "judge_model": group.judge_model,
        "rubric_hash": group.rubric_hash,
        "traffic_request_id": group.traffic_request_id,
        "client": group.client,
        "prompt_json": _json({"messages": group.prompt_messages, "tools": group.tools}),
        "completions_json": _json([s.message for s in group.samples]),
    }


def prompt_of(record: TrafficRecord) -> list[Any]:
    messages = record.request.get("messages")
    if isinstance(messages, list):
        return messages
    prompt = record.request.get("prompt")  # /v1/completions
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else _json(prompt)}]


def message_of(record: TrafficRecord) -> dict[str, Any]:
    """The answer's message (a /v1/completions answer's text as one); empty without one."""
    if not record.choices:
        return {}
    choice = record.choices[0]
    message = choice.get("message")
    if isinstance(message, dict):
        return message
    text = choice.get("text")
    return {"role": "assistant", "content": text} if isinstance(text, str) else {}


def completion_of(record: TrafficRecord) -> str:
    return text_of(message_of(record).get("content"))


def traffic_row(record: TrafficRecord) -> dict[str, Any]:
    return {
        "request_id": record.request_id,
        "ts": record.ts,
        "alias": record.alias,
        "version": record.version,
        "served_model": record.response_model,
        "canary_arm": record.canary_arm,
        "endpoint": record.endpoint,
        "client_api": record.client_api,
        "prompt": turns(prompt_of(record)),
        "completion": completion_of(record),
        "finish_reason": (record.finish_reasons or [None])[0],
        "status": record.status,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "latency_ms": record.latency_ms,
        "client": record.client,
        "truncated": list(record.truncated),
        "request_json": _json(record.request),
        "choices_json": _json(record.choices),
    }


def rating_row(rating: FeedbackRecord, answered: TrafficRecord) -> dict[str, Any]:
    """A rating joined with the exchange it rates."""
    return {
        "completion_id": rating.completion_id,
        "ts": rating.ts,
        "alias": answered.alias,
        "version": answered.version,
        "prompt": turns(prompt_of(answered)),
        "completion": completion_of(answered),
        "score": rating.score,
        "thumbs": rating.thumbs,
        "comment": rating.comment,
        "rater": rating.client,
        "client": answered.client,
        "request_id": answered.request_id,
        "prompt_json": _json(prompt_of(answered)),
        "completion_json": _json(message_of(answered)),
    }


def rating_rows(answered: TrafficRecord, ratings: Sequence[FeedbackRecord]) -> list[dict[str, Any]]:
    """The rows of the ratings of ``answered``'s answer, given by the client it was served to.

    A rating names its answer by id, and a client can choose that id (the body's
    ``request_id``): a rating by another client is not joined (audit N-12). The proxy already
    refuses to rate another key's answer; this keeps an export true to that even for records
    logged where it did not, or for two clients whose ids collide (redacted alike)."""
    return [rating_row(rating, answered) for rating in ratings if rating.client == answered.client]


def pair_row(alias: str, version: int, pair: GatePair) -> dict[str, Any]:
    return {
        "alias": alias,
        "version": version,
        "prompt": turns(pair.prompt_messages),
        "candidate": pair.candidate,
        "incumbent": pair.incumbent,
        "outcome": pair.outcome,
        "verdict": pair.verdict,
        "prompt_json": _json(pair.prompt_messages),
    }


ROW_OF_RECORD: dict[Kind, Callable[..., dict[str, Any]]] = {
    "groups": group_row,
    "traffic": traffic_row,
}

_ABOUT: dict[Kind, str] = {
    "groups": "One row per scored group the judge wrote to `ratchet.groups`: a real prompt, "
    "the K answers sampled from the live version, and their rewards: GRPO's training data, "
    "usable as it is for offline RL or, best against worst answer, for DPO.",
    "ratings": "One row per user rating (`POST /v1/feedback`) joined with the exchange it "
    "rates, when the client that rated is the one the answer was served to: preference and "
    "reward-model data from real users.",
    "pairs": "The held-out pairs each gate scored (the first 16 per candidate version, as the "
    "learner keeps them): the candidate's and the live version's answers to one prompt and "
    "the gate's verdict: evaluation data.",
    "traffic": "One row per logged exchange of `ratchet.traffic`: prompts and served answers "
    "for SFT or evaluation.",
}


def dataset_card(alias: str, kind: Kind, fmt: str, rows: int, since: str | None, begun: str) -> str:
    """README.md of the export: front matter `datasets` reads (the shards as one split) and the
    fields.

    The config's ``description`` names the export and when it began. `datasets` caches what
    ``load_dataset(folder)`` prepared under the folder's *name* and a hash of this front matter,
    not of the files, so without it a later export into another folder of the same name (a
    weekly ``./ratings``) loaded the earlier export's rows from the cache."""
    fields = "\n".join(
        f"| `{field.name}` | {field.type} | {DESCRIPTIONS.get(field.name, '')} |"
        for field in SCHEMAS[kind]
    )
    window = f" since {since}" if since else ""
    description = _json(f"ratchet export {alias} --what {kind}{window}, begun {begun}")
    builder = "parquet" if fmt == "parquet" else "json"
    return f"""---
configs:
- config_name: default
  description: {description}
  data_files:
  - split: train
    path: data/*.{fmt}
---
# {alias}: {kind}

Exported by `ratchet export {alias} --what {kind}`{window}: {rows} rows.

{_ABOUT[kind]}

Prompts and answers are as the proxy logged them, after its redaction (`proxy.redact_patterns`).
Clients appear only as keyed hashes.

```python
from datasets import load_dataset
rows = load_dataset("{builder}", data_files="data/*.{fmt}", split="train")
```

| field | type | meaning |
|---|---|---|
{fields}
"""

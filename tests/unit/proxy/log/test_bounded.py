"""A traffic record never exceeds proxy.max_record_bytes: it is cut down in steps, and says
what was cut, instead of being refused by Kafka and blocking every record behind it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.log.exchange import CUT_MARK, bounded
from ratchet.records import TrafficRecord
from tests.records import build_traffic_record

LIMIT = 64 * 1024


def record(
    request: dict[str, Any] | None = None, choices: list[Any] | None = None
) -> TrafficRecord:
    return build_traffic_record(
        request=request or {"messages": [{"role": "user", "content": "hi"}]},
        choices=choices or [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    )


def logprobs(tokens: int) -> dict[str, Any]:
    entry = {"token": "tok", "logprob": -1.5, "bytes": [116, 111, 107]}
    return {"content": [{**entry, "top_logprobs": [entry] * 20} for _ in range(tokens)]}


def back(value: bytes) -> TrafficRecord:
    return TrafficRecord.model_validate(orjson.loads(value))


def test_a_record_that_fits_is_untouched() -> None:
    small = record()
    assert bounded(small, LIMIT) == small.to_json()
    assert back(bounded(small, LIMIT)).truncated == []


def test_logprobs_go_first_and_the_answers_stay_whole() -> None:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": f"answer {i}"},
            "logprobs": logprobs(200),
        }
        for i in range(4)
    ]
    big = record(choices=choices)
    value = bounded(big, LIMIT)
    assert len(value) <= LIMIT < len(big.to_json())
    cut = back(value)
    assert cut.truncated == ["logprobs"] and cut.original_bytes == len(big.to_json())
    assert [c["message"]["content"] for c in cut.choices] == [f"answer {i}" for i in range(4)]
    assert "logprobs" not in cut.choices[0]


def test_a_long_answer_is_cut_and_the_request_kept() -> None:
    text = "word " * 40_000  # 200 kB
    big = record(choices=[{"index": 0, "message": {"role": "assistant", "content": text}}])
    cut = back(bounded(big, LIMIT))
    assert cut.truncated == ["logprobs", "answer"]
    content = cut.choices[0]["message"]["content"]
    assert content.endswith(CUT_MARK) and text.startswith(content.removesuffix(CUT_MARK))
    assert cut.request == big.request


def test_a_long_request_is_cut_last() -> None:
    prompt = "é" * 600_000  # two bytes each in UTF-8
    big = record(request={"messages": [{"role": "user", "content": prompt}]})
    value = bounded(big, LIMIT)
    assert len(value) <= LIMIT
    assert back(value).truncated == ["logprobs", "answer", "request"]


def test_many_short_strings_drop_the_request_and_answers_whole() -> None:
    messages = [{"role": "user", "content": "x" * 200} for _ in range(1000)]  # none worth cutting
    cut = back(bounded(record(request={"messages": messages}), LIMIT))
    assert cut.truncated == ["logprobs", "answer", "request", "all"]
    assert cut.request == {} and cut.choices == [] and cut.request_id == "r1"


@pytest.mark.parametrize("limit", [LIMIT, 200 * 1024])
def test_the_bound_holds_whatever_the_limit(limit: int) -> None:
    choices = [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "z" * 300_000},
            "logprobs": logprobs(300),
        }
    ]
    assert (
        len(
            bounded(
                record(
                    request={"messages": [{"role": "user", "content": "q" * 300_000}]},
                    choices=choices,
                ),
                limit,
            )
        )
        <= limit
    )


@pytest.mark.parametrize(
    "request_body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{}] * 130_000},
        {"messages": [{"role": "user", "content": "x"}] * 20_000},
        {"messages": [{"role": "user", "content": "q" * 300_000}], "tools": [{}] * 20_000},
    ],
    ids=["tiny-dicts", "short-strings", "long-string-and-tiny-dicts"],
)
def test_the_record_is_serialized_a_bounded_number_of_times(
    request_body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many halvings it takes, a record is serialized at most once a step, plus once
    for the last (whole-dropped) form: not once a halving (130k tiny dicts took 3 s that way)."""
    calls: list[int] = []
    to_json = TrafficRecord.to_json

    def counted(self: TrafficRecord) -> bytes:
        calls.append(1)
        return to_json(self)

    monkeypatch.setattr(TrafficRecord, "to_json", counted)
    big = record(request=request_body, choices=[{"index": 0, "message": {"content": "a" * 9000}}])
    value = bounded(big, LIMIT)
    assert len(value) <= LIMIT
    assert len(calls) <= 5  # whole, less logprobs (none here: skipped), answer, request, all


def test_the_fewest_halvings_that_fit_are_taken() -> None:
    """As when it halved a step at a time: the answer is cut only as far as the limit needs."""
    text = "word " * 40_000  # 200 kB: two halvings leave 50 kB, under the 64 KiB limit
    big = record(choices=[{"index": 0, "message": {"role": "assistant", "content": text}}])
    content = back(bounded(big, LIMIT)).choices[0]["message"]["content"]
    once = text[: len(text) // 2] + CUT_MARK
    assert content == once[: len(once) // 2] + CUT_MARK

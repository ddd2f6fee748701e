"""The bill's arithmetic, and how rounds and promotions add up from lifecycle events."""

from __future__ import annotations

from ratchet.bill import Bill, read_bill, total
from ratchet.rounds import promotion_bills, rounds_of


def test_bills_add_up_field_by_field_and_read_back_from_json() -> None:
    a = Bill(judge_calls=2, judge_cost_usd=0.01, sample_output_tokens=300, train_seconds=4.0)
    b = Bill(judge_calls=1, judge_cost_usd=0.005, sample_output_tokens=100, gate_seconds=2.5)
    summed = a + b
    assert (summed.judge_calls, summed.sample_output_tokens) == (3, 400)
    assert summed.judge_cost_usd == 0.015 and (summed.train_seconds, summed.gate_seconds) == (
        4,
        2.5,
    )
    a.add(b)
    assert a == summed
    assert total([a, None, b]) == a + b
    assert read_bill(summed.as_dict()) == summed
    assert read_bill("not a bill") is None and read_bill({"judge_calls": -1}) is None
    assert (
        summed.line()
        == "judge 3 calls $0.0150 (0 tok); sampling 400 tok 0 s; training 0 tok 4 s; gate 2 s"
    )


def event(kind: str, version: int, ts: str, **detail: object) -> dict[str, object]:
    previous = version if kind == "rollback" else 0
    return {
        "kind": kind,
        "version": version,
        "previous_version": previous,
        "ts": ts,
        "detail": detail,
    }


def test_a_promotions_bill_is_its_round_and_the_rejected_ones_before_it() -> None:
    one, two, three = (Bill(judge_calls=n, train_tokens=10 * n) for n in (1, 2, 4))
    history = [  # newest first, as Redis keeps it
        event("promote", 3, "t6"),
        event("canary", 3, "t5", bill=three.as_dict()),  # the bill rides on the round's outcome
        event("candidate", 3, "t4"),
        event("reject", 2, "t3", bill=two.as_dict()),
        event("candidate", 2, "t2"),
        event("reject", 1, "t1", bill=one.as_dict()),
        event("candidate", 1, "t0"),
    ]
    rows = rounds_of(history)
    assert [(r.version, r.outcome, r.bill) for r in rows] == [
        (1, "rejected", one),
        (2, "rejected", two),
        (3, "promoted", three),  # the promote event carries no bill: the canary's stays
    ]
    assert promotion_bills(rows) == {3: one + two + three}

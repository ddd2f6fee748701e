"""What learning costs: judge calls, sampling and training, added up per group, round and
promotion.

The judge writes a group's bill into its ``ScoredGroup`` (its judge calls, from litellm's usage
and price map, and its sampling request to vLLM); the learner adds the round's training and gate
and writes the sum into the round's outcome event; a promotion's bill is the sum of the rounds
since the previous promotion (the rejected ones paid for it too). The services' counters count
the same quantities as they are spent, including the spend of groups that failed and were never
produced, which no round carries.

Seconds are wall-clock seconds of the requests and of training. The learner's are device time
(it has its device to itself); the judge's sampling and judge-call seconds overlap when requests
run concurrently (vLLM batches them), so they are an upper bound on the device time used.

A value type, free of client libraries: the records carry it. The day's judge spend in Redis is
``ratchet.spend``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Bill(BaseModel):
    """Counts and costs, all zero by default; ``+`` adds two."""

    model_config = ConfigDict(extra="ignore")

    judge_calls: int = Field(default=0, ge=0)
    judge_input_tokens: int = Field(default=0, ge=0)
    judge_output_tokens: int = Field(default=0, ge=0)
    judge_cost_usd: float = Field(default=0.0, ge=0.0)  # litellm's price map; 0 for local models
    judge_seconds: float = Field(default=0.0, ge=0.0)
    sample_input_tokens: int = Field(default=0, ge=0)
    sample_output_tokens: int = Field(default=0, ge=0)
    sample_seconds: float = Field(default=0.0, ge=0.0)
    train_tokens: int = Field(default=0, ge=0)
    train_seconds: float = Field(default=0.0, ge=0.0)
    gate_seconds: float = Field(default=0.0, ge=0.0)

    def __add__(self, other: Bill) -> Bill:
        return Bill(
            **{name: getattr(self, name) + getattr(other, name) for name in Bill.model_fields}
        )

    def add(self, other: Bill) -> None:
        """Add ``other`` into this bill, in place."""
        for name in Bill.model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def add_judge_call(self, input_tokens: int, output_tokens: int, cost: float, s: float) -> None:
        self.judge_calls += 1
        self.judge_input_tokens += input_tokens
        self.judge_output_tokens += output_tokens
        self.judge_cost_usd += cost
        self.judge_seconds += s

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, seconds and dollars rounded to what is worth reading."""
        values = self.model_dump()
        for name, value in values.items():
            if isinstance(value, float):
                values[name] = round(value, 6 if name.endswith("usd") else 3)
        return values

    def line(self) -> str:
        """``judge 12 calls $0.0123 (8.1k tok); sampling 45.2k tok 120 s; training 3.1k tok
        40 s; gate 30 s``: what a table cell or a status line shows."""
        judge_tokens = self.judge_input_tokens + self.judge_output_tokens
        sampled = self.sample_input_tokens + self.sample_output_tokens
        return (
            f"judge {self.judge_calls} calls ${self.judge_cost_usd:.4f} ({_k(judge_tokens)} tok); "
            f"sampling {_k(sampled)} tok {self.sample_seconds:.0f} s; "
            f"training {_k(self.train_tokens)} tok {self.train_seconds:.0f} s; "
            f"gate {self.gate_seconds:.0f} s"
        )


def total(bills: Iterable[Bill | None]) -> Bill:
    summed = Bill()
    for bill in bills:
        if bill is not None:
            summed = summed + bill
    return summed


def read_bill(value: Any) -> Bill | None:
    """A bill from event JSON (which more than Ratchet can write); None if it is not one."""
    if not isinstance(value, dict):
        return None
    try:
        return Bill.model_validate(value)
    except ValueError:
        return None


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)

"""The daily judge budget (``learning.max_cost_per_day``): an alias's judge spend per UTC day in
Redis, added to by the judge and the gate, read by the judge (to pause sampling), the console and
``ratchet status``."""

from __future__ import annotations

from datetime import UTC, datetime

import redis

# How long a day's judge spend is kept: the day, and the next for late readers.
SPEND_TTL_S = 2 * 24 * 3600


def today(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%d")


def spend_key(alias: str, day: str) -> str:
    """String (float): the alias's judge spend in USD on that UTC day, by judge and gate."""
    return f"ratchet:judge:{alias}:spend:{day}"


def add_spend(client: redis.Redis, alias: str, cost: float, day: str | None = None) -> None:
    if cost <= 0:
        return
    key = spend_key(alias, day or today())
    pipe = client.pipeline(transaction=False)
    pipe.incrbyfloat(key, cost)
    pipe.expire(key, SPEND_TTL_S)
    pipe.execute()


def read_spend(client: redis.Redis, alias: str, day: str | None = None) -> float:
    raw = client.get(spend_key(alias, day or today()))
    try:
        return float(raw) if raw is not None else 0.0
    except ValueError:
        return 0.0


def budget_line(spent: float, cap: float | None) -> str:
    """``judge spend today $1.23 of $5.00`` (and ``: sampling paused until 00:00 UTC`` when
    reached)."""
    if cap is None:
        return f"judge spend today ${spent:.4f}"
    line = f"judge spend today ${spent:.4f} of ${cap:.2f}"
    return line + ": sampling paused until 00:00 UTC" if spent >= cap else line

"""The daily judge spend in a real Redis, and the line that says it against the cap."""

from __future__ import annotations

from datetime import UTC, datetime

import redis

from ratchet.spend import add_spend, budget_line, read_spend, spend_key


def test_the_days_judge_spend_adds_up_in_redis_and_says_when_the_cap_is_reached(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    day = datetime(2026, 11, 27, tzinfo=UTC).strftime("%Y-%m-%d")
    add_spend(client, "support", 0.25, day)
    add_spend(client, "support", 0.0, day)  # a free (local) call writes nothing
    add_spend(client, "support", 0.5, day)
    assert read_spend(client, "support", day) == 0.75
    assert read_spend(client, "other", day) == 0.0
    assert 0 < client.ttl(spend_key("support", day)) <= 2 * 24 * 3600
    assert budget_line(0.75, None) == "judge spend today $0.7500"
    assert budget_line(0.75, 1.0) == "judge spend today $0.7500 of $1.00"
    assert budget_line(1.0, 1.0).endswith(": sampling paused until 00:00 UTC")

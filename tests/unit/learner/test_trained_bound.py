"""The trained set (ratchet:learner:<alias>:trained) is bounded by a count, not only by time."""

from __future__ import annotations

import redis

from learner.round import mark_trained, trained_key
from ratchet.settings import LearnerSettings


def test_the_trained_set_keeps_the_newest_ids_up_to_its_bound(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for start in range(0, 50, 10):
        pipe = client.pipeline(transaction=True)
        mark_trained(pipe, "a", [f"g{i}" for i in range(start, start + 10)], keep=25)
        pipe.execute()
    kept = {m.decode() for m in client.zrange(trained_key("a"), 0, -1)}
    assert len(kept) == 25
    assert {"g49", "g40", "g30"} <= kept and not {"g0", "g19"} & kept


def test_the_bound_is_a_described_setting() -> None:
    field = LearnerSettings.model_fields["trained_groups_max"]
    assert field.description and LearnerSettings().trained_groups_max >= 1000

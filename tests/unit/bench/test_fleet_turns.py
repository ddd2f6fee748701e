"""bench/fleet_turns.py: with users pausing between turns, keying by conversation sends more
later turns back to a replica they used than keying by version, and holding the width helps
where traffic is light. Seeded: the same numbers every run."""

from __future__ import annotations

from bench.fleet_turns import revisit_share

REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def share(rate: float, hold_s: float | None, think_s: float = 10.0) -> float:
    runs = [
        revisit_share(REPLICAS, rate, think_s, hold_s, seed, conversations=100) for seed in range(8)
    ]
    return sum(runs) / len(runs)


def test_conversations_return_to_their_replica_more_often_than_versions_send_them() -> None:
    by_version, by_conversation = share(2.0, None), share(2.0, 60.0)
    assert by_conversation > by_version + 0.15, (by_version, by_conversation)


def test_a_held_width_keeps_light_traffic_in_place() -> None:
    assert share(0.5, 60.0) > share(0.5, 0.0) + 0.03

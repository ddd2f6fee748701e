"""Where a round starts (ratchet/carry.py): the pure decisions, and the Redis round trip."""

from __future__ import annotations

import redis

from ratchet.carry import Carry, Start, carry_after, read_carry, start_of_round, write_carry


def test_a_carry_is_used_only_against_the_live_version_it_was_gated_against() -> None:
    carry = Carry(version=7, live=5, rounds=1, win_rate=0.6)
    assert start_of_round(carry, live=5, max_rounds=3) == Start(7, 1)
    assert start_of_round(carry, live=8, max_rounds=3) == Start(8)  # another version went live
    assert start_of_round(None, live=5, max_rounds=3) == Start(5)


def test_a_carry_holding_max_rounds_is_not_trained_further() -> None:
    assert start_of_round(Carry(7, 5, 2, 0.6), live=5, max_rounds=3).carried
    assert start_of_round(Carry(7, 5, 3, 0.6), live=5, max_rounds=3) == Start(5)
    assert start_of_round(Carry(7, 5, 1, 0.6), live=5, max_rounds=1) == Start(5)  # off


def test_a_rejection_is_carried_unless_the_gate_showed_it_worse() -> None:
    start = Start(7, 1)
    assert carry_after(start, 5, 9, False, 0.61, 0.8, 0.5) == Carry(9, 5, 2, 0.61)
    # A first round that moved the greedy answers little: not proven either way, carried on.
    assert carry_after(start, 5, 9, False, 0.45, 0.7, 0.5) == Carry(9, 5, 2, 0.45)
    assert carry_after(start, 5, 9, False, 0.2, 0.49, 0.5) is None  # shown worse
    assert carry_after(start, 5, 9, False, None, None, 0.5) is None  # the gate failed
    assert carry_after(start, 5, 9, True, 0.8, 0.9, 0.5) is None  # passed: canary or live
    assert carry_after(Start(5), 5, 9, False, 0.7, 0.9, 0.6) == Carry(9, 5, 1, 0.7)
    assert carry_after(Start(5), 5, 9, False, 0.58, 0.59, 0.6) is None


def test_a_carry_round_trips_through_redis_and_clears(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert read_carry(client, "a") is None
    pipe = client.pipeline()
    write_carry(pipe, "a", Carry(3, 1, 2, 0.625))
    pipe.execute()
    assert read_carry(client, "a") == Carry(3, 1, 2, 0.625)
    pipe = client.pipeline()
    write_carry(pipe, "a", None)
    pipe.execute()
    assert read_carry(client, "a") is None
    client.hset("ratchet:learner:a:carry", "version", "x")  # not ours
    assert read_carry(client, "a") is None


def test_a_canary_is_carried_while_it_is_the_canary_whatever_its_rounds() -> None:
    """A passed candidate on its canary: the next round trains on from it while it runs (it
    passed its gate, so max_rounds does not bound it); promoted or rolled back, it is void."""
    carry = Carry(9, 5, 4, 0.8, canary=True)
    assert start_of_round(carry, live=5, max_rounds=3, canary=9) == Start(9, 4)
    assert start_of_round(carry, live=5, max_rounds=3, canary=None) == Start(5)  # rolled back
    assert start_of_round(carry, live=9, max_rounds=3, canary=None) == Start(9)  # promoted
    assert start_of_round(carry, live=5, max_rounds=3, canary=11) == Start(5)  # another canary
    # A rejected candidate's carry holds whatever canary the alias has (an imported one).
    assert start_of_round(Carry(7, 5, 1, 0.6), live=5, max_rounds=3, canary=11) == Start(7, 1)


def test_a_passed_candidate_is_carried_only_to_a_canary() -> None:
    start = Start(7, 1)
    assert carry_after(start, 5, 9, True, 0.8, 0.9, 0.5, to_canary=True) == Carry(
        9, 5, 2, 0.8, canary=True
    )
    assert carry_after(start, 5, 9, True, 0.8, 0.9, 0.5, to_canary=False) is None  # live now
    assert carry_after(start, 5, 9, False, 0.2, 0.49, 0.5, to_canary=True) is None  # shown worse


def test_a_carried_canary_round_trips_through_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline()
    write_carry(pipe, "b", Carry(3, 1, 1, 0.7, canary=True))
    pipe.execute()
    assert read_carry(client, "b") == Carry(3, 1, 1, 0.7, canary=True)

"""The canary's error test over clients at fixed looks, each made once and recorded in a real
Redis: a later check reads the look it made, never tests again on newer counts."""

from __future__ import annotations

import random

import redis

from learner.canary_clients import Look
from learner.canary_errors import (
    ErrorEvidence,
    ErrorLook,
    due_looks,
    error_rollback,
    recorded_looks,
)
from ratchet.canary_state import canary_key
from ratchet.settings import CanaryConfig

ALIAS = "support"
CONFIG = CanaryConfig(min_clients=20, max_error_rate_increase=0.02, alpha=0.05)


def clients(n: int, served: int, failed: int, prefix: str) -> dict[str, tuple[int, int]]:
    return {f"{prefix}{i}": (served, failed) for i in range(n)}


def test_a_look_is_made_once_and_later_counts_wait_for_the_next_look(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    healthy = ErrorEvidence.of(clients(20, 5, 0, "a"), clients(20, 5, 0, "c"))
    first = recorded_looks(client, ALIAS, 2, healthy, CONFIG)
    assert [look.index for look in first] == [0] and first[0].clients == 20
    # Between 20 and 40 clients an arm the canary's failures grow: look 1 (at 20) was made on
    # the counts it saw, and stands; no test is made again until 40.
    failing = ErrorEvidence.of(clients(30, 5, 0, "a"), clients(30, 5, 4, "c"))
    assert error_rollback(failing, CONFIG, few=False) is not None  # a test made now would fail
    again = recorded_looks(client, ALIAS, 2, failing, CONFIG)
    assert again == first
    assert error_rollback(failing, CONFIG, False, again) is None
    # At 40 clients the second look is made, on the counts as they stand then.
    more = ErrorEvidence.of(clients(40, 5, 0, "a"), clients(40, 5, 4, "c"))
    looks = recorded_looks(client, ALIAS, 2, more, CONFIG)
    assert [look.index for look in looks] == [0, 1] and looks[1].clients == 40
    reason = error_rollback(more, CONFIG, False, looks)
    assert reason is not None and "look 2" in reason and reason.startswith("error_rate:")


def test_the_first_replicas_look_stands_and_looks_belong_to_their_canary(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    seen = ErrorEvidence.of(clients(20, 5, 0, "a"), clients(20, 5, 0, "c"))
    other = ErrorEvidence.of(clients(25, 5, 0, "a"), clients(25, 5, 5, "c"))
    made = recorded_looks(client, ALIAS, 2, seen, CONFIG)
    # Another replica, on later counts, finds look 1 made and reads it.
    assert recorded_looks(client, ALIAS, 2, other, CONFIG) == made
    # The next canary (v3) makes its own: v2's look is not its.
    next_canary = recorded_looks(client, ALIAS, 3, other, CONFIG)
    assert next_canary[0].canary == 1.0 and next_canary != made
    raw = client.hget(canary_key(ALIAS), "error_look:v3:0")
    assert raw is not None and ErrorLook.decode(raw) == next_canary[0]


def test_fixed_looks_hold_alpha_over_many_checks_where_a_test_at_each_check_does_not() -> None:
    """Equal arms, margin 0 (any excess counts), clients arriving a few per check: testing at
    every check rolls back far more than alpha of these canaries; the fixed looks, each made
    once, stay within alpha."""
    config = CanaryConfig(min_clients=20, max_error_rate_increase=0.0, alpha=0.05)
    rng = random.Random(7)
    runs, per_check, checks = 200, 4, 40
    every_check = fixed = 0
    for _ in range(runs):
        arms: list[dict[str, tuple[int, int]]] = [{}, {}]
        made: dict[int, ErrorLook] = {}
        rolled_every = rolled_fixed = False
        for check in range(checks):
            for arm in arms:
                for i in range(per_check):
                    served = rng.randint(1, 5)
                    failed = sum(rng.random() < 0.1 for _ in range(served))
                    arm[f"{check}-{i}"] = (served, failed)
            evidence = ErrorEvidence.of(arms[0], arms[1])
            for look in due_looks(evidence, config, made):
                made[look.index] = look
            looks = sorted(made.values(), key=lambda look: look.index)
            if len(arms[0]) >= config.min_clients:  # the test as it was, at every check
                old = Look.of(list(evidence.active), list(evidence.canary), 0.0, config.alpha)
                rolled_every |= old.lower > config.max_error_rate_increase
            rolled_fixed |= error_rollback(evidence, config, False, looks) is not None
        every_check += rolled_every
        fixed += rolled_fixed
    assert fixed / runs <= config.alpha
    assert every_check / runs > 2 * config.alpha

"""A client on both arms is one paired unit (learner/canary_pairs.py): pure, no Redis."""

from __future__ import annotations

import random

from learner.canary_clients import client_test, paired_look
from learner.canary_pairs import (
    ClientUnit,
    client_pairs,
    fence_bound,
    fenced_mean,
    on_arms,
)
from learner.canary_ratings import Rating
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.settings import CanaryConfig


def honest(rng: random.Random, clients: int, ratings: int) -> tuple[list[Rating], list[Rating]]:
    """``clients`` clients rating ``ratings`` answers each, half of them the canary's, both arms
    liked 0.7; in one storing order (``seq``) across the arms."""
    arms: tuple[list[Rating], list[Rating]] = ([], [])
    seq = 0
    for _ in range(ratings):
        for c in range(clients):
            arm = rng.random() < 0.5
            arms[arm].append(Rating(f"h{c}", float(rng.random() < 0.7), seq))
            seq += 1
    return arms


def test_a_client_on_both_arms_is_one_unit() -> None:
    active = [Rating("both", 1.0, 0), Rating("both", 1.0, 2), Rating("only-a", 0.5, 3)]
    canary = [Rating("both", 0.0, 1), Rating("only-c", 1.0, 4)]
    units = client_pairs(active, canary, 3, ended=True)
    assert [u.client for u in units] == ["both", "only-a", "only-c"]
    both = units[0]
    assert both.paired and both.difference == -1.0  # canary 0 minus active mean 1
    assert on_arms(units) == (2, 2)  # the paired unit is on each arm, once in all
    # Its unit is its first three ratings across the arms, in storing order: later ones change
    # nothing, on either arm.
    later = client_pairs([*active, Rating("both", 0.0, 9)], canary, 3, ended=True)
    assert later[0] == both


def test_anonymous_ratings_stay_unpaired_units() -> None:
    active = [Rating(ANONYMOUS_CLIENT, 1.0, i) for i in range(3)]
    canary = [Rating(ANONYMOUS_CLIENT, 0.0, 3 + i) for i in range(2)]
    units = client_pairs(active, canary, 10)
    assert len(units) == 5 and not any(u.paired for u in units)


def test_a_key_that_knows_the_arms_moves_the_estimate_at_most_by_the_bound() -> None:
    """The key's d = -1 (canary 0, active 1) among 60 honest clients: the fenced mean moves by
    at most 2B (the docstring's bound: B for its value, B for a unit its rank moves across the
    fence), where the same unit counted on both arms moves a plain mean by 2/61."""
    for seed in range(20):
        rng = random.Random(seed)
        units = [u for u in client_pairs(*honest(rng, 60, 10), 10, ended=True) if u.paired]
        key = ClientUnit("key", 1.0, 0.0, 5, 5)  # d = -1
        clean = fenced_mean(units).estimate
        attacked = fenced_mean([*units, key]).estimate
        bound = fence_bound(units)
        assert abs(attacked - clean) <= 2 * bound, (seed, attacked - clean, bound)
        assert bound < 2.0 / len(units)  # less than a unit on both arms moves a mean


def test_five_keys_barely_move_the_paired_drop() -> None:
    """Five veto keys among 60 honest clients rating both arms alike: the paired estimate moves
    by well under its standard error (a per-arm trim moved it by about one)."""
    shifts, errors = [], []
    for seed in range(30):
        rng = random.Random(seed)
        active, canary = honest(rng, 60, 10)
        seq = len(active) + len(canary)
        keys_a = [Rating(f"x{k}", 1.0, seq + 2 * i + k * 40) for k in range(5) for i in range(15)]
        keys_c = [
            Rating(f"x{k}", 0.0, seq + 2 * i + 1 + k * 40) for k in range(5) for i in range(15)
        ]
        clean = paired_look(client_pairs(active, canary, 10, ended=True), 0.1, 0.05)
        attacked = paired_look(
            client_pairs(active + keys_a, canary + keys_c, 10, ended=True), 0.1, 0.05
        )
        assert clean is not None and attacked is not None
        shifts.append(clean.drop - attacked.drop)
        errors.append((clean.upper - clean.lower) / 2 / 1.68)
    assert sum(shifts) / len(shifts) < 0.75 * sum(errors) / len(errors), shifts


def test_the_last_look_is_the_same_rule_on_either_side_of_min_clients() -> None:
    """19 and 20 raters an arm, one rating each, after the wait: both decided by a last look
    (before, 19 were not looked at and the canary promoted in every run)."""
    config = CanaryConfig(client_ratings=1, min_clients=20)
    for n in (19, 20):
        rng = random.Random(n)
        active = [Rating(f"a{i}", float(rng.random() < 0.8)) for i in range(n)]
        canary = [Rating(f"c{i}", float(rng.random() < 0.8)) for i in range(n)]
        test = client_test(active, canary, config, ended=True)
        assert test.looks and test.decision in ("pass", "fail"), test.reason
        assert "last look" in test.reason or "inconclusive" in test.reason


def test_the_fence_keeps_the_honest_tail_of_a_skewed_difference() -> None:
    """Arms liked 0.95 and 0.85 (the canary worse by the margin): the honest d has a long
    negative tail (a client who met the canary's few bad answers), which is evidence, not a key.
    A fence in scales of the d's own spread set that tail aside, biased the estimate up by a
    third of its error and promoted such canaries 8% of runs at alpha 5%; the fence in each
    unit's own noise moves it by under a quarter of its error."""
    shifts, errors = [], []
    for seed in range(40):
        rng = random.Random(seed)
        arms: tuple[list[Rating], list[Rating]] = ([], [])
        seq = 0
        for _ in range(10):
            for c in range(100):
                on_canary = rng.random() < 0.5
                liked = rng.random() < (0.85 if on_canary else 0.95)
                arms[on_canary].append(Rating(f"h{c}", float(liked), seq))
                seq += 1
        units = [u for u in client_pairs(*arms, 10, ended=True) if u.paired]
        location = fenced_mean(units)
        shifts.append(location.estimate - sum(u.difference for u in units) / len(units))
        errors.append(location.error2**0.5)
    assert sum(shifts) / len(shifts) < 0.25 * sum(errors) / len(errors), shifts

"""One key's share of a round and of a gate (learner/fair.py), and the held-out pool
(learner/heldout.py): a client flooding the endpoint cannot fill a round, push the others'
prompts out of the pool, or make the gate judge on its own prompts."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from learner.fair import ANONYMOUS, fair_sample, fair_select, fair_size, key_of, keys_needed
from learner.heldout import HeldoutPool
from ratchet.records import HeldoutPrompt


def owner(item: str) -> str:
    return item.split(":")[0]


def items(**counts: int) -> list[str]:
    """``items(a=2, b=1)`` -> ["a:0", "a:1", "b:0"]: each item names its key."""
    return [f"{key}:{i}" for key, n in counts.items() for i in range(n)]


@pytest.mark.parametrize(
    ("counts", "target", "share", "size"),
    [
        ([10], 8, 0.25, 8),  # one key alone is never held back
        ([10, 10], 8, 0.25, 8),  # two keys: an even split, 4 each
        ([100, 1], 8, 0.25, 2),  # a flood beside one group: 1 + 1
        ([100, 1, 1, 1], 16, 0.25, 4),  # four keys: at most 1 of 4 each
        ([100, 3, 3, 3, 3], 16, 0.25, 16),  # 3 per honest key, a quarter (4) from the flood
        ([5, 5, 5, 5, 5], 16, 0.25, 16),
        ([], 8, 0.25, 0),
    ],
)
def test_fair_size(counts: list[int], target: int, share: float, size: int) -> None:
    assert fair_size(counts, target, share) == size


def test_a_flooding_key_gets_its_share_of_a_round_and_the_rest_wait() -> None:
    # The flood came first: taken in arrival order, it would fill the whole round.
    waiting = items(flood=50, alice=3, bob=3, carol=3, dave=3)
    chosen, passed_over = fair_select(waiting, owner, 16, 0.25)
    shares = Counter(owner(i) for i in chosen)
    assert len(chosen) == 16 and max(shares.values()) <= 4, shares
    assert shares["flood"] == 4 and passed_over == 46  # the flood's surplus, left waiting
    assert chosen[:4] == ["flood:0", "flood:1", "flood:2", "flood:3"]  # oldest first


def test_without_keys_everything_is_one_key() -> None:
    assert key_of(None) == ANONYMOUS == key_of("")
    chosen, passed_over = fair_select(items(anon=20), owner, 16, 0.25)
    assert len(chosen) == 16 and passed_over == 0


def test_the_cap_holds_for_every_mix() -> None:
    rng = random.Random(7)
    for _ in range(300):
        counts = {f"k{k}": rng.randint(1, 30) for k in range(rng.randint(1, 8))}
        pool = items(**counts)
        rng.shuffle(pool)
        share = rng.choice([0.1, 0.25, 0.5])
        chosen, _ = fair_select(pool, owner, 16, share)
        allowed = max(share, 1 / len(counts))
        taken = Counter(owner(i) for i in chosen)
        assert all(n <= allowed * len(chosen) + 1e-9 for n in taken.values()), (counts, taken)
        assert len(chosen) == fair_size(list(counts.values()), 16, share)


def test_fair_sample_draws_across_the_whole_list() -> None:
    pool = items(a=100, b=100, c=100, d=100)
    first = fair_sample(pool, owner, 20, 0.25, random.Random("s1"))
    assert first == fair_sample(pool, owner, 20, 0.25, random.Random("s1"))
    assert first != fair_sample(pool, owner, 20, 0.25, random.Random("s2"))
    assert Counter(owner(i) for i in first) == {"a": 5, "b": 5, "c": 5, "d": 5}


# --- the held-out pool ------------------------------------------------------------------------


def prompt(h: str, key: str | None) -> HeldoutPrompt:
    return HeldoutPrompt(
        prompt_hash=h,
        alias="support",
        prompt_messages=[{"role": "user", "content": h}],
        traffic_request_id=h,
        api_key_hash=key,
    )


def test_a_flood_replaces_only_its_own_prompts() -> None:
    pool = HeldoutPool(capacity=10)
    for i in range(5):
        pool.add(prompt(f"honest-{i}", f"key-{i}"))
    for i in range(1000):
        pool.add(prompt(f"flood-{i}", "attacker"))
    assert len(pool) == 10
    assert {h for h in pool if h.startswith("honest")} == {f"honest-{i}" for i in range(5)}
    # The attacker keeps its five newest prompts.
    assert [h for h in pool if h.startswith("flood")] == [f"flood-{i}" for i in range(995, 1000)]


def test_a_full_pool_of_one_key_keeps_its_newest() -> None:
    pool = HeldoutPool(capacity=3)
    for h in ("a", "b", "c", "a", "d"):
        pool.add(prompt(h, None))
    # "a" came again, so it is newer than "b"; the pool holds 3, so "b" went first.
    assert list(pool) == ["c", "a", "d"]


def test_the_gate_draws_at_random_from_the_pools_whole_history() -> None:
    pool = HeldoutPool(capacity=1000)
    for i in range(400):
        pool.add(prompt(f"p{i:03d}", f"key-{i % 8}"))
    drawn = [p.prompt_hash for p in pool.draw(40, 0.25, "0:support:7")]
    assert len(drawn) == 40 and len(set(drawn)) == 40
    assert drawn == [p.prompt_hash for p in pool.draw(40, 0.25, "0:support:7")]  # replayable
    assert drawn != [p.prompt_hash for p in pool.draw(40, 0.25, "0:support:8")]  # per round
    # Not the newest 40: old prompts are drawn as often as new ones.
    assert sum(h < "p200" for h in drawn) >= 10
    # The same prompts arrived in another order: the same draw.
    shuffled = HeldoutPool(capacity=1000)
    for i in reversed(range(400)):
        shuffled.add(prompt(f"p{i:03d}", f"key-{i % 8}"))
    assert drawn == [p.prompt_hash for p in shuffled.draw(40, 0.25, "0:support:7")]


def test_a_key_gets_at_most_its_share_of_the_gates_pairs() -> None:
    pool = HeldoutPool(capacity=1000)
    for i in range(300):
        pool.add(prompt(f"flood-{i}", "attacker"))
    for i in range(30):
        pool.add(prompt(f"honest-{i}", f"key-{i % 3}"))
    assert pool.pairs_available(64, 0.25) == 40  # 10 from each of the four keys
    drawn = pool.draw(64, 0.25, "round")
    assert Counter(key_of(p.api_key_hash) for p in drawn)["attacker"] == 10
    assert len(drawn) == 40


@pytest.mark.parametrize(
    ("counts", "size"),
    [
        ([10], 0),  # one rater: no set can hold it under a fifth
        ([10, 10, 10, 10], 0),  # four raters: still none (the lifted cap gave each a quarter)
        ([10, 10, 10, 10, 10], 20),  # five: an even fifth each
        ([100, 1, 1, 1, 1], 5),  # a flood beside four: a fifth of the set, not a half
    ],
)
def test_an_unlifted_cap_holds_with_few_keys(counts: list[int], size: int) -> None:
    assert fair_size(counts, 20, 0.2, lift=False) == size
    assert fair_size(counts, 20, 0.2) >= size  # lifted (rounds, gates): never smaller


def test_a_reward_set_gives_no_rater_more_than_its_share_below_five_raters() -> None:
    """H-4: with four raters the lifted cap let each fill a quarter of a reward model's ratings;
    unlifted, each is at most max_share of it, so the set is smaller (here: empty)."""
    ratings = items(a=40, b=3, c=3, d=3)
    lifted, _ = fair_select(ratings, owner, len(ratings), 0.2)
    assert Counter(owner(i) for i in lifted)["a"] > 0.2 * len(lifted)
    assert fair_select(ratings, owner, len(ratings), 0.2, lift=False)[0] == []
    five = items(a=40, b=3, c=3, d=3, e=3)
    chosen, _ = fair_select(five, owner, len(five), 0.2, lift=False)
    shares = Counter(owner(i) for i in chosen)
    assert len(chosen) == 15 and max(shares.values()) <= 0.2 * len(chosen), shares
    assert keys_needed(0.2) == 5 and keys_needed(0.25) == 4 and keys_needed(0.3) == 4

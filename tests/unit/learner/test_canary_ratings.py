"""The canary's sequential test on ratings, on simulated rating streams (no Redis, no network)."""

from __future__ import annotations

import itertools
import random

from learner.canary_ratings import (
    Rating,
    client_cap,
    fair_stream,
    mean_drop,
    paired_outcomes,
    rating_test,
)
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.sequential import SequentialTest
from ratchet.settings import CanaryConfig

CONFIG = CanaryConfig(max_feedback_drop=0.1, min_feedback=10, alpha=0.05, max_rating_pairs=256)
RUNS = 1000


def stream(rng: random.Random, mean: float, n: int, prefix: str) -> list[Rating]:
    """Thumbs up/down ratings (1.0 or 0.0) with this mean, each from its own user."""
    return [Rating(f"{prefix}{i}", float(rng.random() < mean)) for i in range(n)]


def run(
    rng: random.Random, active: float, canary: float, config: CanaryConfig = CONFIG
) -> SequentialTest:
    n = config.max_rating_pairs
    return rating_test(stream(rng, active, n, "a"), stream(rng, canary, n, "c"), config, 0.2)


def test_a_pair_is_one_bounded_outcome_whose_mean_is_half_plus_half_the_difference() -> None:
    assert paired_outcomes([1.0, 0.0, 0.5], [0.0, 1.0, 0.5, 1.0]) == [0.0, 1.0, 0.5]
    test = rating_test(
        [Rating(f"a{i}", 0.8) for i in range(4)],
        [Rating(f"c{i}", 0.6) for i in range(4)],
        CONFIG,
        1,
    )
    drop = mean_drop(test)
    assert test.n == 4 and drop is not None and abs(drop - 0.2) < 1e-12


def test_a_client_holds_at_most_its_share_of_every_prefix_of_the_stream() -> None:
    assert [client_cap(0.2, n) for n in (1, 4, 5, 9, 10, 1024)] == [1, 1, 1, 1, 2, 204]
    # Mallory floods first (score 0); the users' ratings (1) come after: her ratings wait and
    # are taken at a fifth of the pace, not first.
    ratings = [Rating("mallory", 0.0)] * 50 + [Rating(f"u{i}", 1.0) for i in range(40)]
    stream = fair_stream(ratings, 0.2)
    assert len(stream) == 50
    for n in range(1, len(stream) + 1):
        assert stream[:n].count(0.0) <= client_cap(0.2, n), n
    assert Rating.decode(Rating("a\tb", 0.25).encode()) == Rating("a\tb", 0.25)


def test_the_stream_only_grows_at_its_end() -> None:
    """The test is replayed from the stored ratings at every check: what it has taken must not
    change as more ratings arrive, or its always-valid guarantee would not hold."""
    rng = random.Random(4)
    clients = ["mallory"] * 30 + [f"u{i % 9}" for i in range(90)]
    rng.shuffle(clients)
    ratings = [Rating(c, rng.random()) for c in clients]
    streams = [fair_stream(ratings[:n], 0.2) for n in range(len(ratings) + 1)]
    for shorter, longer in itertools.pairwise(streams):
        assert longer[: len(shorter)] == shorter


def test_one_client_cannot_decide_the_canary_either_way() -> None:
    """The audit's attack: one key that tells the arms apart rates the canary 0 and the active
    arm 1 (or the reverse). Alone it decided in 13 to 15 pairs; now the stream stops at its first
    rating per arm; among users it cannot roll back an even canary or promote a bad one."""
    for active, canary in ((1.0, 0.0), (0.0, 1.0)):
        test = rating_test([Rating("k", active)] * 500, [Rating("k", canary)] * 500, CONFIG, 0.2)
        assert (test.decision, test.n) == ("continue", 1)
    rng = random.Random(5)

    def users(mean: float) -> list[Rating]:
        return [Rating(f"u{rng.randrange(100)}", float(rng.random() < mean)) for _ in range(256)]

    for _ in range(10):
        # An even canary (both arms 0.6): the flood would show it worse (it may still run out
        # of pairs: two even arms need about 500 to show the 0.1 margin).
        test = rating_test(
            [Rating("k", 1.0)] * 256 + users(0.6),
            [Rating("k", 0.0)] * 256 + users(0.6),
            CONFIG,
            0.2,
        )
        assert test.upper >= test.theta, test.summary()
        # A canary 0.3 worse: the flood would promote it.
        test = rating_test(
            [Rating("k", 0.0)] * 256 + users(0.8),
            [Rating("k", 1.0)] * 256 + users(0.5),
            CONFIG,
            0.2,
        )
        assert test.decision != "pass", test.summary()


def test_the_anonymous_client_of_a_stack_without_keys_decides_alone() -> None:
    """Without API keys every request is one client: nobody to protect, and a cap would only
    stop the test (the dev stack)."""
    alone = [Rating(ANONYMOUS_CLIENT, 1.0)] * 100
    test = rating_test(alone, [Rating(ANONYMOUS_CLIENT, 0.0)] * 100, CONFIG, 0.2)
    assert test.decision == "fail" and test.n == 18  # the betting test at alpha / 2


def test_a_vouching_apps_users_decide_its_canary() -> None:
    """One key whose app tells its 50 users apart by ``user``: each user is a client."""
    rng = random.Random(6)
    users = [f"app:{i}" for i in range(50)]
    active = [Rating(rng.choice(users), float(rng.random() < 0.5)) for _ in range(256)]
    canary = [Rating(rng.choice(users), float(rng.random() < 0.9)) for _ in range(256)]
    assert rating_test(active, canary, CONFIG, 0.2).decision == "pass"


def test_a_clear_difference_is_decided_early_both_ways() -> None:
    rng = random.Random(1)
    better = [run(rng, 0.5, 0.8) for _ in range(200)]
    worse = [run(rng, 0.8, 0.4) for _ in range(200)]
    assert sum(t.decision == "pass" for t in better) >= 190
    assert sum(t.decision == "fail" for t in worse) >= 190
    # Early: far fewer pairs than the fixed maximum (256), with the betting test at alpha / 2.
    assert sorted(t.n for t in better)[100] <= 80
    assert sorted(t.n for t in worse)[100] <= 80


def test_a_tie_keeps_going_when_no_margin_is_allowed() -> None:
    strict = CONFIG.model_copy(update={"max_feedback_drop": 0.0})
    rng = random.Random(2)
    tests = [run(rng, 0.6, 0.6, strict) for _ in range(200)]
    # Neither better nor worse: the test does not promote (it may give up near the end).
    assert sum(t.decision == "pass" for t in tests) <= 200 * strict.alpha
    assert sorted(t.n for t in tests)[20] >= 128
    # Within the margin, a tie is "not worse" and is promoted, given the pairs: thumbs ratings
    # of two equal arms need about 500 pairs to show a mean no more than 0.1 lower.
    patient = CONFIG.model_copy(update={"max_rating_pairs": 1024})
    tests = [run(rng, 0.6, 0.6, patient) for _ in range(100)]
    assert sum(t.decision == "pass" for t in tests) >= 80


def test_a_worse_candidate_is_promoted_at_most_alpha_of_the_time() -> None:
    """At the boundary (exactly max_feedback_drop worse) the false-promotion rate is highest;
    over 1,000 simulated canaries it stays within alpha (plus 3 binomial standard errors)."""
    rng = random.Random(3)
    for active, canary in ((0.6, 0.5), (0.7, 0.5)):
        promoted = sum(run(rng, active, canary).decision == "pass" for _ in range(RUNS))
        bound = CONFIG.alpha + 3 * (CONFIG.alpha * (1 - CONFIG.alpha) / RUNS) ** 0.5
        assert promoted / RUNS <= bound, (active, canary, promoted)

"""The canary's test over clients (learner/canary_clients.py): pure, no Redis."""

from __future__ import annotations

import random

import pytest

from learner.canary_clients import (
    Look,
    client_evidence,
    client_test,
    client_units,
    look_sizes,
    padded,
    raters,
    t_quantile,
    trimmed,
)
from learner.canary_ratings import Rating
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.settings import CanaryConfig

CONFIG = CanaryConfig(min_clients=20, client_ratings=3, max_feedback_drop=0.1, alpha=0.05)


def population(
    rng: random.Random, clients: int, p: float, per_client: int, prefix: str
) -> list[Rating]:
    """``per_client`` thumbs ratings from each of ``clients`` clients, interleaved."""
    ratings = [
        Rating(f"{prefix}{c}", float(rng.random() < p))
        for _ in range(per_client)
        for c in range(clients)
    ]
    return ratings


def test_a_client_is_one_unit_however_much_it_rates() -> None:
    ratings = [Rating("flood", 0.0)] * 500 + [Rating("b", 1.0)] * 2
    assert client_units(ratings, 3) == [0.0]  # b has not rated 3 times yet
    assert client_units(ratings, 3, ended=True) == [0.0, 1.0]
    mixed = [Rating("a", 1.0), Rating("a", 0.0), Rating("a", 0.5), Rating("a", 0.0)]
    assert client_units(mixed, 3) == [0.5]  # the first three, fixed at the third
    assert raters(ratings) == 2


def test_the_units_only_grow_at_their_end() -> None:
    """What makes a look one fixed test: a longer list gives the units of a shorter one first."""
    rng = random.Random(3)
    ratings = [Rating(f"c{rng.randrange(30)}", float(rng.random() < 0.6)) for _ in range(300)]
    previous: list[float] = []
    for n in range(0, 301, 7):
        units = client_units(ratings[:n], 3)
        assert units[: len(previous)] == previous
        previous = units


def test_each_anonymous_rating_is_a_unit() -> None:
    ratings = [Rating(ANONYMOUS_CLIENT, 1.0)] * 4 + [Rating(ANONYMOUS_CLIENT, 0.0)]
    assert client_units(ratings, 3) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert raters(ratings) == 5


def test_trimming_drops_the_extremes_and_yuen_error_uses_the_winsorized_spread() -> None:
    units = [0.0, 0.5, 0.5, 0.6, 0.4, 0.5, 0.5, 0.6, 0.4, 1.0]
    kept = trimmed(units, 0.1)  # one from each end
    assert kept.kept == 8 and kept.mean == pytest.approx(0.5)
    winsorized = [0.4, 0.5, 0.5, 0.6, 0.4, 0.5, 0.5, 0.6, 0.4, 0.6]
    mean = sum(winsorized) / 10
    variance = sum((w - mean) ** 2 for w in winsorized) / 9
    yuen = 9 * variance / (8 * 7)
    # Never more precise than the untrimmed mean with a 0 and a 1 added (padded).
    assert kept.error2 == pytest.approx(max(yuen, padded(units).error2))
    assert kept.error2 > yuen  # ten units this close: the untrimmed floor holds


def test_thumbs_are_not_trimmed_and_never_exact() -> None:
    """Units that are each 0 or 1: a 10% trim of 0.95 approval would keep only ones."""
    units = [1.0] * 38 + [0.0] * 2
    kept = trimmed(units, 0.1)
    assert kept.kept == 42 and kept.mean == pytest.approx(39 / 42)
    assert kept.error2 == pytest.approx(padded(units).error2) and kept.error2 > 0
    # A trim that would leave only ties (a high approval rate over three ratings): none either.
    tied = [1.0] * 36 + [2 / 3] * 4
    assert trimmed(tied, 0.1).mean == pytest.approx(padded(tied).mean)


def test_the_t_quantile_is_close_to_the_tables() -> None:
    # Student's t: 0.975 at 10 df is 2.228, 0.99 at 20 df 2.528, 0.95 at 60 df 1.671.
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=2e-3)
    assert t_quantile(0.99, 20) == pytest.approx(2.528, abs=2e-3)
    assert t_quantile(0.95, 60) == pytest.approx(1.671, abs=1e-3)
    # Exact at few degrees of freedom too, where an expansion in 1/df is far too narrow.
    assert t_quantile(0.99, 1) == pytest.approx(31.821, abs=1e-3)
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(0.995, 3.5) == pytest.approx(4.9, abs=0.2)
    assert t_quantile(0.95, 10_000) == pytest.approx(1.645, abs=1e-3)


def test_looks_are_at_min_clients_doubling() -> None:
    assert look_sizes(CanaryConfig(min_clients=20, max_rating_pairs=200)) == [20, 40, 80, 160]


def test_interim_looks_wait_for_min_clients_and_the_last_look_for_none() -> None:
    """Promotion and rollback wait for the same number of clients on each arm before an interim
    look; the last look decides at any number, the same rule at 19 clients as at 20."""
    worse = [Rating(f"a{i}", 1.0) for i in range(19)], [Rating(f"c{i}", 0.0) for i in range(19)]
    for (active, canary), expected in ((worse, "fail"), (worse[::-1], "pass")):
        rated = [r for r in active for _ in range(3)], canary * 3
        assert client_test(*rated, CONFIG).looks == ()
        assert client_test(*rated, CONFIG, ended=True).decision == expected
    active = [Rating(f"a{i}", 1.0) for i in range(20)] * 3
    canary = [Rating(f"c{i}", 0.0) for i in range(20)] * 3
    assert client_test(active, canary, CONFIG).decision == "fail"
    assert client_test(canary, active, CONFIG).decision == "pass"


def test_a_clear_difference_is_decided_at_the_first_look_both_ways() -> None:
    rng = random.Random(1)
    good = population(rng, 20, 0.9, 3, "a")
    bad = population(rng, 20, 0.3, 3, "c")
    assert client_test(good, bad, CONFIG).decision == "fail"
    assert client_test(bad, good, CONFIG).decision == "pass"


def test_a_look_made_again_on_more_ratings_says_the_same() -> None:
    """A look's data are the first n units of each arm: the ratings that come after change
    nothing it said (the reason the test holds its level however often it is asked)."""
    rng = random.Random(5)
    active = population(rng, 30, 0.7, 3, "a")
    canary = population(rng, 30, 0.7, 3, "c")
    at_20 = client_test(active[:80], canary[:80], CONFIG)  # 20 clients have rated 3 times
    later = client_test(active, canary, CONFIG)
    assert at_20.looks and later.looks[0] == at_20.looks[0]


def test_an_undecided_wait_ends_in_one_look_over_every_client() -> None:
    rng = random.Random(2)
    # 40 clients on each arm with 2 ratings each: none counts before the wait ends (k = 3).
    active = population(rng, 40, 0.7, 2, "a")
    canary = population(rng, 40, 0.7, 2, "c")
    assert client_test(active, canary, CONFIG).looks == ()
    ended = client_test(active, canary, CONFIG, ended=True)
    assert ended.n == 40 and ended.decision in ("pass", "fail")
    assert "look" in ended.reason or "inconclusive" in ended.reason


def test_a_few_clients_that_know_the_arms_are_trimmed_away() -> None:
    """Three keys rating the canary 0 and the active 1 among 60 honest clients rating both arms
    alike move the trimmed drop by less than they move a plain mean of the clients."""
    config = CONFIG.model_copy(update={"client_ratings": 10})
    rng = random.Random(7)
    honest_a = population(rng, 60, 0.7, 10, "h")
    honest_c = population(rng, 60, 0.7, 10, "h")
    attack_a = [Rating(f"x{i}", 1.0) for i in range(3)] * 10
    attack_c = [Rating(f"x{i}", 0.0) for i in range(3)] * 10
    clean = client_evidence(honest_a, honest_c, config)
    attacked = client_evidence(honest_a + attack_a, honest_c + attack_c, config)
    assert clean.ended.last is not None and attacked.ended.last is not None
    trimmed_shift = clean.ended.last.drop - attacked.ended.last.drop
    assert clean.difference is not None and attacked.difference is not None
    plain_shift = clean.difference - attacked.difference
    assert abs(trimmed_shift) < plain_shift / 2, (trimmed_shift, plain_shift)


@pytest.mark.parametrize("seed", range(2))
def test_a_canary_worse_by_the_margin_is_promoted_at_most_alpha_of_the_time(seed: int) -> None:
    rng = random.Random(seed)
    config = CONFIG.model_copy(update={"min_clients": 20})
    promoted = 0
    runs = 300
    for _ in range(runs):
        active = population(rng, 60, 0.7, 3, "a")
        canary = population(rng, 60, 0.6, 3, "c")
        promoted += client_test(active, canary, config, ended=True).decision == "pass"
    # alpha 0.05 in all, the looks' shares added; 300 runs: a binomial sd of 0.013.
    assert promoted / runs <= 0.05 + 3 * 0.013, promoted


def test_no_spread_is_not_taken_for_an_exact_difference() -> None:
    look = Look.of([1.0] * 20, [1.0] * 20, 0.1, 0.01)
    assert look.drop == 0.0 and look.lower < -0.05 and look.upper > 0.05


@pytest.mark.parametrize(
    ("clients", "per_client", "anonymous"), [(40, 1, False), (80, 1, False), (80, 1, True)]
)
def test_thumbs_at_a_high_approval_rate_do_not_promote_a_clearly_worse_canary(
    clients: int, per_client: int, anonymous: bool
) -> None:
    """Canary 0.80 against active 0.95 (0.15 worse, margin 0.1), one thumb per client or a
    stack without keys: trimmed 0/1 units looked exact and this was promoted 17-21% of runs."""
    rng = random.Random(clients + anonymous)
    config = CONFIG.model_copy(update={"client_ratings": per_client})

    def arm(p: float, prefix: str) -> list[Rating]:
        if anonymous:
            return [Rating(ANONYMOUS_CLIENT, float(rng.random() < p)) for _ in range(clients)]
        return population(rng, clients, p, per_client, prefix)

    runs = 300
    promoted = sum(
        client_test(arm(0.95, "a"), arm(0.8, "c"), config, ended=True).decision == "pass"
        for _ in range(runs)
    )
    assert promoted / runs <= 0.05 + 3 * 0.013, promoted


def test_a_vouching_apps_users_decide_its_canary() -> None:
    """One key whose app tells its 50 users apart by ``user``: each user is a client (the same
    ratings under the bare key would be one client, below min_clients)."""
    rng = random.Random(6)
    users = [f"app:{i}" for i in range(50)]
    active = [Rating(rng.choice(users), float(rng.random() < 0.5)) for _ in range(256)]
    canary = [Rating(rng.choice(users), float(rng.random() < 0.9)) for _ in range(256)]
    assert client_test(active, canary, CONFIG).decision == "pass"
    bare = [Rating("app", r.score) for r in active], [Rating("app", r.score) for r in canary]
    assert client_test(*bare, CONFIG, ended=True).decision == "continue"


def test_a_tie_is_not_promoted_when_no_margin_is_allowed() -> None:
    strict = CONFIG.model_copy(update={"max_feedback_drop": 0.0})
    rng = random.Random(2)
    promoted = 0
    for _ in range(200):
        active = population(rng, 60, 0.6, 3, "a")
        canary = population(rng, 60, 0.6, 3, "c")
        promoted += client_test(active, canary, strict, ended=True).decision == "pass"
    assert promoted <= 200 * strict.alpha

"""A canary rating's encoding and the per-client cap the reward-hacking guard keeps (the canary's
test over clients is tests/unit/learner/test_canary_clients.py)."""

from __future__ import annotations

from learner.canary_ratings import Rating, client_cap, rater_share


def test_a_client_holds_at_most_its_cap_of_a_rating_set() -> None:
    assert [client_cap(0.2, n) for n in (1, 4, 5, 9, 10, 1024)] == [1, 1, 1, 1, 2, 204]
    # One client moves a mean by up to twice its share: at most half the margin.
    assert rater_share(0.2, 0.1) == 0.05 and rater_share(0.02, 0.1) == 0.02


def test_a_rating_survives_its_encoding() -> None:
    assert Rating.decode(Rating("a\tb", 0.25).encode()) == Rating("a\tb", 0.25)
    assert Rating.decode(b"user:abc\t1.0") == Rating("user:abc", 1.0)


def test_a_rating_keeps_its_storing_order_across_the_arms() -> None:
    """The counter appends ``\\t<seq>`` to what it stores; a client's tab survives both ways."""
    assert Rating.decode(b"user:abc\t1.0\t17") == Rating("user:abc", 1.0, 17)
    assert Rating.decode(Rating("a\tb", 0.5, 3).encode()) == Rating("a\tb", 0.5, 3)
    assert Rating.decode(b"a\t7\t0.5") == Rating("a\t7", 0.5)  # a score is never digits only

"""The judge-user agreement measures (also judge calibrate's), on fixed values."""

from __future__ import annotations

import pytest

from ratchet.rewards.agreement import (
    agreement,
    decode_pair,
    encode_pair,
    pairwise_agreement,
    probes_agreement,
    ranks,
    spearman,
)
from ratchet.settings import AliasConfig


def test_ranks_share_ties() -> None:
    assert ranks([10, 20, 20, 5]) == [2, 3.5, 3.5, 1]


def test_spearman_known_values() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_pairwise_agreement_counts_ties_half() -> None:
    assert pairwise_agreement([0.9, 0.5, 0.1], [1, 0.5, 0]) == (3, 3)
    assert pairwise_agreement([0.1, 0.5, 0.9], [1, 0.5, 0]) == (0, 3)
    assert pairwise_agreement([0.5, 0.5], [1, 0]) == (0.5, 1)
    assert pairwise_agreement([0.2, 0.9], [1, 1]) == (0, 0)  # equal labels: no pair


def test_agreement_of_a_judge_that_orders_thumbs_like_the_users() -> None:
    # Thumbs: 1 up, 0 down. The judge scores three ups above every down but one down above an up.
    pairs = [(0.9, 1.0), (0.8, 1.0), (0.7, 1.0), (0.2, 1.0), (0.5, 0.0), (0.1, 0.0)]
    measures = agreement(pairs)
    # Pairs of an up and a down: 4 x 2 = 8; the judge orders (0.2 up, 0.5 down) wrongly.
    assert measures.pairs == 6
    assert measures.pairwise_accuracy == pytest.approx(7 / 8)
    assert measures.spearman is not None and 0 < measures.spearman < 1
    assert "pairwise 0.88" in measures.line() and "over 6 rated answers" in measures.line()


def test_agreement_is_not_comparable_while_every_rating_is_alike() -> None:
    measures = agreement([(0.9, 1.0), (0.1, 1.0)])
    assert measures.pairwise_accuracy is None and measures.spearman is None
    assert "not yet comparable" in measures.line()


def test_a_pair_round_trips_through_its_encoding() -> None:
    assert decode_pair(encode_pair(0.25, 1.0).encode()) == (0.25, 1.0)


@pytest.mark.parametrize(
    ("reward", "feedback", "probes"),
    [
        ({"kind": "ruler"}, {}, True),
        ({"kind": "mixed", "verifier": "m:f"}, {}, True),
        ({"kind": "ruler"}, {"judge_agreement": False}, False),
        ({"kind": "verifier", "verifier": "m:f"}, {}, False),  # no judge to compare
        ({"kind": "feedback"}, {}, False),  # the reward model is measured by its own AUC
    ],
)
def test_which_aliases_compare_their_judge_with_their_users(
    reward: dict[str, str], feedback: dict[str, bool], probes: bool
) -> None:
    config = AliasConfig(reward=reward, feedback=feedback, canary={"weight": 0.1})
    assert probes_agreement(config) is probes

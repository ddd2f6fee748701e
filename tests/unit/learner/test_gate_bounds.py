"""What a small gate can decide at all: the arithmetic the RULER gate's integration test
(tests/integration/test_gate.py) relies on, checked here against the gate's own sequential test
so the integration test need not restate it."""

from __future__ import annotations

import pytest

from learner.gate_verdict import sequential_test
from ratchet.settings import GateConfig


def straight_wins_to_pass(max_pairs: int) -> int | None:
    """How many won pairs in a row a default gate of ``max_pairs`` needs to pass; None when it
    fails first (a pass out of reach)."""
    test = sequential_test(GateConfig(min_pairs=1, max_pairs=max_pairs), max_pairs)
    while test.decision == "continue":
        test.update(1.0)
    return test.n if test.decision == "pass" else None


def test_a_four_pair_gate_gives_up_at_its_first_pair_even_when_it_wins() -> None:
    gate = GateConfig(min_pairs=4, max_pairs=4)  # the integration test's gate
    test = sequential_test(gate, 4)
    assert test.update(1.0) == "fail"
    assert test.n == 1 and test.reason.startswith("futile"), test.reason


@pytest.mark.parametrize(("max_pairs", "needed"), [(13, None), (14, 14), (29, 14), (128, 16)])
def test_a_default_gate_passes_only_after_14_straight_wins(
    max_pairs: int, needed: int | None
) -> None:
    # At alpha 0.05 the betting evidence needs 14 wins in a row; with 30 or more pairs the final
    # look takes half of alpha, so the betting half then needs 16.
    assert straight_wins_to_pass(max_pairs) == needed

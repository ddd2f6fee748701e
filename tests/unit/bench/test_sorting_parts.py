"""bench/sorting_parts.py's split of the sorting reward over answers (no model)."""

from __future__ import annotations

import pytest

from bench.sorting_parts import parts_of, rewards_of
from tasks.sorting import generate_prompts


def test_parts_split_the_reward_into_format_and_order() -> None:
    prompts = generate_prompts(3)
    wants = [", ".join(map(str, p["expected"])) for p in prompts]
    texts = [wants[0], f"The numbers are {wants[1]}", "I cannot sort."]
    parts = parts_of(prompts, texts)
    assert parts["list_alone"] == pytest.approx(1 / 3)
    assert parts["order_share"] == pytest.approx(2 / 3)
    assert parts["exactly_sorted"] == pytest.approx(2 / 3)
    assert parts["reward"] == pytest.approx((1.0 + 0.8 + 0.0) / 3)


def test_rewards_are_the_verifiers_per_prompt() -> None:
    prompts = generate_prompts(2)
    texts = [", ".join(map(str, prompts[0]["expected"])), "nothing"]
    assert rewards_of(prompts, texts) == [pytest.approx(1.0), 0.0]

"""The learned reward model: its metrics and loss on fixed sets, the head's training, and the
features of the real embedded model read a group in one pass exactly as answer by answer."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.rewards.reward_model import (
    AnswerFeatures,
    RatedAnswer,
    RewardHead,
    auc,
    bootstrap_metric,
    evaluate,
    fit_head,
    is_eval_rating,
    pairwise_accuracy,
    preference_pairs,
    reward_loss,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rated(prompt: str, answer: str, score: float, key: str = "k") -> RatedAnswer:
    return RatedAnswer(
        prompt_messages=[{"role": "user", "content": prompt}],
        answer=answer,
        score=score,
        key=key,
        prompt_hash=prompt,
        completion_id=f"{prompt}/{answer}",
    )


# --- metrics and loss on fixed sets --------------------------------------------------------------


def test_auc_is_the_chance_a_positive_outranks_a_negative() -> None:
    assert auc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert auc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert auc([0.5, 0.5], [1, 0]) == 0.5  # a tie counts half
    assert auc([0.9, 0.3, 0.6], [1, 0, 0]) == 1.0
    assert auc([0.9, 0.3, 0.6], [1, 1, 0]) == 0.5
    assert auc([0.9], [1]) is None  # no negative: undefined
    # Ratings on a scale: every pair of different ratings counts (Harrell's concordance). Here
    # one of the six is ranked the wrong way round (0.35 rated, 0.2 predicted, below 0.3's 0.3).
    assert auc([0.1, 0.3, 0.2, 0.05], [0.1, 0.3, 0.35, 0.05]) == pytest.approx(5 / 6)
    assert auc([0.5, 0.5], [0.2, 0.2]) is None  # every rating the same: nothing to rank


def test_the_auc_of_scale_ratings_uses_every_pair_not_a_cut_few_answers_pass() -> None:
    """Most answers rated about 0.25 and two above 0.5, by a model that ranks the bulk of the
    ratings well but those two badly: a cut at 0.5 would say 0 (what the two said); every pair
    says the model mostly ranks as users do, with an interval to decide on."""
    rng = np.random.default_rng(0)
    bulk = [float(s) for s in np.clip(0.25 + rng.normal(0, 0.1, 60), 0.0, 0.49)]
    scores = [*bulk, 0.9, 0.8]
    predictions = [s + float(rng.normal(0, 0.05)) for s in bulk] + [0.0, 0.0]
    value = auc(predictions, scores)
    assert value is not None and value > 0.75
    interval = bootstrap_metric(predictions, scores)
    assert interval is not None and interval[0] > 0.6
    # Row chunks (here 3 of 512) count each pair once: copies change no pair's verdict.
    assert auc(predictions * 20, scores * 20) == pytest.approx(value)


def test_preference_pairs_come_from_one_prompts_differently_rated_answers() -> None:
    answers = [
        rated("p", "a", 1.0),
        rated("p", "b", 0.0),
        rated("q", "c", 0.0),
        rated("p", "d", 1.0),
    ]
    assert sorted(preference_pairs(answers)) == [(0, 1), (3, 1)]
    assert pairwise_accuracy([0.9, 0.1, 0.5, 0.05], [(0, 1), (3, 1)]) == 0.5
    assert pairwise_accuracy([0.9, 0.1], []) is None


def test_the_loss_on_a_fixed_batch() -> None:
    logits = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    weight = torch.tensor([0.5, -0.5], dtype=torch.float64)
    pointwise = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-1.0)) + math.log(2.0)) / 3
    pairwise = (math.log1p(math.exp(-3.0)) + math.log1p(math.exp(-1.0))) / 2  # (0,1) and (2,1)
    got = reward_loss(logits, scores, [(0, 1), (2, 1)], weight, l2=0.1)
    assert float(got) == pytest.approx(pointwise + pairwise + 0.1 * 0.5)


def test_the_eval_split_is_by_prompt_stable_and_keyed() -> None:
    held = [is_eval_rating(b"secret", f"prompt-{i}", 0.2) for i in range(2000)]
    assert 0.17 < sum(held) / len(held) < 0.23
    assert held == [is_eval_rating(b"secret", f"prompt-{i}", 0.2) for i in range(2000)]
    # Another secret splits otherwise: a client without ours cannot tell which prompts are held.
    other = [is_eval_rating(b"other", f"prompt-{i}", 0.2) for i in range(2000)]
    assert sum(a != b for a, b in zip(held, other, strict=True)) > 400


def test_the_head_learns_a_direction_and_its_heldout_metrics_say_so() -> None:
    """Ratings follow one hidden feature (with noise); the head, trained on 200, ranks 200 more."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)

    def dataset(n: int, tag: str) -> tuple[torch.Tensor, list[RatedAnswer]]:
        features = torch.randn(n, 16, generator=gen)
        answers = []
        for i in range(n):
            p = 1 / (1 + math.exp(-3 * float(features[i, 3])))
            score = float(rng.random() < p)
            answers.append(rated(f"{tag}{i // 2}", f"a{i}", score, key=f"k{i % 7}"))
        return features, answers

    train_x, train_y = dataset(200, "t")
    test_x, test_y = dataset(200, "e")
    head = fit_head(train_x, train_y, l2=1e-2)
    assert int(head.weight.abs().argmax()) == 3
    result = evaluate(head.predict(test_x), test_y)
    assert result.ratings == 200 and result.auc is not None and result.auc > 0.8
    assert result.auc_interval is not None and result.auc_interval[0] > 0.7
    assert result.pairwise_accuracy is not None and result.pairwise_accuracy > 0.7
    # A head of the wrong sign ranks them backwards: the metric is not a constant.
    flipped = RewardHead(-head.weight, -head.bias, head.mean, head.std)
    assert evaluate(flipped.predict(test_x), test_y).auc < 0.2  # type: ignore[operator]


def test_a_head_round_trips_through_its_file(tmp_path: Path) -> None:
    head = RewardHead(
        torch.tensor([1.0, -2.0]), 0.5, torch.tensor([0.1, 0.2]), torch.tensor([1.0, 2.0])
    )
    head.save(tmp_path)
    loaded = RewardHead.load(tmp_path)
    x = torch.tensor([[0.3, -0.4], [1.0, 2.0]])
    assert loaded.predict(x) == pytest.approx(head.predict(x))


# --- features of the real model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def features(real_answer_features: AnswerFeatures) -> AnswerFeatures:
    return real_answer_features


def test_a_group_read_at_once_equals_each_answer_read_alone(features: AnswerFeatures) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    answers = ["Blue.", "The sky is blue, and so is the sea.", "red"]
    together = features.group(messages, answers)
    assert together.shape == (3, features.size)
    alone = torch.cat([features.group(messages, [a]) for a in answers])
    assert torch.allclose(together, alone, atol=1e-4)

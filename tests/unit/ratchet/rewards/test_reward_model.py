"""The learned reward model: its metrics and loss on fixed sets, the head's training, and the
features of the real embedded model read a group in one pass exactly as answer by answer."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import (
    FEATURE_DEPTH,
    HEAD_FILE,
    AnswerFeatures,
    RewardHead,
    auc,
    bootstrap_metric,
    choose_l2,
    evaluate,
    feature_backbone,
    fit_head,
    is_eval_rating,
    pairwise_accuracy,
    preference_pairs,
    prompt_folds,
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


def test_folds_keep_each_prompts_answers_together_and_split_alike() -> None:
    answers = [rated(f"p{i % 7}", f"a{i}", 0.5) for i in range(30)]
    folds = prompt_folds(answers, 3)
    assert sorted(i for fold in folds for i in fold) == list(range(30))
    for fold in folds:
        assert fold
        prompts = {answers[i].prompt_hash for i in fold}
        others = {answers[i].prompt_hash for f in folds if f is not fold for i in f}
        assert not prompts & others
    assert prompt_folds(answers, 3) == folds


def test_the_l2_chosen_is_the_one_that_ranks_held_out_prompts_best() -> None:
    """Each strength's score is the mean AUC of heads fitted without one fold of prompts, on that
    fold; the choice is the best score. (That strong L2 ranks unseen prompts better on the real
    model's features is bench/reward_model_quality.py's measurement: random features do not
    show it.)"""
    rng = random.Random(1)
    x = torch.randn(120, 40, generator=torch.Generator().manual_seed(1))
    answers = [
        rated(
            f"p{i // 4}",
            f"a{i}",
            min(1.0, max(0.0, 0.5 + 0.2 * float(x[i, 0]) + rng.gauss(0, 0.2))),
        )
        for i in range(120)
    ]
    grid = (1e-3, 1.0, 30.0)
    l2, scores = choose_l2(x, answers, grid=grid, folds=3)
    assert l2 == max(grid, key=lambda g: scores[g])  # type: ignore[arg-type,return-value]
    folds = prompt_folds(answers, 3)
    by_hand = []
    for held in folds:
        rest = [i for i in range(120) if i not in held]
        head = fit_head(x[rest], [answers[i] for i in rest], l2=1.0)
        by_hand.append(auc(head.predict(x[held]), [answers[i].score for i in held]))
    assert scores[1.0] == pytest.approx(float(np.mean(by_hand)))


def test_strengths_that_rank_alike_give_the_strongest() -> None:
    """One feature: any head ranks answers by it, so every strength scores the same AUC."""
    x = torch.arange(24, dtype=torch.float32)[:, None]
    answers = [rated(f"p{i // 3}", f"a{i}", i / 23) for i in range(24)]
    l2, scores = choose_l2(x, answers, grid=(0.1, 1.0, 10.0))
    assert len(set(scores.values())) == 1 and l2 == 10.0


def test_l2_falls_back_to_the_grids_middle_without_prompts_to_fold() -> None:
    x = torch.randn(4, 3)
    answers = [rated("one prompt", f"a{i}", float(i % 2)) for i in range(4)]
    assert choose_l2(x, answers, grid=(0.1, 1.0, 10.0)) == (1.0, {})


def test_the_features_come_from_the_first_two_thirds_of_the_layers() -> None:
    backbone = torch.nn.Module()
    backbone.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(30))
    first = list(backbone.layers)
    cut = feature_backbone(backbone)
    assert len(cut.layers) == round(FEATURE_DEPTH * 30) == 20
    assert list(cut.layers) == first[:20]
    plain = torch.nn.Linear(2, 2)  # no list of layers: used whole
    assert feature_backbone(plain) is plain


def test_a_head_of_other_features_is_refused_not_misread(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    head = RewardHead(torch.tensor([1.0]), 0.0, torch.tensor([0.0]), torch.tensor([1.0]))
    head.save(tmp_path)
    tensors = load_file(str(tmp_path / HEAD_FILE))
    save_file(tensors, str(tmp_path / HEAD_FILE))  # as written before features were named
    with pytest.raises(ValueError, match="trained on other features"):
        RewardHead.load(tmp_path)


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

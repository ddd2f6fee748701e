"""bench/reward_model_quality.py: users' ratings are the task's rule plus their noise, the
held-out prompts are never trained on, and each peer is measured against the rule."""

from __future__ import annotations

import torch

from bench.reward_model_quality import measure, rated_answers, splits
from tasks import get_task


def test_ratings_are_the_rule_plus_noise_and_splits_keep_prompts_apart() -> None:
    prompts = get_task("bullets").load_prompts()[:12]
    answers = [["- " + "\n- ".join(p["expected"]), "no idea"] for p in prompts]
    exact, rule = rated_answers("bullets", prompts, answers, noise=0.0, seed=1)
    assert [a.score for a in exact] == rule and rule[0] == 1.0 and rule[1] == 0.0
    noisy, same_rule = rated_answers("bullets", prompts, answers, noise=0.3, seed=1)
    assert same_rule == rule and [a.score for a in noisy] != rule
    train, held = splits(noisy, eval_prompts=4, train_prompts=6, seed=0)
    train_prompts = {noisy[i].prompt_hash for i in train}
    held_prompts = {noisy[i].prompt_hash for i in held}
    assert len(held_prompts) == 4 and len(train_prompts) == 6 and not train_prompts & held_prompts


def test_a_feature_that_is_the_rule_ranks_unseen_prompts_perfectly() -> None:
    prompts = get_task("bullets").load_prompts()[:20]
    answers = [["- " + "\n- ".join(p["expected"]), p["expected"][0], "no"] for p in prompts]
    rated, rule = rated_answers("bullets", prompts, answers, noise=0.0, seed=1)
    features = torch.tensor([[r] for r in rule])
    train, held = splits(rated, eval_prompts=8, train_prompts=12, seed=0)
    fixed = measure(features, rated, rule, train, held, l2=1e-3)
    chosen = measure(features, rated, rule, train, held, l2=None)
    assert fixed["l2"] == 1e-3 and chosen["l2"] > 1e-3 - 1e-12
    for result in (fixed, chosen):
        assert result["auc_rule"] == result["pairs_rule"] == result["auc_ratings"] == 1.0

"""Learning from users' ratings, its cross-process mechanics, with every decision forced.

An alias says only ``reward: {kind: feedback}``. Scripted users rate every answer by a rule of
the prompt (bulleted-list requests 1, order-extraction requests 0), which a reward model learns
without fail; ``feedback.min_auc`` is at its floor, so the learner's first reward model goes
live. The judge then scores its groups with that model, the learner trains a round on them and
gates the candidate with the same model (threshold 0 on 8 pairs: anything not worse on every
pair passes), and the users decide the canary: they rate the canary's answers 1 and the live
version's 0, and it is promoted.

A canary its users rate down is rolled back in test_learner.py (the canary dislike test, on the
same ratings' test and watcher); the reward model's quality is unit-tested
(tests/unit/learner/test_ratings.py), the canary's decision maths too
(tests/unit/learner/test_canary_ratings.py, tests/unit/learner/test_canary.py); whether a loop
driven by ratings learns is the outcome lane's (tests/outcomes/test_learning_from_ratings.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from embedded.processes import Stack, free_port, wait_until
from embedded.stack import judge_part, learner_part
from judge.service import is_heldout
from ratchet.records import prompt_hash
from ratchet.registry import AliasRoute
from ratchet.rewards.reward_model import is_eval_rating
from ratchet.rewards.reward_status import RewardStatus, reward_model_name
from ratchet.settings import load_settings
from ratchet.store import AdapterStore
from tasks.bullets import load_prompts as bullet_prompts
from tasks.demo import load_prompts as order_prompts
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.integration.scripted_users import (
    canary_favoured,
    first_event,
    judged_groups,
    rate_canary_until_decided,
    send,
)
from tests.integration.test_learner import served_by

pytestmark = pytest.mark.integration

PROMOTED = "lm-rated-up"
HELDOUT_FRACTION = 0.5  # the judge's, for the gate
EVAL_FRACTION = 0.25  # the reward model's (feedback.eval_fraction's default)
RATINGS = 24  # feedback.retrain_every
GATE_PAIRS = 8
ROUND_GROUPS = 4


def liked(prompt: dict[str, Any]) -> bool:
    return prompt in BULLETS


BULLETS = [p for p in bullet_prompts() if "@" not in str(p["messages"])]
ORDERS = [p for p in order_prompts() if "@" not in str(p["messages"])]  # e-mails are redacted


def rated_prompts(secret: bytes) -> list[dict[str, Any]]:
    """RATINGS prompts, half of each kind, chosen so that the reward model's evaluation split
    (by prompt hash) holds both kinds and the judge holds out at least GATE_PAIRS of them: each
    is a fact of the fixed prompts, so the reward model's first training always has both."""
    chosen: list[dict[str, Any]] = []
    for kind in (BULLETS, ORDERS):
        hashes = [(p, prompt_hash(p["messages"], None)) for p in kind]
        evaluated = [p for p, h in hashes if is_eval_rating(secret, h, EVAL_FRACTION)][:2]
        trained = [p for p, h in hashes if not is_eval_rating(secret, h, EVAL_FRACTION)]
        chosen += evaluated + trained[: RATINGS // 2 - len(evaluated)]
    held = [
        p for p in chosen if is_heldout(secret, prompt_hash(p["messages"], None), HELDOUT_FRACTION)
    ]
    assert len(chosen) == RATINGS and len(held) >= GATE_PAIRS, (len(chosen), len(held))
    return chosen


def grouped_prompts(secret: bytes) -> list[dict[str, Any]]:
    """Prompts the judge samples groups for (not held out), not rated: enough for one round even
    if a few groups' answers all come out alike (no spread: the learner drops them), too few
    for a second (leftovers stay under learner.min_groups)."""
    return [
        p
        for p in BULLETS[RATINGS:] + ORDERS[RATINGS:]
        if not is_heldout(secret, prompt_hash(p["messages"], None), HELDOUT_FRACTION)
    ][: 2 * ROUND_GROUPS - 1]


def ratings_config(env: Embedded, home: Path) -> Path:
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)
    config["judge"] = {"consumer_group": "judge-lm-rated", "metrics_port": free_port()}
    config["learner"] = {
        "consumer_group": "learner-lm-rated",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        "batch_groups": ROUND_GROUPS,
        "min_groups": ROUND_GROUPS,
        # What is trained does not matter here, only that a round is: one step at a learning
        # rate that leaves the greedy answers as they were, so the gate's pairs tie (threshold
        # 0 passes them) and no answer the users rate depends on what was learned.
        "steps_per_round": 1,
        "learning_rate": 1e-6,
        "seed": 0,
    }
    alias = {
        "base_model": BASE_MODEL,
        "reward": {"kind": "feedback"},
        "feedback": {"retrain_every": RATINGS, "min_auc": 0.5, "eval_fraction": EVAL_FRACTION},
        "learning": {"group_size": 4, "heldout_fraction": HELDOUT_FRACTION, "dedup_window_s": 0},
        "sampling": {"temperature": 1.0, "max_tokens": 8, "seed": 0},
        "gate": {
            "min_pairs": GATE_PAIRS,
            "max_pairs": GATE_PAIRS,
            "threshold": 0.0,
            "max_tokens": 8,
        },
        # Only the users' ratings decide (the wait for them is longer than the test).
        "canary": {"weight": 0.5, "min_requests": 16, "min_feedback": 4, "feedback_wait_s": 900},
    }
    config["aliases"] = {PROMOTED: alias}
    path = home / "ratings-mechanics.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def progress(started: float, what: str) -> None:
    print(f"[{time.monotonic() - started:5.0f} s] {what}", flush=True)


def by_prompt_kind(prompts: list[dict[str, Any]]) -> Any:
    def rate(i: int, _: str, __: str) -> float:
        return 1.0 if liked(prompts[i]) else 0.0

    return rate


@pytest.mark.timeout(600)
def test_a_reward_model_from_ratings_scores_groups_and_gate_and_ratings_settle_the_canary(
    embedded: Embedded, tmp_path: Path
) -> None:
    config = ratings_config(embedded, tmp_path)
    settings = load_settings(config)
    client = redis.Redis.from_url(embedded.settings.redis_url)
    embedded.registry.write(AliasRoute(alias=PROMOTED, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(PROMOTED)
    rated, grouped = rated_prompts(embedded.secret), grouped_prompts(embedded.secret)
    services = Stack(
        [judge_part(settings, config), learner_part(settings, config)], tmp_path / "services"
    )
    services.start()
    try:
        # The users' first answers, rated: the reward model's training data. Meanwhile the judge
        # can score nothing and only holds prompts out for the gate.
        started = time.monotonic()
        send(embedded, PROMOTED, rated, by_prompt_kind(rated))
        progress(started, "ratings sent")

        def trained() -> bool:
            status = RewardStatus.read(client, PROMOTED)
            return status is not None and status.version >= 1

        # Joining 24 ratings and fitting a head on the base model's features: under a minute.
        wait_until(trained, 180, "a reward model")
        status = RewardStatus.read(client, PROMOTED)
        progress(started, f"reward model: {status}")
        assert status is not None and status.usable and status.auc is not None, status
        assert status.auc > 0.5 and status.trained_ratings + status.eval_ratings == RATINGS

        # Unrated traffic: the judge samples groups and the reward model scores them.
        send(embedded, PROMOTED, grouped, concurrency=4)
        canary = first_event(settings, PROMOTED, {"canary", "reject", "promote"}, timeout_s=300)
        progress(started, f"canary: {canary}")
        services.stop_part("judge")  # nothing to sample now: the canary's answers get the cores
        assert canary["kind"] == "canary", canary
        gate = first_event(settings, PROMOTED, {"gate"}, timeout_s=5)["detail"]
        # Scored by the reward model: its scores are probabilities, not a verifier's 0/1.
        assert gate["pairs"] == GATE_PAIRS, gate
        assert 0.0 < gate["candidate_score"] < 1.0 and 0.0 < gate["incumbent_score"] < 1.0

        # Its users like the canary.
        up, up_arms = rate_canary_until_decided(
            embedded, settings, PROMOTED, order_prompts()[300:396], canary_favoured
        )
        progress(started, "canary decided")
    finally:
        services.stop()

    # The round trained on groups the live reward model scored.
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    trained_on = store.meta(PROMOTED, canary["version"])["group_ids"]
    groups = judged_groups(embedded, trained_on)
    assert len(groups) == len(trained_on) == ROUND_GROUPS, (trained_on, groups)
    judged_by = {g.judge_model for g in groups}
    assert judged_by == {reward_model_name(PROMOTED, status.version)}, judged_by

    assert up["kind"] == "promote" and up["version"] == canary["version"], up
    assert up["detail"]["reason"].startswith("ratings: "), up
    assert served_by(embedded, PROMOTED) == f"{PROMOTED}@v{up['version']}"
    assert up_arms.get("canary", 0) >= 16, up_arms

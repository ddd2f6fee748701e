"""The canary's reward-hacking guard (learner/reward_guard.py): it blocks a canary the reward
model overrates, says "checked" when it looked and found nothing, and says it could not check,
rather than letting the promotion through silently, when too few raters rated either arm
(audit N-15). Its stored word is read back for the console and `ratchet status`."""

from __future__ import annotations

import random

import pytest
import redis

from learner.reward_guard import check_reward_gap, client_capped, guard_share
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.reward_guard_state import GuardResult, guard_line, read_guard, write_guard
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import is_eval_rating
from ratchet.settings import FeedbackConfig

SECRET = b"guard-test"
ACTIVE, CANARY = 3, 4
FEEDBACK = FeedbackConfig()  # max_share 0.2, max_reward_gap 0.15: share 0.075
MIN_ANSWERS = 10


def held_out_hashes(count: int) -> list[str]:
    """Prompt hashes in the reward model's held-out split (the guard looks only at those)."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        digest = f"prompt-{i}"
        if is_eval_rating(SECRET, digest, FEEDBACK.eval_fraction):
            found.append(digest)
        i += 1
    return found


def answers(version: int, raters: int, per_rater: int, score: float) -> list[RatedAnswer]:
    hashes = held_out_hashes(raters * per_rater)
    return [
        RatedAnswer(
            [], "a", score, f"k{r}", hashes[r * per_rater + i], f"{version}-{r}-{i}", version
        )
        for r in range(raters)
        for i in range(per_rater)
    ]


def predicting(overrate: dict[int, float]):
    """A reward model that predicts each answer's rating plus ``overrate`` of its version."""

    def predict(given: list[RatedAnswer]) -> list[float]:
        noise = random.Random(len(given))
        return [a.score + overrate[a.version or 0] + noise.uniform(-0.01, 0.01) for a in given]

    return predict


def check(ratings: list[RatedAnswer], predict=None) -> GuardResult:
    predict = predict or predicting({ACTIVE: 0.0, CANARY: 0.0})
    return check_reward_gap(ratings, ACTIVE, CANARY, predict, SECRET, FEEDBACK, MIN_ANSWERS)


def test_an_overrated_canary_is_blocked_and_an_honest_one_checked() -> None:
    ratings = answers(ACTIVE, 20, 2, 0.6) + answers(CANARY, 20, 2, 0.6)
    hacked = check(ratings, predicting({ACTIVE: 0.0, CANARY: 0.4}))
    assert hacked.outcome == "blocked" and hacked.reason.startswith("reward_hacking:")
    assert hacked.blocks(False) == hacked.reason
    fine = check(ratings)
    assert fine.outcome == "checked" and fine.checked and fine.blocks(True) is None
    assert fine.reason.startswith(
        "checked on 40 canary and 40 active held-out rated answers from 20 and 20 raters"
    )


def test_too_few_raters_could_not_check_and_says_so() -> None:
    """Nine raters rating the canary a hundred times each are nine answers, not 900: under
    min_answers the guard cannot look, and says that instead of nothing (it let the
    promotion through silently)."""
    ratings = answers(ACTIVE, 30, 1, 0.6) + answers(CANARY, 9, 100, 0.6)
    overrated = predicting({ACTIVE: 0.0, CANARY: 0.9})  # would be blocked if it could look
    result = check(ratings, overrated)
    assert result.outcome == "unchecked" and not result.checked
    assert result.reason.startswith("could not check: too few raters (9 < 10 held-out rated ")
    assert "on the canary arm, from 9 raters" in result.reason
    # Off (the default) the promotion goes on, and the reason travels with it; on, it is
    # a rollback that names the setting.
    assert result.blocks(False) is None
    blocked = result.blocks(True)
    assert blocked is not None and blocked.startswith("reward_unchecked: could not check")
    assert "feedback.require_reward_check" in blocked


def test_no_usable_reward_model_could_not_check() -> None:
    ratings = answers(ACTIVE, 12, 1, 0.5) + answers(CANARY, 12, 1, 0.5)
    result = check(ratings, lambda given: None)
    assert result.outcome == "unchecked"
    assert result.reason == "could not check: the alias has no usable reward model"


def test_ratings_on_training_prompts_and_other_versions_are_not_looked_at() -> None:
    trained = [
        RatedAnswer([], "a", 0.5, f"k{i}", f"t{i}", f"c{i}", CANARY)
        for i in range(200)
        if not is_eval_rating(SECRET, f"t{i}", FEEDBACK.eval_fraction)
    ]
    others = answers(2, 30, 1, 0.5)
    result = check(answers(ACTIVE, 30, 1, 0.5) + trained + others)
    assert result.reason.startswith("could not check: too few raters (0 < 10")


def test_one_client_holds_at_most_its_share_of_an_arm() -> None:
    share = guard_share(FEEDBACK)
    assert share == pytest.approx(0.075)
    flood = answers(CANARY, 1, 200, 0.0)
    honest = answers(CANARY, 40, 1, 1.0)
    kept = client_capped(flood + honest, share)
    flooded = sum(a.owner == "k0" for a in kept)
    assert len(kept) > 40 and flooded <= max(1, int(share * len(kept)))
    # Few raters: each counts once, whatever it rated.
    assert len(client_capped(answers(CANARY, 5, 30, 1.0), share)) == 5
    # No keys at all (one anonymous client): all of it counts, there is no one else.
    anonymous = [
        RatedAnswer([], "a", 1.0, "", f"h{i}", f"a{i}", CANARY, client=ANONYMOUS_CLIENT)
        for i in range(30)
    ]
    assert len(client_capped(anonymous, share)) == 30


def test_the_guards_word_is_read_back_for_its_version(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert read_guard(client, "support") is None and guard_line(client, "support", (4,)) is None
    unchecked = GuardResult("unchecked", "could not check: too few raters (3 < 10 ...)")
    write_guard(client, "support", 4, unchecked)
    assert read_guard(client, "support") == (4, unchecked)
    assert guard_line(client, "support", (4, 3)) == (
        "reward guard on v4: could not check: too few raters (3 < 10 ...)"
    )
    assert guard_line(client, "support", (5, None)) is None  # another canary's: not shown
    client.set("ratchet:canary:support:reward_guard", b"{not json")
    assert read_guard(client, "support") is None

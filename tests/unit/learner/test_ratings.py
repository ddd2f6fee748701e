"""Ratings joined with the answers they rate (a real Redis), and a reward model trained on them
with the real embedded model's features, written to the store and used to score answers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import (
    RatingsJoin,
    exchange_key,
    new_ratings_key,
    pending_key,
    read_ratings,
)
from learner.reward_training import RatingsCollector, RewardTrainer
from ratchet.lease import LeaseKeeper
from ratchet.records import FeedbackRecord, TrafficRecord
from ratchet.rewards.reward_model import RewardModels, RewardStatus, reward_store_name
from ratchet.settings import AliasConfig, RatchetSettings, default_home
from ratchet.store import AdapterStore

ALIAS, OTHER = "support", "plain"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    feedback = AliasConfig(
        reward={"kind": "feedback"}, feedback={"retrain_every": 8, "join_ttl_s": 600}
    )
    return RatchetSettings(redis_url=redis_url, home=tmp_path, aliases={ALIAS: feedback, OTHER: {}})


@pytest.fixture
def client(settings: RatchetSettings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url)


def traffic(
    cid: str, prompt: str, answer: str, key: str = "alice", alias: str = ALIAS
) -> TrafficRecord:
    return TrafficRecord(
        request_id=f"req-{cid}",
        endpoint="chat.completions",
        alias=alias,
        request_model=alias,
        response_model=f"{alias}@v1",
        version=1,
        canary_arm="active",
        request={"messages": [{"role": "user", "content": prompt}]},
        response_id=cid,
        choices=[{"index": 0, "message": {"role": "assistant", "content": answer}}],
        status=200,
        latency_ms=10.0,
        api_key_hash=key,
    )


def rating(cid: str, score: float, key: str = "alice") -> FeedbackRecord:
    return FeedbackRecord(completion_id=cid, score=score, api_key_hash=key)


# --- the join ------------------------------------------------------------------------------------


def test_a_rating_joins_its_answer_once(settings: RatchetSettings, client: redis.Redis) -> None:
    join = RatingsJoin(settings, client)
    assert join.on_traffic(traffic("c1", "Hi?", "Hello!")) == "stored"
    assert client.ttl(exchange_key("c1")) > 500  # waits join_ttl_s for its rating
    assert join.on_feedback(rating("c1", 1.0)) == "joined"
    assert join.on_feedback(rating("c1", 0.0)) == "pending"  # its answer is gone: never joined
    assert join.on_feedback(rating("c1", 0.0)) == "duplicate"
    [joined] = read_ratings(client, ALIAS)
    assert (joined.answer, joined.score, joined.key, joined.completion_id) == (
        "Hello!",
        1.0,
        "alice",
        "c1",
    )
    assert joined.prompt_messages == [{"role": "user", "content": "Hi?"}]
    assert int(client.get(new_ratings_key(ALIAS)) or 0) == 1
    # A traffic record read again (a redelivery) does not store its answer twice.
    assert join.on_traffic(traffic("c2", "Hi?", "Hey")) == "stored"
    assert join.on_traffic(traffic("c2", "Hi?", "Hey")) == "duplicate"


def test_a_rating_that_arrives_before_its_answer_waits_for_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    assert join.on_feedback(rating("early", 0.25)) == "pending"
    assert client.ttl(pending_key("early")) > 500
    assert read_ratings(client, ALIAS) == []
    assert join.on_traffic(traffic("early", "Q", "A")) == "joined"
    assert [r.score for r in read_ratings(client, ALIAS)] == [0.25]
    assert not client.exists(pending_key("early"), exchange_key("early"))


def test_only_the_key_that_got_the_answer_rates_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    join.on_traffic(traffic("c1", "Q", "A", key="alice"))
    assert join.on_feedback(rating("c1", 0.0, key="mallory")) == "wrong_key"
    assert join.on_feedback(rating("c1", 1.0, key="alice")) == "joined"
    # Unknown ids wait, then expire: nothing is ever joined for them.
    assert join.on_feedback(rating("never-served", 1.0)) == "pending"
    assert [r.key for r in read_ratings(client, ALIAS)] == ["alice"]


def test_other_aliases_and_failed_answers_are_not_kept(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    assert join.on_traffic(traffic("p1", "Q", "A", alias=OTHER)) == "not_feedback_alias"
    failed = traffic("f1", "Q", "A").model_copy(update={"status": 502, "choices": []})
    assert join.on_traffic(failed) == "no_answer"
    assert client.keys("ratchet:feedback:*") == []


# --- the reward model ----------------------------------------------------------------------------

TOPICS = ["rain", "tea", "maps", "bread", "music", "stars", "boats", "snow", "clocks", "bees"]


def polite(topic: str) -> str:
    return f"Thank you so much for asking! I would be delighted to help you with {topic}."


def curt(topic: str) -> str:
    return f"{topic}. Figure it out."


def test_a_reward_model_learns_what_users_prefer_and_scores_with_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """Users rate polite answers up and curt ones down; the trained model, evaluated on prompts
    it never saw, ranks them the same way, and the judge's scorer uses it."""
    from ratchet.dev.model import prepare_model

    base = prepare_model(default_home(), quiet=True)
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    stopping = threading.Event()
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    trainer = RewardTrainer(settings, client, store, base)
    collector = RatingsCollector(settings, client, trainer, leases, LearnerMetrics(), stopping)
    join = collector.join
    n = 0
    for i in range(24):
        topic = f"{TOPICS[i % len(TOPICS)]} #{i}"
        for answer, score in ((polite(topic), 1.0), (curt(topic), 0.0)):
            cid = f"c{n}"
            n += 1
            join.on_traffic(traffic(cid, f"Tell me about {topic}.", answer, key=f"user{i % 9}"))
            join.on_feedback(rating(cid, score, key=f"user{i % 9}"))
    assert trainer.due(ALIAS)
    collector.retrain_due()

    status = RewardStatus.read(client, ALIAS)
    assert status is not None and status.version == 1, status
    assert status.auc is not None and status.auc > 0.9 and status.usable, status
    assert status.trained_ratings + status.eval_ratings == 48
    meta = store.meta(reward_store_name(ALIAS), 1)
    assert (
        meta["trained_on"]["ratings"] == status.trained_ratings and meta["trained_on"]["keys"] == 9
    )
    assert meta["heldout"]["pairwise_accuracy"] > 0.9
    assert int(client.get(new_ratings_key(ALIAS)) or 0) == 0
    assert not trainer.due(ALIAS)

    models = RewardModels(store.root, base)
    messages = [{"role": "user", "content": "Tell me about kites."}]
    scores, name = models.score(ALIAS, status, messages, [curt("kites"), polite("kites")])
    assert name == f"{ALIAS}.reward@v1" and scores[1] > scores[0]


def test_a_worse_retrain_does_not_stop_a_live_reward_model() -> None:
    from learner.reward_training import _keep_live

    live = RewardStatus(2, usable=True, reason="held-out AUC 0.860 on 45 ratings", auc=0.86)
    worse = RewardStatus(3, usable=False, reason="held-out AUC 0.618, not above 0.65", auc=0.618)
    kept = _keep_live(live, worse)
    assert kept.version == 2 and kept.usable and kept.auc == 0.86
    assert kept.reason == "held-out AUC 0.860 on 45 ratings; v3 not live: " + worse.reason
    # Again: the reason does not grow with every retrain.
    assert _keep_live(kept, worse).reason == kept.reason
    better = RewardStatus(4, usable=True, reason="held-out AUC 0.900", auc=0.9)
    assert _keep_live(kept, better) == better
    assert _keep_live(None, worse) == worse  # nothing live yet: the alias waits, and says why

"""Ratings joined with the answers they rate (a real Redis), and a reward model trained on them
with the real embedded model's features, written to the store and used to score answers."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
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
from ratchet.records import FeedbackRecord, TrafficRecord, utc_now
from ratchet.rewards.agreement import AGREEMENT_QUEUE, to_judge_key
from ratchet.rewards.reward_model import RewardModels, RewardStatus, reward_store_name
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.store import AdapterStore

ALIAS, OTHER, JUDGED = "support", "plain", "judged"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    feedback = AliasConfig(
        reward={"kind": "feedback"}, feedback={"retrain_every": 8, "join_ttl_s": 600}
    )
    plain = {"feedback": {"judge_agreement": False}}  # RULER, not compared with its users
    judged = {"feedback": {"regenerate_window_s": 60}}  # RULER, compared with its users
    return RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        aliases={ALIAS: feedback, OTHER: plain, JUDGED: judged},
    )


@pytest.fixture
def client(settings: RatchetSettings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url)


def traffic(
    cid: str, prompt: str, answer: str, key: str = "alice", alias: str = ALIAS, at: str = ""
) -> TrafficRecord:
    return TrafficRecord(
        ts=at or utc_now(),
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
    assert join.on_traffic(traffic("c1", "Hi?", "Hello!")) == ["stored"]
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
    assert join.on_traffic(traffic("c2", "Hi?", "Hey")) == ["stored"]
    assert join.on_traffic(traffic("c2", "Hi?", "Hey")) == ["duplicate"]


def test_a_rating_that_arrives_before_its_answer_waits_for_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    assert join.on_feedback(rating("early", 0.25)) == "pending"
    assert client.ttl(pending_key("early")) > 500
    assert read_ratings(client, ALIAS) == []
    assert join.on_traffic(traffic("early", "Q", "A")) == ["joined"]
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
    assert join.on_traffic(traffic("p1", "Q", "A", alias=OTHER)) == ["not_feedback_alias"]
    failed = traffic("f1", "Q", "A").model_copy(update={"status": 502, "choices": []})
    assert join.on_traffic(failed) == ["no_answer"]
    assert client.keys("ratchet:feedback:*") == []


def test_a_ruler_alias_queues_rated_answers_for_its_judge_and_trains_nothing(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    assert join.on_traffic(traffic("j1", "Q", "A", alias=JUDGED)) == ["stored"]
    assert join.on_feedback(rating("j1", 0.75)) == "joined"
    [queued] = [json.loads(raw) for raw in client.lrange(to_judge_key(JUDGED), 0, -1)]
    assert (queued["answer"], queued["score"], queued["completion_id"]) == ("A", 0.75, "j1")
    assert read_ratings(client, JUDGED) == [] and not client.exists(new_ratings_key(JUDGED))


def test_the_queue_for_the_judge_keeps_only_the_newest(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    for i in range(AGREEMENT_QUEUE + 5):
        join.on_traffic(traffic(f"q{i}", f"Q{i}", "A", alias=JUDGED))
        join.on_feedback(rating(f"q{i}", 1.0))
    queued = [
        json.loads(raw)["completion_id"] for raw in client.lrange(to_judge_key(JUDGED), 0, -1)
    ]
    assert queued == [f"q{i}" for i in range(5, AGREEMENT_QUEUE + 5)]


def at(seconds: float) -> str:
    return datetime.fromtimestamp(1_800_000_000 + seconds, UTC).isoformat()


def test_asking_the_same_prompt_again_rates_the_first_answer_down(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """regenerate_window_s (60 here): the same key, the same prompt, within the window."""
    join = RatingsJoin(settings, client)
    assert join.on_traffic(traffic("r1", "Q", "first", alias=JUDGED, at=at(0))) == ["stored"]
    assert join.on_traffic(traffic("r2", "Q", "again", alias=JUDGED, at=at(20))) == [
        "stored",
        "implicit",
    ]
    [implicit] = [json.loads(raw) for raw in client.lrange(to_judge_key(JUDGED), 0, -1)]
    assert (implicit["completion_id"], implicit["answer"], implicit["score"]) == ("r1", "first", 0)
    # Rated once: the user's own rating of it afterwards is never joined.
    assert join.on_feedback(rating("r1", 1.0)) == "pending"


def test_no_implicit_rating_across_keys_prompts_windows_or_explicit_ratings(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = RatingsJoin(settings, client)
    join.on_traffic(traffic("a1", "Q", "x", key="alice", alias=JUDGED, at=at(0)))
    assert join.on_traffic(traffic("b1", "Q", "x", key="bob", alias=JUDGED, at=at(1))) == ["stored"]
    assert join.on_traffic(traffic("a2", "Other", "x", alias=JUDGED, at=at(2))) == ["stored"]
    # Too late: 61 s after alice's first ask.
    assert join.on_traffic(traffic("a3", "Q", "x", alias=JUDGED, at=at(61))) == ["stored"]
    # Rated by the user first: asking again does not rate it a second time.
    join.on_traffic(traffic("c1", "P", "x", key="carol", alias=JUDGED, at=at(100)))
    assert join.on_feedback(rating("c1", 1.0, key="carol")) == "joined"
    assert join.on_traffic(traffic("c2", "P", "y", key="carol", alias=JUDGED, at=at(110))) == [
        "stored"
    ]
    # Off (the default) for the other aliases.
    join.on_traffic(traffic("s1", "Q", "x", at=at(0)))
    assert join.on_traffic(traffic("s2", "Q", "x", at=at(1))) == ["stored"]
    scores = [json.loads(raw)["score"] for raw in client.lrange(to_judge_key(JUDGED), 0, -1)]
    assert scores == [1.0]


# --- the reward model ----------------------------------------------------------------------------

TOPICS = ["rain", "tea", "maps", "bread", "music", "stars", "boats", "snow", "clocks", "bees"]


def polite(topic: str) -> str:
    return f"Thank you so much for asking! I would be delighted to help you with {topic}."


def curt(topic: str) -> str:
    return f"{topic}. Figure it out."


def test_a_reward_model_learns_what_users_prefer_and_scores_with_it(
    settings: RatchetSettings, client: redis.Redis, real_base_model: Path
) -> None:
    """Users rate polite answers up and curt ones down; the trained model, evaluated on prompts
    it never saw, ranks them the same way, and the judge's scorer uses it."""
    base = real_base_model
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

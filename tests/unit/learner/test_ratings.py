"""Ratings joined with the answers they rate (a real Redis), and a reward model trained on them
with the real embedded model's features, written to the store and used to score answers."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from learner import reward_training
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import (
    ANSWER_EXCERPT_CHARS,
    PROMPT_EXCERPT_CHARS,
    Outcome,
    RatingsJoin,
    asked_key,
    exchange_key,
    new_ratings_key,
    pending_key,
    ratings_key,
    read_ratings,
)
from learner.reward_training import RatingsCollector, RewardTrainer, too_few_raters
from ratchet.lease import LeaseKeeper
from ratchet.records import (
    FEEDBACK_TOPIC,
    TRAFFIC_TOPIC,
    DeadLetter,
    FeedbackRecord,
    TrafficRecord,
    prompt_hash,
    utc_now,
)
from ratchet.rewards.agreement import (
    AGREEMENT_QUEUE,
    MAX_REPLAYED_REQUEST_CHARS,
    RatedExchange,
    to_judge_key,
)
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import (
    FEATURES,
    HEAD_FILE,
    L2_GRID,
    AnswerFeatures,
    Evaluation,
    RewardModels,
    RewardModelUnavailable,
)
from ratchet.rewards.reward_status import RewardStatus, reward_store_name
from ratchet.secrets import client_source, hash_api_key, server_secret
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
        secret="ratings-test",  # the same evaluation split on every run
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


class TrafficLog:
    """ratchet.traffic as the join sees it: records at (partition, offset), read back by them."""

    def __init__(self) -> None:
        self.records: list[TrafficRecord | None] = []
        self.fetched = 0

    def fetch(self, partition: int, offset: int) -> TrafficRecord | None:
        assert partition == 0
        self.fetched += 1
        return self.records[offset]


class Join(RatingsJoin):
    """The join, fed as the collector feeds it: each traffic record where the log put it."""

    def __init__(self, settings: RatchetSettings, client: redis.Redis) -> None:
        self.log = TrafficLog()
        super().__init__(settings, client, self.log.fetch)

    def served(self, record: TrafficRecord) -> list[Outcome]:
        self.log.records.append(record)
        return self.on_traffic(record, 0, len(self.log.records) - 1)


# --- the join ------------------------------------------------------------------------------------


def test_a_rating_joins_its_answer_once(settings: RatchetSettings, client: redis.Redis) -> None:
    join = Join(settings, client)
    assert join.served(traffic("c1", "Hi?", "Hello!")) == ["stored"]
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
    assert join.served(traffic("c2", "Hi?", "Hey")) == ["stored"]
    assert join.served(traffic("c2", "Hi?", "Hey")) == ["duplicate"]


def tool_call(city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {
        "id": "call-1",
        "type": "function",
        "function": {"name": "weather", "arguments": arguments},
    }


def test_an_answer_that_is_a_tool_call_alone_is_rated_with_its_call(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """An agent's answer is often a call with no text: it is rated like any other, and what the
    reward model reads of it is the call, not an empty text."""
    join = Join(settings, client)
    record = traffic("t1", "Weather in Oslo?", "")
    record.choices[0]["message"] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call("Oslo")],
    }
    assert join.served(record) == ["stored"]
    assert join.on_feedback(rating("t1", 1.0)) == "joined"
    [joined] = read_ratings(client, ALIAS)
    call = {"type": "function", "function": tool_call("Oslo")["function"]}
    assert (joined.answer, joined.tool_calls) == ("", [call])
    assert joined.message == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert "Oslo" in joined.text and joined.text.startswith("<tool_call>")
    # A call's arguments are bounded as the text is.
    record = traffic("t2", "Weather?", "")
    record.choices[0]["message"] = {
        "role": "assistant",
        "tool_calls": [tool_call("x" * 100_000)] * 3,
    }
    assert join.served(record) == ["stored"]
    assert join.on_feedback(rating("t2", 0.0)) == "joined"
    big = read_ratings(client, ALIAS)[-1]
    assert big.tool_calls is not None and len(big.tool_calls) == 1
    assert len(big.tool_calls[0]["function"]["arguments"]) == ANSWER_EXCERPT_CHARS - len("weather")
    # An answer with neither text nor calls has nothing to rate.
    assert join.served(traffic("t3", "Weather?", "")) == ["no_answer"]


def test_a_rating_that_arrives_before_its_answer_waits_for_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    assert join.on_feedback(rating("early", 0.25)) == "pending"
    assert client.ttl(pending_key("early")) > 500
    assert read_ratings(client, ALIAS) == []
    assert join.served(traffic("early", "Q", "A")) == ["joined"]
    assert [r.score for r in read_ratings(client, ALIAS)] == [0.25]
    assert not client.exists(pending_key("early"), exchange_key("early"))


def test_only_the_key_that_got_the_answer_rates_it(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    join.served(traffic("c1", "Q", "A", key="alice"))
    assert join.on_feedback(rating("c1", 0.0, key="mallory")) == "wrong_key"
    assert join.on_feedback(rating("c1", 1.0, key="alice")) == "joined"
    # Unknown ids wait, then expire: nothing is ever joined for them.
    assert join.on_feedback(rating("never-served", 1.0)) == "pending"
    assert [r.key for r in read_ratings(client, ALIAS)] == ["alice"]


def test_other_aliases_and_failed_answers_are_not_kept(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    assert join.served(traffic("p1", "Q", "A", alias=OTHER)) == ["not_feedback_alias"]
    failed = traffic("f1", "Q", "A").model_copy(update={"status": 502, "choices": []})
    assert join.served(failed) == ["no_answer"]
    assert client.keys("ratchet:feedback:*") == []


def test_a_ruler_alias_queues_rated_answers_for_its_judge_and_trains_nothing(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    assert join.served(traffic("j1", "Q", "A", alias=JUDGED)) == ["stored"]
    assert join.on_feedback(rating("j1", 0.75)) == "joined"
    [queued] = [RatedExchange.decode(raw) for raw in client.lrange(to_judge_key(JUDGED), 0, -1)]
    rated = queued.rated
    assert (rated.answer, rated.score, rated.completion_id) == ("A", 0.75, "j1")
    assert queued.request == {"messages": [{"role": "user", "content": "Q"}]}
    assert read_ratings(client, JUDGED) == [] and not client.exists(new_ratings_key(JUDGED))


def test_the_judge_gets_the_request_whole_with_its_tools_or_not_at_all_when_cut(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """The judge re-samples the rated answer's prompt: the reward model's excerpt of it would
    be another prompt, and without its tools an agent's answers are not the ones served."""
    join = Join(settings, client)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    long_prompt = "context " * 5000  # past the excerpt the reward model keeps
    record = traffic("t1", long_prompt, "A", alias=JUDGED)
    record.request.update(tools=[tool], tool_choice="auto", max_tokens=64, temperature=0.3)
    cut = traffic("t2", "Q", "A", alias=JUDGED)
    cut.truncated = ["request"]
    huge = traffic("t3", "x" * (MAX_REPLAYED_REQUEST_CHARS + 1), "A", alias=JUDGED)
    for served in (record, cut, huge):
        join.served(served)
        assert join.on_feedback(rating(served.response_id or "", 1.0)) == "joined"
    whole, was_cut, too_large = (
        RatedExchange.decode(raw) for raw in client.lrange(to_judge_key(JUDGED), 0, -1)
    )
    assert whole.request == {
        "messages": [{"role": "user", "content": long_prompt}],
        "tools": [tool],
        "tool_choice": "auto",
        "max_tokens": 64,
    }
    assert len(whole.rated.prompt_messages[0]["content"]) < len(long_prompt)
    assert was_cut.request is None and too_large.request is None


def test_the_queue_for_the_judge_keeps_only_the_newest(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    for i in range(AGREEMENT_QUEUE + 5):
        join.served(traffic(f"q{i}", f"Q{i}", "A", alias=JUDGED))
        join.on_feedback(rating(f"q{i}", 1.0))
    queued = [
        RatedExchange.decode(raw).rated.completion_id
        for raw in client.lrange(to_judge_key(JUDGED), 0, -1)
    ]
    assert queued == [f"q{i}" for i in range(5, AGREEMENT_QUEUE + 5)]


def at(seconds: float) -> str:
    return datetime.fromtimestamp(1_800_000_000 + seconds, UTC).isoformat()


def test_asking_the_same_prompt_again_rates_the_first_answer_down(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """regenerate_window_s (60 here): the same key, the same prompt, within the window."""
    join = Join(settings, client)
    assert join.served(traffic("r1", "Q", "first", alias=JUDGED, at=at(0))) == ["stored"]
    assert join.served(traffic("r2", "Q", "again", alias=JUDGED, at=at(20))) == [
        "stored",
        "implicit",
    ]
    [queued] = [RatedExchange.decode(raw) for raw in client.lrange(to_judge_key(JUDGED), 0, -1)]
    implicit = queued.rated
    assert (implicit.completion_id, implicit.answer, implicit.score) == ("r1", "first", 0)
    # Rated once: the user's own rating of it afterwards is never joined.
    assert join.on_feedback(rating("r1", 1.0)) == "pending"


def test_no_implicit_rating_across_keys_prompts_windows_or_explicit_ratings(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    join.served(traffic("a1", "Q", "x", key="alice", alias=JUDGED, at=at(0)))
    assert join.served(traffic("b1", "Q", "x", key="bob", alias=JUDGED, at=at(1))) == ["stored"]
    assert join.served(traffic("a2", "Other", "x", alias=JUDGED, at=at(2))) == ["stored"]
    # Too late: 61 s after alice's first ask.
    assert join.served(traffic("a3", "Q", "x", alias=JUDGED, at=at(61))) == ["stored"]
    # Rated by the user first: asking again does not rate it a second time.
    join.served(traffic("c1", "P", "x", key="carol", alias=JUDGED, at=at(100)))
    assert join.on_feedback(rating("c1", 1.0, key="carol")) == "joined"
    assert join.served(traffic("c2", "P", "y", key="carol", alias=JUDGED, at=at(110))) == ["stored"]
    # Off (the default) for the other aliases.
    join.served(traffic("s1", "Q", "x", at=at(0)))
    assert join.served(traffic("s2", "Q", "x", at=at(1))) == ["stored"]
    queued = client.lrange(to_judge_key(JUDGED), 0, -1)
    scores = [RatedExchange.decode(raw).rated.score for raw in queued]
    assert scores == [1.0]


# --- the reward model ----------------------------------------------------------------------------

TOPICS = ["rain", "tea", "maps", "bread", "music", "stars", "boats", "snow", "clocks", "bees"]


def polite(topic: str) -> str:
    return f"Thank you so much for asking! I would be delighted to help you with {topic}."


def curt(topic: str) -> str:
    return f"{topic}. Figure it out."


def reward_trainer(
    settings: RatchetSettings, client: redis.Redis, base: Path, features: AnswerFeatures
) -> tuple[AdapterStore, RewardTrainer, RatingsCollector]:
    """(the store, a trainer on the real features, its collector) for one alias's retrains."""
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    trainer = RewardTrainer(settings, client, store, base, features)
    collector = RatingsCollector(
        settings, client, trainer, leases, LearnerMetrics(), threading.Event()
    )
    return store, trainer, collector


def rate_pair(join: Join, i: int, polite_is_good: bool = True) -> None:
    """A polite and a curt answer to the i-th topic, each rated as users who like polite ones
    (or, ``polite_is_good`` False, curt ones) would."""
    topic = f"{TOPICS[i % len(TOPICS)]} #{i}"
    for answer, score in ((polite(topic), 1.0), (curt(topic), 0.0)):
        cid = f"c{i}-{score}"
        join.served(traffic(cid, f"Tell me about {topic}.", answer, key=f"user{i % 9}"))
        good = score if polite_is_good else 1.0 - score
        join.on_feedback(rating(cid, good, key=f"user{i % 9}"))


def test_a_reward_model_learns_what_users_prefer_and_scores_with_it(
    settings: RatchetSettings,
    client: redis.Redis,
    real_base_model: Path,
    real_answer_features: AnswerFeatures,
) -> None:
    """Users rate polite answers up and curt ones down; the trained model, evaluated on prompts
    it never saw, ranks them the same way, and the judge's scorer uses it."""
    base = real_base_model
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    stopping = threading.Event()
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    trainer = RewardTrainer(settings, client, store, base, real_answer_features)
    collector = RatingsCollector(settings, client, trainer, leases, LearnerMetrics(), stopping)
    join = Join(settings, client)
    n = 0
    for i in range(24):
        topic = f"{TOPICS[i % len(TOPICS)]} #{i}"
        for answer, score in ((polite(topic), 1.0), (curt(topic), 0.0)):
            cid = f"c{n}"
            n += 1
            join.served(traffic(cid, f"Tell me about {topic}.", answer, key=f"user{i % 9}"))
            join.on_feedback(rating(cid, score, key=f"user{i % 9}"))
    assert trainer.due(ALIAS)
    collector.retrain_due()

    status = RewardStatus.read(client, ALIAS)
    assert status is not None and status.version == 1, status
    assert status.auc is not None and status.auc > 0.9 and status.usable, status
    # Both sets capped per key (9 keys, max_share 0.2): a few may be passed over.
    assert 40 <= status.trained_ratings + status.eval_ratings <= 48
    meta = store.meta(reward_store_name(ALIAS), 1)
    assert (
        meta["trained_on"]["ratings"] == status.trained_ratings and meta["trained_on"]["keys"] == 9
    )
    assert meta["heldout"]["pairwise_accuracy"] > 0.9
    assert int(client.get(new_ratings_key(ALIAS)) or 0) == 0
    assert not trainer.due(ALIAS)

    models = RewardModels(store.root, base, real_answer_features)
    messages = [{"role": "user", "content": "Tell me about kites."}]
    scores, name = models.score(ALIAS, status, messages, [curt("kites"), polite("kites")])
    assert name == f"{ALIAS}.reward@v1" and scores[1] > scores[0]

    # The next retrain waits for half as many new ratings as v1 trained on (retrain_growth),
    # not for retrain_every's 8; then v2 is measured beside v1 on the same held-out ratings.
    needed = reward_training.ratings_needed(settings.aliases[ALIAS].feedback, status)
    assert needed == math.ceil(0.5 * status.trained_ratings) > 8
    for i in range(24, 24 + needed):
        topic = f"{TOPICS[i % len(TOPICS)]} #{i}"
        good = i % 2 == 0
        cid = f"c{n}"
        n += 1
        answer = polite(topic) if good else curt(topic)
        join.served(traffic(cid, f"Tell me about {topic}.", answer, key=f"user{i % 9}"))
        join.on_feedback(rating(cid, float(good), key=f"user{i % 9}"))
        assert trainer.due(ALIAS) == (i == 24 + needed - 1), i
    collector.retrain_due()
    second = RewardStatus.read(client, ALIAS)
    assert second is not None and second.version == 2 and second.usable, second
    assert second.auc_low is not None and second.auc_low > 0.55
    meta = store.meta(reward_store_name(ALIAS), 2)
    assert meta["live_on_same_ratings"]["version"] == 1
    assert meta["live_on_same_ratings"]["ratings"] == meta["heldout"]["ratings"]
    assert meta["seconds"] > 0


def test_the_reward_model_tells_tool_calls_apart(real_answer_features: AnswerFeatures) -> None:
    """Two answers that are calls alone, with different arguments, are two answers to the reward
    model (read as their text alone, both were the empty answer)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    rated = [
        RatedAnswer(messages, "", 1.0, "k", "p", f"c{i}", tool_calls=[tool_call(city)])
        for i, city in enumerate(("Oslo", "Lima"))
    ]
    oslo, lima = real_answer_features.rated(rated)
    assert float((oslo - lima).abs().max()) > 1e-3


def test_users_who_change_their_minds_bring_the_retrain_forward(
    settings: RatchetSettings,
    client: redis.Redis,
    real_base_model: Path,
    real_answer_features: AnswerFeatures,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """v1 learns that users like polite answers; then they come to prefer curt ones. The live
    model's agreement with the ratings since (features computed a batch a poll, ahead of the
    retrain) falls below its held-out lower bound, so v2 is trained at retrain_every's 8 new
    ratings, not at the 17 or so retrain_growth would wait for."""
    caplog.set_level("INFO", logger="learner.reward_training")
    _, _, collector = reward_trainer(settings, client, real_base_model, real_answer_features)
    join = Join(settings, client)

    for i in range(24):
        rate_pair(join, i, polite_is_good=True)
    collector.retrain_due()
    live = RewardStatus.read(client, ALIAS)
    assert live is not None and live.version == 1 and live.usable and live.auc_low is not None
    needed = reward_training.ratings_needed(settings.aliases[ALIAS].feedback, live)
    assert needed >= 16
    i = 24
    while (status := RewardStatus.read(client, ALIAS)) is not None and status.version == 1:
        assert i < 24 + needed // 2, "no early retrain"
        rate_pair(join, i, polite_is_good=False)  # two ratings: a polite answer down, a curt one up
        i += 1
        for _ in range(3):  # the polls between ratings: warm a batch, look, retrain when due
            collector.retrain_due()
    new_ratings = 2 * (i - 24)
    assert 8 <= new_ratings < needed, (new_ratings, needed)
    assert status is not None and status.version == 2
    assert "retrain due early: live v1's AUC on the" in caplog.text


def test_a_model_trained_on_other_features_scores_nothing_and_is_retrained_soon(
    settings: RatchetSettings,
    client: redis.Redis,
    real_base_model: Path,
    real_answer_features: AnswerFeatures,
) -> None:
    """v1 as a release before the features moved wrote it (no features named in its head file):
    the judge's scorer refuses it rather than read today's features with it, and the learner
    retrains at retrain_every's 8 new ratings, not at the 17 or so retrain_growth would wait for.
    A new version records its features and the L2 its cross-validation chose."""
    from safetensors.torch import load_file, save_file

    store, trainer, collector = reward_trainer(
        settings, client, real_base_model, real_answer_features
    )
    join = Join(settings, client)

    for i in range(24):
        rate_pair(join, i)
    collector.retrain_due()
    live = RewardStatus.read(client, ALIAS)
    assert live is not None and live.version == 1 and live.usable
    meta = store.meta(reward_store_name(ALIAS), 1)
    assert meta["features"] == FEATURES and meta["l2"] in L2_GRID
    assert set(meta["l2_cross_validated"]) == {repr(g) for g in L2_GRID}
    head_file = store.root / f"{reward_store_name(ALIAS)}@v1" / HEAD_FILE
    save_file(load_file(str(head_file)), str(head_file))  # rewritten without its features
    models = RewardModels(store.root, real_base_model, real_answer_features)
    messages = [{"role": "user", "content": "Tell me about kites."}]
    with pytest.raises(RewardModelUnavailable, match="trained on other features"):
        models.score(ALIAS, live, messages, [curt("kites"), polite("kites")])
    needed = reward_training.ratings_needed(settings.aliases[ALIAS].feedback, live)
    assert needed >= 16
    for i in range(24, 28):  # 8 new ratings
        rate_pair(join, i)
    assert trainer.due(ALIAS)
    collector.retrain_due()
    second = RewardStatus.read(client, ALIAS)
    assert second is not None and second.version == 2 and second.usable, second
    scores, name = RewardModels(store.root, real_base_model, real_answer_features).score(
        ALIAS, second, messages, [curt("kites"), polite("kites")]
    )
    assert name == f"{ALIAS}.reward@v2" and scores[1] > scores[0]


class CountingFeatures:
    """Features that cost nothing, counting the answers asked for."""

    def __init__(self) -> None:
        self.computed: list[str] = []

    def rated(self, answers: list[RatedAnswer]) -> list[Any]:
        import torch

        self.computed += [a.completion_id for a in answers]
        return [torch.zeros(4) for _ in answers]


def test_the_features_of_new_ratings_are_computed_a_batch_a_poll_and_once(
    settings: RatchetSettings, client: redis.Redis, tmp_path: Path
) -> None:
    features = CountingFeatures()
    trainer = RewardTrainer(
        settings,
        client,
        AdapterStore(tmp_path / "s"),
        tmp_path,
        features,  # type: ignore[arg-type]
    )
    join = Join(settings, client)
    for i in range(40):
        join.served(traffic(f"c{i}", f"prompt {i}", "an answer"))
        join.on_feedback(rating(f"c{i}", float(i % 2)))
    batch = reward_training.WARM_BATCH
    assert [trainer.warm(ALIAS) for _ in range(4)] == [batch, batch, 40 - 2 * batch, 0]
    assert sorted(features.computed) == sorted(f"c{i}" for i in range(40))  # each once
    join.served(traffic("c40", "prompt 40", "an answer"))
    join.on_feedback(rating("c40", 1.0))
    assert trainer.warm(ALIAS) == 1 and features.computed[-1] == "c40"
    # A retrain consumed them (the counter drops): the next ones are looked at from scratch.
    client.set(new_ratings_key(ALIAS), 0)
    assert trainer.warm(ALIAS) == 0
    client.set(new_ratings_key(ALIAS), 3)
    assert trainer.warm(ALIAS) == 0 and len(features.computed) == 41  # cached already


def evaluation(auc: float, low: float, ratings: int = 100) -> Evaluation:
    return Evaluation(ratings, auc, (low, min(1.0, 2 * auc - low)), 0, None)


def test_a_reward_model_goes_live_on_its_aucs_lower_bound_and_only_if_no_worse_than_live() -> None:
    from learner.reward_training import reward_verdict

    # 0.80 on a handful of ratings: an interval down to a coin, not live.
    usable, why = reward_verdict(evaluation(0.80, 0.50, 13), None, 0.55)
    assert not usable and why == (
        "held-out AUC 0.800 [0.500, 1.000] on 13 ratings, its lower bound not above "
        "feedback.min_auc 0.55"
    )
    # 0.66 on many: its lower bound clears the bar.
    assert reward_verdict(evaluation(0.66, 0.60), None, 0.55) == (
        True,
        "held-out AUC 0.660 [0.600, 0.720] on 100 ratings",
    )
    # A model is live: the new one must rank the same held-out ratings at least as well.
    usable, why = reward_verdict(evaluation(0.66, 0.60), (3, evaluation(0.70, 0.64)), 0.55)
    assert not usable and why.endswith("below live v3's 0.700 on the same ratings")
    assert reward_verdict(evaluation(0.72, 0.66), (3, evaluation(0.70, 0.64)), 0.55)[0]
    assert reward_verdict(Evaluation(10, None, None, 0, None), None, 0.55) == (
        False,
        "no held-out AUC",
    )


def test_fewer_raters_than_the_cap_allows_train_no_reward_model_and_say_so(
    settings: RatchetSettings,
    client: redis.Redis,
    real_base_model: Path,
    real_answer_features: AnswerFeatures,
) -> None:
    """H-4: four raters (max_share 0.2 needs five) no longer lift the cap to a quarter each:
    no model is trained, and the status says it could not check, and why."""
    _, _, collector = reward_trainer(settings, client, real_base_model, real_answer_features)
    join = Join(settings, client)
    for i in range(24):
        topic = f"{TOPICS[i % len(TOPICS)]} #{i}"
        for answer, score in ((polite(topic), 1.0), (curt(topic), 0.0)):
            cid = f"c{i}-{score}"
            join.served(traffic(cid, f"Tell me about {topic}.", answer, key=f"user{i % 4}"))
            join.on_feedback(rating(cid, score, key=f"user{i % 4}"))
    collector.retrain_due()
    status = RewardStatus.read(client, ALIAS)
    assert status is not None and not status.usable and status.version == 0, status
    assert status.reason.startswith("could not check: too few raters (4 < 5;"), status.reason


def test_retrains_grow_rarer_as_ratings_pile_up() -> None:
    from learner.reward_training import ratings_needed
    from ratchet.settings import FeedbackConfig

    config = FeedbackConfig()  # retrain_every 64, retrain_growth 0.5
    assert ratings_needed(config, None) == 64
    assert ratings_needed(config, RewardStatus(1, True, "", trained_ratings=100)) == 64
    assert ratings_needed(config, RewardStatus(4, True, "", trained_ratings=600)) == 300
    fixed = FeedbackConfig(retrain_growth=0)
    assert ratings_needed(fixed, RewardStatus(4, True, "", trained_ratings=600)) == 64


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


# --- what Redis holds, and its bounds ------------------------------------------------------------

BIG_PROMPT = "x" * (900 * 1024)  # as large as a traffic record gets


def test_redis_keeps_a_note_per_answer_and_reads_the_prompt_back_only_when_rated(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    assert join.served(traffic("big", BIG_PROMPT, "A" * 100_000)) == ["stored"]
    note = client.get(exchange_key("big"))
    assert note is not None and len(note) < 512 and join.log.fetched == 0
    assert join.on_feedback(rating("big", 1.0)) == "joined"
    assert join.log.fetched == 1
    [joined] = read_ratings(client, ALIAS)
    assert len(joined.prompt_messages[0]["content"]) == PROMPT_EXCERPT_CHARS
    assert len(joined.answer) == ANSWER_EXCERPT_CHARS
    assert joined.prompt_messages[0]["content"] == BIG_PROMPT[:PROMPT_EXCERPT_CHARS]
    keys = client.keys("ratchet:feedback:*")
    assert len(keys) >= 6 and all(client.ttl(k) > 0 for k in keys), keys


def test_a_rating_whose_record_kafka_no_longer_has_is_dropped(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(settings, client)
    join.served(traffic("old", "Q", "A"))
    join.log.records[0] = None  # past retention
    assert join.on_feedback(rating("old", 1.0)) == "gone"
    assert read_ratings(client, ALIAS) == [] and not client.exists(exchange_key("old"))


def bounded(settings: RatchetSettings, **feedback: int) -> RatchetSettings:
    config = settings.aliases[ALIAS].model_copy(
        update={"feedback": settings.aliases[ALIAS].feedback.model_copy(update=feedback)}
    )
    return settings.model_copy(update={"aliases": {**settings.aliases, ALIAS: config}})


def rate(
    join: Join, cid: str, score: float, key: str, prompt: str = "Q", answer: str = "A"
) -> None:
    assert join.served(traffic(cid, prompt, answer, key=key)) == ["stored"]
    assert join.on_feedback(rating(cid, score, key=key)) == "joined"


def test_a_flood_of_ratings_from_one_client_replaces_only_its_own(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(bounded(settings, max_ratings=10), client)
    for i in range(5):
        rate(join, f"honest{i}", 1.0, f"user{i}")
    for i in range(100):
        rate(join, f"flood{i}", 0.0, "mallory")
    kept = read_ratings(client, ALIAS)
    assert [r.completion_id for r in kept] == [f"honest{i}" for i in range(5)] + [
        f"flood{i}" for i in range(95, 100)
    ]
    assert client.zscore(f"{ratings_key(ALIAS)}:clients", "mallory") == 5
    assert client.llen(f"{ratings_key(ALIAS)}:owners") == 10


def test_the_ratings_kept_are_bounded_in_bytes(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    join = Join(bounded(settings, max_ratings_bytes=1024 * 1024), client)
    long = "y" * (2 * PROMPT_EXCERPT_CHARS)
    for i in range(60):  # ~32 KiB each once cut to the excerpts: ~2 MiB offered
        rate(join, f"c{i}", float(i % 2), f"user{i % 7}", prompt=long, answer=long)
    raw = client.lrange(ratings_key(ALIAS), 0, -1)
    size = sum(len(r) for r in raw)
    assert 20 < len(raw) < 60 and size <= 1024 * 1024
    assert int(client.get(f"{ratings_key(ALIAS)}:bytes") or 0) == size
    assert raw[-1] == client.lindex(ratings_key(ALIAS), -1)  # the newest is kept


# --- one bad record ------------------------------------------------------------------------------


def test_ids_that_are_not_ids_are_refused_and_an_odd_regenerate_note_is_ignored(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """vLLM echoes a client's request_id as the completion id: a tab in it once killed the
    collector (the regenerate note was split at the first tab)."""
    join = Join(settings, client)
    assert join.served(traffic("evil\t1", "Q", "x", alias=JUDGED, at=at(0))) == ["bad_id"]
    assert join.on_feedback(rating("evil\t1", 1.0)) == "bad_id"
    assert join.on_feedback(rating("x" * 300, 1.0)) == "bad_id"
    # A note an older version (or anyone with Redis) left: no signal, no crash.
    client.set(asked_key(JUDGED, "alice", prompt_hash([{"role": "user", "content": "Q"}])), "a\tb")
    assert join.served(traffic("r1", "Q", "x", alias=JUDGED, at=at(1))) == ["stored"]
    assert join.served(traffic("r2", "Q", "y", alias=JUDGED, at=at(2))) == ["stored", "implicit"]


@dataclass
class Message:
    topic: str
    value: bytes
    partition: int
    offset: int


class Sink:
    def __init__(self) -> None:
        self.sent: list[DeadLetter] = []

    def send(self, letters: list[DeadLetter]) -> None:
        self.sent += letters

    def close(self) -> None:
        pass


def test_a_record_the_join_cannot_take_is_dead_lettered_and_the_rest_joined(
    settings: RatchetSettings, client: redis.Redis, tmp_path: Path
) -> None:
    sink = Sink()
    trainer = RewardTrainer(settings, client, AdapterStore(tmp_path / "s"), tmp_path)
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    metrics = LearnerMetrics()
    collector = RatingsCollector(
        settings,
        client,
        trainer,
        leases,
        metrics,
        threading.Event(),
        sink,  # type: ignore[arg-type]
    )
    good = traffic("good", "Q", "A")
    collector.join = Join(settings, client)
    collector.join.log.records = [good]
    client.set(exchange_key("broken"), b"{not json")  # a note no version of the join wrote
    collector.take(
        [
            Message(FEEDBACK_TOPIC, rating("broken", 1.0).to_json(), 0, 7),
            Message(TRAFFIC_TOPIC, good.to_json(), 0, 0),
            Message(FEEDBACK_TOPIC, rating("good", 1.0).to_json(), 0, 8),
        ]
    )
    [letter] = sink.sent
    assert (letter.source_topic, letter.offset, letter.reason) == (
        FEEDBACK_TOPIC,
        7,
        "handler_error",
    )
    assert [r.completion_id for r in read_ratings(client, ALIAS)] == ["good"]
    assert metrics.ratings_joined.labels("dead_lettered")._value.get() == 1


# --- clients, not keys ---------------------------------------------------------------------------


def test_the_evaluation_set_is_capped_per_client_like_the_training_set(
    settings: RatchetSettings, client: redis.Redis, tmp_path: Path
) -> None:
    trainer = RewardTrainer(settings, client, AdapterStore(tmp_path / "s"), tmp_path)
    answers = [RatedAnswer([], "a", 1.0, "mallory", f"p{i}", f"m{i}") for i in range(400)] + [
        RatedAnswer([], "a", 1.0, f"k{i % 9}", f"q{i}", f"h{i}") for i in range(90)
    ]
    trained, held, _ = trainer.split(answers, 0.25, 0.2)
    for chosen in (trained, held):
        flooded = sum(a.owner == "mallory" for a in chosen)
        assert len(chosen) > 20 and flooded <= 0.2 * len(chosen) + 1e-9, (flooded, len(chosen))
    # The newest of a flooder's ratings are the ones kept.
    assert max(int(a.completion_id[1:]) for a in trained if a.owner == "mallory") > 390


def test_a_stack_without_keys_trains_on_all_its_ratings_and_a_few_keys_on_none(
    settings: RatchetSettings, client: redis.Redis, tmp_path: Path
) -> None:
    """Auth off: every rating is the one anonymous client's, whom no cap can tell from another
    (the dev stack learns from its ratings); with keys, fewer than 1/share raters train nothing."""
    trainer = RewardTrainer(settings, client, AdapterStore(tmp_path / "s"), tmp_path)
    anonymous = [RatedAnswer([], "a", float(i % 2), "-", f"p{i}", f"m{i}") for i in range(80)]
    trained, held, passed_over = trainer.split(anonymous, 0.25, 0.2)
    assert len(trained) + len(held) == 80 and passed_over == 0
    assert too_few_raters(anonymous, 0.2) is None
    keyed = [RatedAnswer([], "a", 1.0, f"k{i % 3}", f"p{i}", f"m{i}") for i in range(80)]
    assert "too few raters (3 < 5" in (too_few_raters(keyed, 0.2) or "")


def test_a_one_key_app_with_fifty_users_trains_a_reward_model(
    settings: RatchetSettings,
    client: redis.Redis,
    real_base_model: Path,
    real_answer_features: AnswerFeatures,
) -> None:
    """One backend key, its users told apart by `user` (a key in proxy.user_vouching_keys: the
    proxy writes each record's source as below): each user is a client, so the per-client caps
    leave all of them in, and the model learns what they like."""
    secret = server_secret(settings)
    app = hash_api_key(secret, "app-key")
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    trainer = RewardTrainer(settings, client, store, real_base_model, real_answer_features)
    join = Join(settings, client)
    for user in range(50):
        # Two users to a prompt: its answers are read in one forward pass (half the test's time).
        topic = f"{TOPICS[user % 25 % len(TOPICS)]} #{user % 25}"
        for answer, score in ((polite(topic), 1.0), (curt(topic), 0.0)):
            cid = f"u{user}-{score:.0f}"
            record = traffic(cid, f"Tell me about {topic}.", answer, key=app or "")
            record = record.model_copy(
                update={"source": client_source(secret, app, f"user-{user}")}
            )
            assert join.served(record) == ["stored"]
            assert join.on_feedback(rating(cid, score, key=app or "")) == "joined"
    # Two other apps, a few ratings each: counted by key, the app would be one of three clients
    # and kept to a third of each set.
    for other in ("other-a", "other-b"):
        for i in range(4):
            rate(join, f"{other}-{i}", float(i % 2), other, f"{other} {i}?", polite(other))
    status = trainer.train(ALIAS)
    assert status.usable and status.auc is not None and status.auc > 0.9, status
    assert status.trained_ratings + status.eval_ratings == 108  # no user passed over
    assert store.meta(reward_store_name(ALIAS), 1)["trained_on"]["keys"] > 30


class FailingTrainer:
    """Due, and failing, every time it is asked."""

    def __init__(self) -> None:
        self.tries = 0

    def due(self, alias: str) -> bool:
        return True

    def train(self, alias: str) -> RewardStatus:
        self.tries += 1
        raise OSError("No space left on device")


def test_no_retrain_starts_while_a_round_trains_the_policy(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    """The collector's thread shares the learner's cores: a due retrain waits for the round's
    training to end, then runs."""
    trainer = FailingTrainer()
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    training = threading.Event()
    collector = RatingsCollector(
        settings,
        client,
        trainer,  # type: ignore[arg-type]
        leases,
        LearnerMetrics(),
        threading.Event(),
        Sink(),  # type: ignore[arg-type]
        policy_training=training,
    )
    collector.join = Join(settings, client)
    training.set()
    for _ in range(3):
        collector.retrain_due()
    assert trainer.tries == 0
    training.clear()
    collector.retrain_due()
    assert trainer.tries == 1


def test_a_failing_retrain_backs_off_instead_of_running_on_every_poll(
    settings: RatchetSettings, client: redis.Redis
) -> None:
    trainer = FailingTrainer()
    leases = AliasLeases(client, 30.0, LeaseKeeper(), LearnerMetrics(), "reward_model")
    metrics = LearnerMetrics()
    collector = RatingsCollector(
        settings,
        client,
        trainer,  # type: ignore[arg-type]
        leases,
        metrics,
        threading.Event(),
        Sink(),  # type: ignore[arg-type]
    )
    collector.join = Join(settings, client)

    def pause_after_polls() -> float:
        for _ in range(5):  # polls in a row: one try
            collector.retrain_due()
        failures, retry_at = collector._backoff[ALIAS]
        collector._backoff[ALIAS] = (failures, 0.0)  # as if the pause were over
        return retry_at - time.monotonic()

    first = pause_after_polls()
    assert trainer.tries == 1
    assert metrics.failures.labels(ALIAS, "reward_model")._value.get() == 1
    assert first == pytest.approx(reward_training.RETRAIN_BACKOFF_S, abs=5)
    second = pause_after_polls()
    assert trainer.tries == 2 and second == pytest.approx(2 * first, abs=5)
    for _ in range(8):
        last = pause_after_polls()
    assert last == pytest.approx(reward_training.RETRAIN_BACKOFF_MAX_S, abs=5)

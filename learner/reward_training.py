"""Training an alias's reward model from its users' ratings, and the thread that feeds it.

:class:`RatingsCollector` reads ``ratchet.traffic`` and ``ratchet.feedback`` from the start (as
its own consumer group), joins ratings with the answers they rate (learner/ratings.py), and once
an alias with ``reward.kind: feedback`` has enough new joined ratings (:func:`ratings_needed`),
or ``retrain_every`` of them with which the live model agrees less than its held-out ratings
promised (:meth:`RewardTrainer.agreement_drop`), and no round is training the policy in this
process, :class:`RewardTrainer` trains a new version under the alias's lease. Until then it
computes the new ratings' features, a batch a poll (:meth:`RewardTrainer.warm`): the retrain
finds them cached, and the agreement can be looked at. The retrain:

1. split the ratings by prompt: ``feedback.eval_fraction`` of the prompts are never trained on
   (a split keyed with the server secret, so no client can aim at it);
2. cap each client (a rating's ``owner``: its key, or a vouching key's user) at
   ``feedback.max_share`` of the training set and of the evaluation set (learner/fair.py);
3. fit the head on the frozen base model's features (ratchet/rewards/reward_model.py);
4. evaluate on the held-out ratings: AUC with a bootstrap interval, pairwise accuracy, and
   the live model on the same ratings;
5. write ``<alias>.reward@v<N>`` to the store (atomic, immutable, with its counts, metrics and
   seconds), then the alias's RewardStatus in Redis: it goes live only while its AUC's lower
   bound is above ``feedback.min_auc`` and it ranks the held-out ratings no worse than the live
   model (:func:`reward_verdict`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
from kafka.errors import KafkaError

from learner.canary import RewardPredictor
from learner.exchanges import TrafficFetcher, read_exchanges
from learner.fair import fair_select, keys_needed
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import RatingsJoin, new_ratings_key, newest_ratings, read_ratings
from ratchet.lifecycle import EventSink
from ratchet.records import ANONYMOUS_CLIENT, DeadLetter, FeedbackRecord, TrafficRecord, decode
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import (
    AnswerFeatures,
    Evaluation,
    RewardHead,
    RewardModels,
    RewardModelUnavailable,
    auc,
    choose_l2,
    evaluate,
    fit_head,
    good_ratings,
    is_eval_rating,
    write_meta,
)
from ratchet.rewards.reward_status import RewardStatus, reward_model_name, reward_store_name
from ratchet.secrets import server_secret
from ratchet.settings import FeedbackConfig, RatchetSettings
from ratchet.store import AdapterStore

log = logging.getLogger(__name__)

FEATURE_CACHE = 50_000  # rated answers whose features are kept between retrains
# New ratings whose features one poll computes ahead of the retrain (a few seconds on two cores):
# short enough that a round starting meanwhile waits little for the cores.
WARM_BATCH = 16


class RewardTrainer:
    """Trains and publishes reward model versions (see the module docstring)."""

    def __init__(
        self,
        settings: RatchetSettings,
        client: redis.Redis,
        store: AdapterStore,
        base_model_path: Path,
        features: AnswerFeatures | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.store = store
        self.base_model_path = base_model_path
        # Loaded on first use unless given: the frozen base model is read-only, so one may serve
        # several trainers (the tests share one).
        self._features = features
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.secret = server_secret(settings)
        # alias -> ((live version, new ratings) last checked, why a retrain was due or None)
        self._agreement: dict[str, tuple[tuple[int, int], str | None]] = {}
        self._heads: dict[str, tuple[int, RewardHead]] = {}  # alias -> its live head, loaded once
        self._warmed: dict[str, int] = {}  # alias -> new ratings whose features are all cached

    @property
    def features(self) -> AnswerFeatures:
        if self._features is None:
            self._features = AnswerFeatures(self.base_model_path)
        return self._features

    def due(self, alias: str) -> bool:
        """A retrain is due on :func:`ratings_needed` new ratings, or sooner, on
        ``retrain_every`` of them, where the live model agrees with them less than its own
        held-out ratings promised (:meth:`agreement_drop`)."""
        config = self.settings.aliases[alias].feedback
        new = self.new_ratings(alias)
        live = RewardStatus.read(self.redis, alias)
        if new >= ratings_needed(config, live):
            return True
        return new >= config.retrain_every and self.agreement_drop(alias, live, new) is not None

    def agreement_drop(self, alias: str, live: RewardStatus | None, new: int) -> str | None:
        """Why the live model no longer ranks what users say as well as when it went live: its
        AUC on the ``new`` ratings since the last retrain (none of which it trained on) below
        the lower end of its held-out AUC's interval; None while it does, or while those
        ratings' features are not all computed yet (:meth:`warm` computes them, a batch a poll,
        so this never holds the collector for long)."""
        if live is None or not live.usable or not live.version or live.auc_low is None:
            return None
        checked = (live.version, new // WARM_BATCH)  # looked at again every WARM_BATCH ratings
        last = self._agreement.get(alias)
        if last is not None and last[0] == checked:
            return last[1]
        head = self._live_head(alias, live.version)
        if head is None:  # unreadable, or trained on other features: it scores nothing now
            why: str | None = f"live v{live.version} cannot score (see the log): retrain"
            self._agreement[alias] = (checked, why)
            return why
        answers = newest_ratings(self.redis, alias, new)
        if not answers or any(a.completion_id not in self._cache for a in answers):
            return None
        value = auc(head.predict(self.rows(answers)), [a.score for a in answers])
        why = None
        if value is not None and value < live.auc_low:
            why = (
                f"live v{live.version}'s AUC on the {len(answers)} ratings since the last retrain "
                f"is {value:.3f}, below its held-out lower bound {live.auc_low:.3f}"
            )
            log.info("%s: reward model retrain due early: %s", alias, why)
        self._agreement[alias] = (checked, why)
        return why

    def _live_head(self, alias: str, version: int) -> RewardHead | None:
        """The live version's head, loaded once while it stays live; None if unreadable."""
        cached = self._heads.get(alias)
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            head = RewardHead.load(self.store.root / reward_model_name(alias, version))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("%s: live reward model v%d unreadable: %s", alias, version, exc)
            return None
        self._heads[alias] = (version, head)
        return head

    def new_ratings(self, alias: str) -> int:
        """Ratings joined since the last retrain."""
        return int(self.redis.get(new_ratings_key(alias)) or 0)

    def unwarmed(self, alias: str, new: int) -> int:
        """How many of the ``new`` ratings :meth:`warm` has not looked at yet."""
        warmed = self._warmed.get(alias, 0)
        return new if warmed > new else new - warmed  # warmed > new: a retrain consumed them

    def warm(self, alias: str, limit: int = WARM_BATCH) -> int:
        """Compute the features of up to ``limit`` of the ratings since the last retrain that
        have none yet: the retrain then finds them cached (it is that much shorter when a round
        starts beside it), and :meth:`agreement_drop` can look. Returns how many it computed."""
        new = self.new_ratings(alias)
        unseen = self.unwarmed(alias, new)
        if unseen <= 0:
            return 0
        fresh = newest_ratings(self.redis, alias, unseen)  # only those not looked at
        missing = [a for a in fresh if a.completion_id not in self._cache]
        if missing:
            self.rows(missing[:limit])
        if len(missing) <= limit:
            self._warmed[alias] = new
        return min(len(missing), limit)

    def rows(self, answers: list[RatedAnswer]) -> Any:
        """Features of rated answers, computed once per completion and cached."""
        import torch

        missing = [a for a in answers if a.completion_id not in self._cache]
        if missing:
            for answer, row in zip(missing, self.features.rated(missing), strict=True):
                self._cache[answer.completion_id] = row
                if len(self._cache) > FEATURE_CACHE:
                    self._cache.popitem(last=False)
        return torch.stack([self._cache[a.completion_id] for a in answers])

    def split(
        self, answers: list[RatedAnswer], eval_fraction: float, share: float
    ) -> tuple[list[RatedAnswer], list[RatedAnswer], int]:
        """(training set, evaluation set, ratings passed over for the cap): the evaluation
        prompts by the keyed split, and in each set no client above ``share``, its newest kept."""
        evaluated = [is_eval_rating(self.secret, a.prompt_hash, eval_fraction) for a in answers]
        newest_first = list(zip(answers, evaluated, strict=True))[::-1]
        pool = [a for a, held in newest_first if not held]
        # The cap on what the model learns from is not lifted below 1/share raters
        # (learner/fair.py): too few raters train no model, rather than one fitted to one or
        # two raters' taste. A stack without keys has no raters to tell apart (every rating is
        # the anonymous client's, whom the operator trusts by turning auth off): no cap there.
        lift = anonymous_only(answers)
        trained, passed_over = fair_select(pool, owner_of, len(pool), share, lift=lift)
        # The evaluation decides whether the model is used at all: no client may own it either.
        # Its few prompts may come from fewer raters than the training set's: an even split.
        held_out = [a for a, held in newest_first if held]
        held, _ = fair_select(held_out, owner_of, len(held_out), share)
        return trained, held, passed_over

    def train(self, alias: str) -> RewardStatus:
        config = self.settings.aliases[alias].feedback
        started = time.monotonic()
        answers = read_ratings(self.redis, alias)
        consumed = self.new_ratings(alias)
        trained, held, passed_over = self.split(answers, config.eval_fraction, config.max_share)
        why = too_few_raters(answers, config.max_share) or _cannot_train(trained, held)
        previous = RewardStatus.read(self.redis, alias)
        if why is not None:
            self.redis.decrby(new_ratings_key(alias), consumed)
            status = _keep_live(previous, RewardStatus(version=0, usable=False, reason=why))
            status.write(self.redis, alias)
            log.info("%s: reward model not trained: %s", alias, why)
            return status
        trained_rows = self.rows(trained)
        l2, l2_scores = choose_l2(trained_rows, trained)
        head = fit_head(trained_rows, trained, l2=l2)
        held_rows = self.rows(held)
        result = evaluate(head.predict(held_rows), held)
        live = self.live_on(alias, previous, held, held_rows)
        usable, reason = reward_verdict(result, live, config.min_auc)
        clients = len({a.owner for a in trained})
        meta = write_meta(result, len(trained), clients, str(self.base_model_path), l2, l2_scores)
        meta["trained_on"]["passed_over_for_key_share"] = passed_over
        if live is not None:
            meta["live_on_same_ratings"] = {"version": live[0], **live[1].to_dict()}
        meta["seconds"] = round(time.monotonic() - started, 3)
        name = reward_store_name(alias)
        version = max(self.store.folder_versions(name), default=0) + 1
        self.store.write_folder(name, version, head.save, meta)
        newest = RewardStatus(
            version=version,
            usable=usable,
            reason=reason,
            auc=result.auc,
            trained_ratings=len(trained),
            eval_ratings=len(held),
            auc_low=result.auc_interval[0] if result.auc_interval else None,
        )
        status = _keep_live(previous, newest)
        pipe = self.redis.pipeline(transaction=True)
        status.write(pipe, alias)
        pipe.decrby(new_ratings_key(alias), consumed)
        pipe.execute()
        log.info(
            "%s: reward model v%d trained on %d ratings in %.1fs: %s (usable: %s)",
            alias,
            version,
            len(trained),
            time.monotonic() - started,
            reason,
            usable,
        )
        return status

    def live_on(
        self, alias: str, live: RewardStatus | None, held: list[RatedAnswer], held_rows: Any
    ) -> tuple[int, Evaluation] | None:
        """The live model on the new model's held-out ratings (its version, its evaluation):
        both versions measured on the same ratings, so they compare. None: none is live, or its
        files are gone."""
        if live is None or not live.usable or not live.version:
            return None
        head = self._live_head(alias, live.version)
        if head is None:
            return None
        return live.version, evaluate(head.predict(held_rows), held)


def ratings_needed(config: FeedbackConfig, live: RewardStatus | None) -> int:
    """New ratings before the next retrain: ``retrain_every``, or ``retrain_growth`` times the
    ratings the live model was trained on where that is more."""
    trained = live.trained_ratings if live is not None else 0
    return max(config.retrain_every, math.ceil(config.retrain_growth * trained))


def reward_verdict(
    new: Evaluation, live: tuple[int, Evaluation] | None, min_auc: float
) -> tuple[bool, str]:
    """Whether a newly trained model may give rewards, and why, in RewardStatus's words: the
    lower end of its held-out AUC's 95% interval above ``min_auc``, and, where a model is live,
    an AUC on the same held-out ratings not below the live one's (a retrain on more ratings can
    still rank worse: the live one then stays)."""
    if new.auc is None or new.auc_interval is None:
        return False, "no held-out AUC"
    low, high = new.auc_interval
    reason = f"held-out AUC {new.auc:.3f} [{low:.3f}, {high:.3f}] on {new.ratings} ratings"
    if low <= min_auc:
        return False, f"{reason}, its lower bound not above feedback.min_auc {min_auc}"
    if live is not None and live[1].auc is not None and new.auc < live[1].auc:
        return False, f"{reason}, below live v{live[0]}'s {live[1].auc:.3f} on the same ratings"
    return True, reason


def owner_of(answer: RatedAnswer) -> str:
    return answer.owner


def _keep_live(previous: RewardStatus | None, newest: RewardStatus) -> RewardStatus:
    """The status to publish: the newest model when it may give rewards; else the one giving
    them now stays live (a retrain on drifted ratings must not stop an alias that learns), with
    why the newest is not."""
    if newest.usable or previous is None or not previous.usable:
        return newest
    what = f"v{newest.version}" if newest.version else "a retrain"
    reason = previous.reason.split("; ", 1)[0]
    return replace(previous, reason=f"{reason}; {what} not live: {newest.reason}")


def anonymous_only(answers: list[RatedAnswer]) -> bool:
    """Every rating came without a key (auth off: one anonymous client, ratchet.records)."""
    return bool(answers) and all(a.owner == ANONYMOUS_CLIENT for a in answers)


def too_few_raters(answers: list[RatedAnswer], share: float) -> str | None:
    """Why no model can be trained with each rater at most ``share`` of it, if that is why
    (never on a stack without keys, where raters cannot be told apart: see ``split``)."""
    raters, needed = len({a.owner for a in answers}), keys_needed(share)
    if raters >= needed or anonymous_only(answers):
        return None
    return (
        f"could not check: too few raters ({raters} < {needed}; "
        f"none may be more than feedback.max_share {share:g} of the ratings)"
    )


def _cannot_train(trained: list[RatedAnswer], held: list[RatedAnswer]) -> str | None:
    for what, answers in (("training", trained), ("held-out", held)):
        if good_ratings([a.score for a in answers]) is None:
            return f"the {what} ratings ({len(answers)}) need both good and bad ones"
    return None


def reward_predictor(client: redis.Redis, models: RewardModels) -> RewardPredictor:
    """The live reward model's predicted rating of each answer (None: the alias has no usable
    model), for the canary's reward-hacking guard."""

    def predict(alias: str, answers: list[RatedAnswer]) -> list[float] | None:
        status = RewardStatus.read(client, alias)
        if status is None or not status.usable:
            return None
        try:
            return [models.score(alias, status, a.prompt_messages, [a.text])[0][0] for a in answers]
        except RewardModelUnavailable:
            return None

    return predict


# A failed retrain waits this long before the next try, doubling with each failure in a row.
RETRAIN_BACKOFF_S = 30.0
RETRAIN_BACKOFF_MAX_S = 600.0


class RatingsCollector:
    """Joins ratings with answers, and retrains reward models when due. Runs in its own thread."""

    def __init__(
        self,
        settings: RatchetSettings,
        client: redis.Redis,
        trainer: RewardTrainer,
        leases: AliasLeases,
        metrics: LearnerMetrics,
        stopping: threading.Event,
        sink: EventSink | None = None,
        policy_training: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.fetcher = TrafficFetcher(settings)
        self.join = RatingsJoin(settings, client, self.fetcher)
        self.trainer = trainer
        self.leases = leases
        self.metrics = metrics
        self.stopping = stopping
        self.sink = sink or EventSink(settings)
        # Set while a round trains the policy in this process: a retrain then waits, so that
        # the two never share the cores (issue 35: a round beside retrains ran at a third of
        # its speed). A retrain under way when a round starts finishes.
        self.policy_training = policy_training or threading.Event()
        # alias -> (failures in a row, monotonic time before which it is not tried again)
        self._backoff: dict[str, tuple[int, float]] = {}

    def run(self) -> None:
        # Every rating is training data: a new group starts at the beginning.
        try:
            read_exchanges(
                self.settings, "-ratings", "earliest", self.stopping, self.take, self.retrain_due
            )
        finally:
            self.fetcher.close()
            self.sink.close()

    def take(self, messages: list[Any]) -> None:
        dead: list[DeadLetter] = []
        for message in messages:
            try:
                outcomes = self.take_one(message)
            except (KafkaError, redis.RedisError, OSError):
                raise  # an outage, not this record's fault: the batch is read again
            except Exception as exc:
                # One record the join cannot take must not stop the others (nor the thread).
                log.exception("exchange at %s:%d not joined", message.topic, message.offset)
                consumer = self.settings.learner.consumer_group + "-ratings"
                error = f"{type(exc).__name__}: {exc}"
                dead.append(DeadLetter.of_message(message, consumer, "handler_error", error))
                outcomes = ["dead_lettered"]
            for outcome in outcomes:
                if outcome != "not_feedback_alias":
                    self.metrics.ratings_joined.labels(outcome).inc()
        self.sink.send(dead)  # before the batch's offsets are committed

    def take_one(self, message: Any) -> list[str]:
        record = decode(message.topic, message.value)
        if isinstance(record, TrafficRecord):
            return list(self.join.on_traffic(record, message.partition, message.offset))
        if isinstance(record, FeedbackRecord):
            return [self.join.on_feedback(record)]
        return []  # another schema or malformed: counted by decode's caller elsewhere

    def retrain_due(self) -> None:
        if self.policy_training.is_set():
            return  # between rounds; the ratings keep being joined meanwhile
        for alias in sorted(self.join.feedback_aliases()):
            failures, retry_at = self._backoff.get(alias, (0, 0.0))
            if self.stopping.is_set() or time.monotonic() < retry_at:
                continue
            if not self.trainer.due(alias):
                self._warm(alias)
                continue
            try:
                self._retrain(alias)
            except Exception:
                # Called on every poll: without a pause a failing retrain (a full store, a
                # rating that breaks the fit) would be redone, features and all, every second.
                failures += 1
                pause = min(RETRAIN_BACKOFF_MAX_S, RETRAIN_BACKOFF_S * 2 ** (failures - 1))
                self._backoff[alias] = (failures, time.monotonic() + pause)
                self.metrics.failures.labels(alias, "reward_model").inc()
                log.exception("%s: reward model retrain failed; next try in %.0f s", alias, pause)
            else:
                self._backoff.pop(alias, None)

    def _warm(self, alias: str) -> None:
        # Called on every poll: the lease is asked for only when there is something to compute.
        if self.trainer.unwarmed(alias, self.trainer.new_ratings(alias)) <= 0:
            return
        # Under the same lease as the retrain: only the replica that will train computes.
        with self.leases.hold(reward_store_name(alias)) as lease:
            if lease is not None:
                self.trainer.warm(alias)

    def _retrain(self, alias: str) -> None:
        # A lease of its own (<alias>.reward): training a reward model must not hold up the
        # alias's rounds and canary decisions, which read only the finished versions.
        with self.leases.hold(reward_store_name(alias)) as lease:
            if lease is None:
                return  # another replica trains it: its turn
            started = time.monotonic()
            status = self.trainer.train(alias)
            m = self.metrics
            m.round_seconds.labels(alias, "reward_model").observe(time.monotonic() - started)
            m.reward_model_version.labels(alias).set(status.version)
            if status.auc is not None:
                m.reward_model_auc.labels(alias).set(status.auc)
            if status.auc_low is not None:
                m.reward_model_auc_low.labels(alias).set(status.auc_low)

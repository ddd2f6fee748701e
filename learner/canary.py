"""The canary: a gated candidate serves a share of live traffic before it becomes the active one.

While an alias has a canary, the watcher reads ``ratchet.traffic`` and ``ratchet.feedback`` and
counts, per arm (the proxy marks each exchange ``active`` or ``canary``), requests, upstream
failures (:data:`UPSTREAM_FAILURES`: what the model server did, never what a client provoked),
and user ratings (one per completion, from the key that got it). The counts live in Redis
(``ratchet:canary:<alias>``), each arm's ratings in arrival order beside them
(``ratchet:canary:<alias>:ratings:<arm>``), all reset in the same transaction that starts the
canary, so a restarted learner carries on counting. Once the canary arm has ``min_requests``,
:func:`canary_verdict` decides: roll back if its error rate is worse than the active arm's beyond
the configured margin; otherwise the ratings' sequential test (learner/canary_ratings.py)
promotes or rolls back as soon as it can. Ratings lag the answers they rate, so a canary the
test has not decided waits up to ``feedback_wait_s``, then is judged on error rate and the
ratings' point estimate (of at least :func:`estimate_pairs`) — at once if neither arm has a
single rating while the active arm has answered :data:`UNRATED_AFTER` times ``min_requests``:
an alias whose users don't rate.

The watcher also counts every alias's requests per minute, canary or not
(learner/canary_weight.py): the next canary's share is sized by them.

Every learner replica runs a watcher. Their consumer group splits the topics' partitions between
them, so each record is counted once, into the shared counts; which arm a completion id was
answered by is shared too (``ratchet:canary:completion:<id>``), because its feedback may be read
by another replica than its traffic record. Only the replica holding the alias's lease
(learner/leases.py) decides, and only on the canary it read: a second decision finds the canary
gone and changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import redis

from learner.canary_ratings import (
    Rating,
    client_cap,
    mean_drop,
    rater_share,
    rating_test,
    stored_cap,
)
from learner.canary_weight import count_requests, minute_of
from learner.exchanges import read_exchanges
from learner.guard import reward_model_gap
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import newest_ratings
from ratchet.canary_state import (
    ARMS,
    ArmStats,
    canary_key,
    raters_key,
    ratings_key,
    read_counts,
)
from ratchet.lease import LeaseKeeper, LeaseLost
from ratchet.lifecycle import Lifecycle, LifecycleError
from ratchet.records import (
    ANONYMOUS_CLIENT,
    FeedbackRecord,
    TrafficRecord,
    decode,
)
from ratchet.registry import AliasRoute
from ratchet.rewards.reward_model import RatedAnswer, is_eval_rating
from ratchet.secrets import server_secret
from ratchet.sequential import SequentialTest
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings

log = logging.getLogger(__name__)

# How long a canary-time completion id is remembered for its feedback to be credited to its arm.
COMPLETION_TTL_S = 3600
# A rating and its answer are on different topics, read in no fixed order: a rating read before
# its answer's traffic record waits this long for it (retried with every batch), and at most this
# many wait at once.
RATING_WAIT_S = 60.0
MAX_WAITING_RATINGS = 5_000

Verdict = Literal["wait", "promote", "rollback"]

# With no rating on either arm by the time the active arm has this many times canary.min_requests
# answers, a canary does not wait feedback_wait_s for ratings (see canary_verdict).
UNRATED_AFTER = 4
# The reward-hacking guard compares the reward model with the users on this many of the alias's
# newest joined ratings (those of the canary's and the active version's answers).
GAP_RATINGS = 512

# (alias, rated answers) -> the live reward model's predicted rating of each; None: no usable model.
RewardPredictor = Callable[[str, list[RatedAnswer]], "list[float] | None"]

# Each arm's rating list keeps this many times canary.max_rating_pairs ratings (room for those the
# per-client cap leaves waiting).
RATINGS_KEPT = 4

# KEYS: the arm's rating list, its per-client counts. ARGV: the client, the encoded rating, the
# most one client stores, the most the list holds. Counts the rating, and stores it when its
# client and the list both have room: a client's flood cannot fill the list before others rate.
STORE_RATING_SCRIPT = """
if redis.call('HINCRBY', KEYS[2], ARGV[1], 1) > tonumber(ARGV[3]) then
  return 0
end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('RPUSH', KEYS[1], ARGV[2])
return 1
"""

# The error codes (proxy/upstream.py) that count against an arm: the model server failed (502
# upstream_error: it answered 5xx, or dropped the answer or the stream), could not load the
# version (502 adapter_unavailable), or could not be reached (503 upstream_unavailable). Not
# counted: every 4xx (the client's request), 504 upstream_timeout (a whole answer or a stream
# that outlived proxy.upstream_timeout_s: a client asking for a huge max_tokens, or reading a
# stream slowly, provokes it at will), and the proxy's own refusals and errors (429, 413, 500, 503
# queue_full, ...), which say nothing about the version that would have answered.
UPSTREAM_FAILURES = frozenset({"upstream_error", "adapter_unavailable", "upstream_unavailable"})


def is_upstream_failure(record: TrafficRecord) -> bool:
    return record.error is not None and record.error.get("code") in UPSTREAM_FAILURES


def completion_key(completion_id: str) -> str:
    """String "<alias>\\t<version>\\t<arm>\\t<key hash>" of a canary-time completion, "rated"
    once its feedback is counted; expires after COMPLETION_TTL_S."""
    return f"ratchet:canary:completion:{completion_id}"


# KEYS[1]: the rated completion's key; ARGV[1]: the rater's key hash ("" for none). Claims the
# rating when the completion was answered in a canary, is not rated yet, and went to that key
# (the proxy checks that too): marks it rated for every replica, returns what it was; 0 when the
# completion is not known (yet: its answer may still be on its way); else nil.
CLAIM_RATING_SCRIPT = """
local answered = redis.call('GET', KEYS[1])
if not answered then
  return 0
end
if answered == 'rated' then
  return nil
end
if string.match(answered, '\t([^\t]*)$') ~= ARGV[1] then
  return nil
end
redis.call('SET', KEYS[1], 'rated', 'KEEPTTL')
return answered
"""


def canary_verdict(
    active: ArmStats,
    canary: ArmStats,
    config: CanaryConfig,
    age_s: float,
    ratings: SequentialTest,
) -> tuple[Verdict, str]:
    """What to do with a canary that has been running for ``age_s`` seconds, and why.
    ``ratings`` is the sequential test over the arms' rating pairs so far."""
    if canary.requests < config.min_requests:
        return "wait", f"{canary.requests} of {config.min_requests} canary requests"
    excess = canary.error_rate - active.error_rate
    if excess > config.max_error_rate_increase:
        return "rollback", (
            f"error_rate: canary {canary.error_rate:.3f} vs active {active.error_rate:.3f} "
            f"(+{excess:.3f} > {config.max_error_rate_increase})"
        )
    if ratings.decision == "pass":
        return "promote", f"ratings: not worse by {config.max_feedback_drop}: {_evidence(ratings)}"
    if ratings.decision == "fail":
        return "rollback", f"ratings: {ratings.reason}: {_evidence(ratings)}"
    # Not one rating on either arm while the active arm answered several times the canary's
    # minimum: this alias's users do not rate, and waiting for ratings would only delay.
    unrated = (
        active.feedback == 0
        and canary.feedback == 0
        and active.requests >= UNRATED_AFTER * config.min_requests
    )
    if not unrated and age_s < config.feedback_wait_s:
        return "wait", (
            f"ratings undecided ({_evidence(ratings)}); deciding without them after "
            f"{config.feedback_wait_s:.0f} s"
        )
    drop = mean_drop(ratings) if ratings.n >= estimate_pairs(config) else None
    if drop is not None and drop > config.max_feedback_drop:
        return "rollback", (
            f"feedback: canary's mean rating {drop:.3f} below active's "
            f"(> {config.max_feedback_drop}) when the wait ran out; {_evidence(ratings)}"
        )
    return "promote", (
        f"{canary.requests} canary requests, error rate {canary.error_rate:.3f} "
        f"(active {active.error_rate:.3f}); ratings undecided ({_evidence(ratings)})"
    )


def estimate_pairs(config: CanaryConfig) -> int:
    """The fewest rating pairs whose point estimate may roll a canary back once the wait for
    ratings ran out: ``min_feedback``, and enough that no client holds more than half
    ``max_feedback_drop`` of them (it moves the estimate by up to twice its share, so alone it
    cannot carry an even canary past the margin). A client holds at most ``max(1, floor(s n))``
    of ``n`` pairs with ``s`` at most half the margin (learner/canary_ratings.py), so
    ``n >= 2 / max_feedback_drop`` does it; with fewer raters the pairs stop short of it."""
    if config.max_feedback_drop <= 0.0:
        return config.max_rating_pairs + 1  # no margin: only the test decides on ratings
    return max(config.min_feedback, math.ceil(2.0 / config.max_feedback_drop - 1e-9))


def _evidence(test: SequentialTest) -> str:
    if test.n == 0:
        return "no rating pairs"
    return (
        f"{test.n} rating pairs, win-share {test.mean:.3f} in [{test.lower:.3f}, {test.upper:.3f}] "
        f"vs {test.theta:.3f}, evidence {test.evidence:.2f}/{test.threshold:.2f}"
    )


def read_ratings(client: redis.Redis, alias: str, config: AliasConfig) -> SequentialTest:
    """The ratings' sequential test, replayed from the arms' stored ratings."""
    arms = [
        [Rating.decode(raw) for raw in client.lrange(ratings_key(alias, arm), 0, -1)]
        for arm in ARMS
    ]
    return rating_test(arms[0], arms[1], config.canary, config.feedback.max_share)


def fair_share(answers: list[RatedAnswer], share: float) -> list[RatedAnswer]:
    """The most of ``answers`` (oldest first) that can be kept with no client holding more than
    :func:`client_cap` of them, each client's newest kept; the anonymous client (no API keys)
    is not capped. Fewer clients than ``1 / share`` keep one answer each."""
    counts = Counter(a.owner for a in answers)

    def fits(size: int) -> bool:
        cap = client_cap(share, size)
        return sum(n if c == ANONYMOUS_CLIENT else min(n, cap) for c, n in counts.items()) >= size

    size = next((n for n in range(len(answers), 0, -1) if fits(n)), 0)
    cap = client_cap(share, size)
    taken: Counter[str] = Counter()
    kept: list[RatedAnswer] = []
    for answer in reversed(answers):
        if len(kept) == size:
            break
        if answer.owner == ANONYMOUS_CLIENT or taken[answer.owner] < cap:
            taken[answer.owner] += 1
            kept.append(answer)
    return kept[::-1]


@dataclass
class _Tally:
    """One batch's counts, written to Redis together."""

    increments: dict[str, dict[str, float]] = field(default_factory=dict)  # alias -> field -> n
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)  # (alias, minute)
    ratings: list[tuple[str, str, Rating]] = field(default_factory=list)  # (alias, arm, rating)

    def add(self, alias: str, name: str, value: float) -> None:
        fields = self.increments.setdefault(alias, {})
        fields[name] = fields.get(name, 0) + value


class CanaryWatcher:
    """Counts canary traffic and feedback, and promotes or rolls back. Runs in its own thread."""

    def __init__(
        self,
        settings: RatchetSettings,
        lifecycle: Lifecycle,
        metrics: LearnerMetrics,
        stopping: threading.Event,
        leases: AliasLeases | None = None,
        predict: RewardPredictor | None = None,
    ) -> None:
        self.settings = settings
        self.predict = predict  # for aliases whose reward is learned from ratings
        self.lifecycle = lifecycle
        self.redis = lifecycle.writer.redis
        self.metrics = metrics
        self.stopping = stopping
        self.leases = leases or AliasLeases(
            self.redis, settings.learner.lease_ttl_s, LeaseKeeper(), metrics, "canary"
        )
        self.routes: dict[str, AliasRoute] = {}
        self._last_check = 0.0
        # Ratings read before their answers: (rating, when first read), oldest first.
        self._waiting: deque[tuple[FeedbackRecord, float]] = deque()

    def run(self) -> None:
        # Only traffic from now on can judge a canary: a new group starts at the end.
        read_exchanges(self.settings, "-canary", "latest", self.stopping, self.count, self.tick)

    def tick(self) -> None:
        if time.monotonic() - self._last_check < self.settings.learner.canary_check_s:
            return
        # An alias whose hash is invalid gets no decision until it is fixed.
        table = self.lifecycle.writer.read_all(self.routes)
        self.routes = {a: r for a, r in table.routes.items() if a not in table.invalid}
        self.check()
        self._last_check = time.monotonic()

    def count(self, messages: list[Any]) -> None:
        """Add a batch of traffic and feedback records to the running canaries' counts. Every
        completion id is claimed first, then every rating (those still waiting for their answer
        as well), all in one pipeline, so a rating finds the claim of an answer in its batch;
        a rating whose answer is not known yet waits for a later batch (:meth:`_wait`)."""
        tally = _Tally()
        claims = self.redis.pipeline(transaction=False)
        read: list[tuple[FeedbackRecord, float]] = []
        now = time.monotonic()
        for message in messages:
            record = decode(message.topic, message.value)
            if isinstance(record, TrafficRecord):
                self._count_traffic(record, tally, claims)
            elif isinstance(record, FeedbackRecord) and record.api_key_hash != "":
                # A key hash of "" is no key's: an answer without one is stored with "".
                read.append((record, now))
        rated = [*self._take_waiting(now), *read]
        for record, _ in rated:
            key = completion_key(record.completion_id)
            claims.eval(CLAIM_RATING_SCRIPT, 1, key, record.api_key_hash or "")
        first = len(claims) - len(rated)
        count_requests(claims, tally.requests)
        replies = claims.execute()[first : first + len(rated)]
        for (record, since), answered in zip(rated, replies, strict=True):
            if answered == 0:
                self._wait(record, since)
            else:
                self._count_rating(record, answered, tally)
        if tally.increments:
            self._store(tally)

    def _take_waiting(self, now: float) -> list[tuple[FeedbackRecord, float]]:
        """The waiting ratings to claim again; those past :data:`RATING_WAIT_S` are given up."""
        waiting, self._waiting = list(self._waiting), deque()
        live = [(record, since) for record, since in waiting if now - since < RATING_WAIT_S]
        if len(live) < len(waiting):
            self.metrics.canary_ratings_unmatched.labels("expired").inc(len(waiting) - len(live))
        return live

    def _wait(self, record: FeedbackRecord, since: float) -> None:
        """Keep a rating whose answer is not known yet, while a canary runs (without one no
        answer is claimed, so none would come), up to :data:`MAX_WAITING_RATINGS`."""
        if not any(route.canary is not None for route in self.routes.values()):
            return
        if len(self._waiting) >= MAX_WAITING_RATINGS:
            self.metrics.canary_ratings_unmatched.labels("overflow").inc()
            return
        self._waiting.append((record, since))

    def _count_traffic(self, record: TrafficRecord, tally: _Tally, claims: Any) -> None:
        """The request in its minute, and in its arm if it is a canary's; its completion id
        claimed for its arm (the first exchange to claim an id keeps it, as the proxy's owner
        record)."""
        minute = minute_of(record.ts)
        if minute is not None and record.alias in self.settings.aliases:
            tally.requests[record.alias, minute] += 1
        arm = self._arm_of(record.alias, record.version, record.canary_arm)
        if arm is None:
            return
        tally.add(record.alias, f"{arm}_requests", 1)
        if is_upstream_failure(record):
            tally.add(record.alias, f"{arm}_errors", 1)
        if record.response_id:
            claim = "\t".join((record.alias, str(record.version), arm, record.api_key_hash or ""))
            claims.set(completion_key(record.response_id), claim, nx=True, ex=COMPLETION_TTL_S)

    def _count_rating(self, record: FeedbackRecord, answered: Any, tally: _Tally) -> None:
        """A rating whose claim succeeded (``answered``: the completion's claim), in its arm."""
        if not isinstance(answered, bytes):
            return  # rated already, another key's, or claimed by another replica
        alias, version, arm, _ = answered.decode(errors="replace").split("\t")
        if self._arm_of(alias, int(version), arm) is None:
            return  # feedback on an exchange from before this canary
        tally.add(alias, f"{arm}_feedback", 1)
        tally.add(alias, f"{arm}_feedback_sum", record.score)
        tally.ratings.append((alias, arm, Rating(record.client, record.score)))

    def _store(self, tally: _Tally) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for alias, arm, rating in tally.ratings:
            # The test takes at most max_rating_pairs per arm, and at most stored_cap of them
            # from one client: keep room for the ratings that wait for others', and no more.
            config = self.settings.aliases.get(alias) or AliasConfig()
            pairs = config.canary.max_rating_pairs
            kept = RATINGS_KEPT * pairs
            # The anonymous client (no API keys) is the only one: not capped.
            cap = (
                kept
                if rating.client == ANONYMOUS_CLIENT
                else stored_cap(
                    rater_share(config.feedback.max_share, config.canary.max_feedback_drop), pairs
                )
            )
            pipe.eval(
                STORE_RATING_SCRIPT,
                2,
                ratings_key(alias, arm),
                raters_key(alias, arm),
                rating.client,
                rating.encode(),
                cap,
                kept,
            )
        for alias, fields in tally.increments.items():
            for name, value in fields.items():
                if name.endswith("_sum"):
                    pipe.hincrbyfloat(canary_key(alias), name, value)
                else:
                    pipe.hincrby(canary_key(alias), name, int(value))
        pipe.execute()

    def _arm_of(self, alias: str, version: int, arm: str) -> str | None:
        """The arm to credit, if the exchange belongs to the alias's running canary."""
        route = self.routes.get(alias)
        if route is None or route.canary is None:
            return None
        if arm == "canary" and version == route.canary:
            return "canary"
        if arm == "active" and version == route.active:
            return "active"
        return None

    def check(self) -> None:
        for alias, route in self.routes.items():
            config = self.settings.aliases.get(alias)
            self.metrics.canary_version.labels(alias).set(route.canary or 0)
            self.metrics.active_version.labels(alias).set(route.active)
            if route.canary is None or config is None:
                continue
            version, started, stats = read_counts(self.redis, alias)
            if version != route.canary or started is None:
                continue  # a canary set by hand, or counts not reset yet: nothing to judge by
            for arm in ARMS:
                self.metrics.canary_requests.labels(alias, arm).set(stats[arm].requests)
                self.metrics.canary_error_rate.labels(alias, arm).set(stats[arm].error_rate)
            ratings = read_ratings(self.redis, alias, config)
            self.metrics.canary_rating_pairs.labels(alias).set(ratings.n)
            self.metrics.canary_rating_evidence.labels(alias).set(ratings.evidence)
            # For the console and `ratchet status`: what the test says now.
            self.redis.hset(canary_key(alias), "ratings", json.dumps(ratings.summary()))
            age_s = time.time() - started
            verdict, reason = canary_verdict(
                stats["active"], stats["canary"], config.canary, age_s, ratings
            )
            if verdict == "promote":
                hacked = self.reward_gap(alias, route, config)
                if hacked is not None:
                    verdict, reason = "rollback", hacked
            if verdict != "wait":
                self.decide(alias, route.canary, verdict, reason, stats, ratings)

    def reward_gap(self, alias: str, route: AliasRoute, config: AliasConfig) -> str | None:
        """For an alias whose reward is learned from ratings: why the canary fooled the reward
        model (learner/guard.py), or None. Asked only before a promotion: it reads the rated
        answers of both arms through the reward model."""
        if self.predict is None or not config.reward.learns_from_ratings:
            return None
        versions = (route.active, route.canary)
        # Only prompts the reward model never trains on (its held-out split): on its training
        # ratings it fits the active version's answers by construction, which would make any
        # new version look overrated.
        eval_fraction = config.feedback.eval_fraction
        secret = server_secret(self.settings)
        rated = [
            a
            for a in newest_ratings(self.redis, alias, GAP_RATINGS)
            if a.version in versions and is_eval_rating(secret, a.prompt_hash, eval_fraction)
        ]
        # Its verdict rolls back and pauses learning: no client may hold more than its share
        # of either arm's answers (at most half max_reward_gap, which it moves by up to twice
        # that), or one key rating the canary 0 and the active version 1 would open the gap.
        share = rater_share(config.feedback.max_share, config.feedback.max_reward_gap)
        answers = [
            a for v in versions for a in fair_share([a for a in rated if a.version == v], share)
        ]
        predicted = self.predict(alias, answers) if answers else None
        if predicted is None:
            return None
        arms: dict[int | None, list[tuple[float, float]]] = {v: [] for v in versions}
        for answer, prediction in zip(answers, predicted, strict=True):
            arms[answer.version].append((prediction, answer.score))
        return reward_model_gap(
            arms[route.canary],
            arms[route.active],
            config.feedback.max_reward_gap,
            config.canary.min_feedback,
        )

    def decide(
        self,
        alias: str,
        canary: int,
        verdict: Verdict,
        reason: str,
        stats: dict[str, ArmStats],
        ratings: SequentialTest,
    ) -> None:
        """Promote or roll back ``canary``, under the alias's lease and only if it is still the
        canary: another replica's watcher may have decided already."""
        detail = {
            "reason": reason,
            **{arm: vars(stats[arm]) for arm in ARMS},
            "ratings": ratings.summary(),
        }
        with self.leases.hold(alias) as lease:
            if lease is None:
                return  # another learner is deciding (or running a round): its call
            try:
                with self.lifecycle.fenced(lease):
                    if verdict == "promote":
                        self.lifecycle.promote(
                            alias, canary, {"via": "canary", **detail}, from_canary=True
                        )
                        log.info("%s: canary v%d promoted (%s)", alias, canary, reason)
                    else:
                        self.lifecycle.rollback(alias, reason, canary=canary, detail=detail)
                        self.metrics.rollbacks.labels(alias, reason.split(":", 1)[0]).inc()
                        log.warning("%s: canary v%d rolled back (%s)", alias, canary, reason)
                        if reason.startswith("reward_hacking"):
                            # The next round would train against the same fooled model.
                            self.lifecycle.pause(alias, reason)
            except LeaseLost as exc:
                self.metrics.lease_lost.labels(alias, "canary").inc()
                log.warning("%s: canary decision abandoned: %s", alias, exc)
            except LifecycleError as exc:
                log.warning("%s: canary decision not applied: %s", alias, exc)

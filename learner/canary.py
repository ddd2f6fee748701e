"""The canary: a gated candidate serves a share of live traffic before it becomes the active one.

While an alias has a canary, the watcher reads ``ratchet.traffic`` and ``ratchet.feedback`` and
counts (learner/canary_counter.py), per arm (the proxy marks each exchange ``active`` or
``canary``), requests, upstream failures (what the model server did, never what a client
provoked), and user ratings (one per completion, from the key that got it). The counts live in Redis
(``ratchet:canary:<alias>``), each arm's ratings in arrival order beside them
(``ratchet:canary:<alias>:ratings:<arm>``), all reset in the same transaction that starts the
canary, so a restarted learner carries on counting. Once the canary arm has ``min_requests``,
:func:`canary_verdict` decides: roll back if its error rate is worse than the active arm's beyond
the configured margin; otherwise the ratings' sequential test (learner/canary_ratings.py)
promotes or rolls back as soon as it can. Ratings lag the answers they rate, so a canary the
test has not decided waits up to ``feedback_wait_s``; there the test's stream ends and it looks
once (a z-test on the pairs so far, ratchet/sequential.py): promote if it shows the canary no
worse than the margin, roll back if not. With fewer pairs than that look needs, the canary is
judged on error rate and the ratings' point estimate (of at least :func:`estimate_pairs`) — at
once if neither arm has a single rating while the two have answered :data:`UNRATED_AFTER` times
``min_requests``, or after :data:`UNRATED_WAIT_S`: an alias whose users don't rate.

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
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import redis

from learner.canary_counter import CanaryCounter
from learner.canary_ratings import (
    Rating,
    client_cap,
    mean_drop,
    rater_share,
    rating_test,
)
from learner.exchanges import read_exchanges
from learner.guard import reward_model_gap
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import newest_ratings
from ratchet.canary_state import (
    ARMS,
    ArmStats,
    canary_key,
    ratings_key,
    read_counts,
)
from ratchet.lease import LeaseKeeper, LeaseLost
from ratchet.lifecycle import Lifecycle, LifecycleError
from ratchet.records import (
    ANONYMOUS_CLIENT,
)
from ratchet.registry import AliasRoute
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import is_eval_rating
from ratchet.secrets import server_secret
from ratchet.sequential import SequentialTest
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings

log = logging.getLogger(__name__)

Verdict = Literal["wait", "promote", "rollback"]

# With no rating on either arm by the time the two arms together have this many times
# canary.min_requests answers, or by UNRATED_WAIT_S, a canary does not wait feedback_wait_s for
# ratings (see canary_verdict): a quiet alias's canary takes half its traffic, and waiting on
# answers alone would hold a canary of users who never rate for 10 minutes at 20 a minute.
UNRATED_AFTER = 4
UNRATED_WAIT_S = 300.0
# The reward-hacking guard compares the reward model with the users on this many of the alias's
# newest joined ratings (those of the canary's and the active version's answers).
GAP_RATINGS = 512

# (alias, rated answers) -> the live reward model's predicted rating of each; None: no usable model.
RewardPredictor = Callable[[str, list[RatedAnswer]], "list[float] | None"]


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
    # Not one rating on either arm among several times the canary's minimum of answers, or in
    # five minutes: this alias's users do not rate, and waiting for ratings would only delay.
    unrated = (
        active.feedback == 0
        and canary.feedback == 0
        and (
            active.requests + canary.requests >= UNRATED_AFTER * config.min_requests
            or age_s >= UNRATED_WAIT_S
        )
    )
    if not unrated and age_s < config.feedback_wait_s:
        return "wait", (
            f"ratings undecided ({_evidence(ratings)}); deciding without them after "
            f"{config.feedback_wait_s:.0f} s"
        )
    # The wait ran out: the test's stream ends here, and it looks once at what it has.
    looked, reason = ratings.looked()
    if looked == "pass":
        return "promote", f"ratings: when the wait ran out, {reason}: {_evidence(ratings)}"
    if looked == "fail":
        return "rollback", (
            f"ratings: when the wait ran out, {reason}, not shown within "
            f"{config.max_feedback_drop} of the active arm: {_evidence(ratings)}"
        )
    # Too few pairs for the look: the point estimate may still roll back a clear drop.
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
        self.counter = CanaryCounter(settings, self.redis, metrics)
        self._last_check = 0.0

    @property
    def routes(self) -> dict[str, AliasRoute]:
        """The routing table as last read (aliases whose hash is valid)."""
        return self.counter.routes

    @routes.setter
    def routes(self, routes: dict[str, AliasRoute]) -> None:
        self.counter.routes = routes

    def run(self) -> None:
        # Only traffic from now on can judge a canary: a new group starts at the end.
        read_exchanges(self.settings, "-canary", "latest", self.stopping, self.count, self.tick)

    def count(self, messages: list[Any]) -> None:
        self.counter.count(messages)

    def tick(self) -> None:
        if time.monotonic() - self._last_check < self.settings.learner.canary_check_s:
            return
        # An alias whose hash is invalid gets no decision until it is fixed.
        table = self.lifecycle.writer.read_all(self.routes)
        self.routes = {a: r for a, r in table.routes.items() if a not in table.invalid}
        self.check()
        self._last_check = time.monotonic()

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
                # Past the wait the test's stream has ended: the event keeps its last look.
                if age_s >= config.canary.feedback_wait_s:
                    ratings = ratings.ended()
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
                return  # another learner holds the alias (deciding, or in a round): its call
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

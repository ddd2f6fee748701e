"""The canary: a gated candidate serves a share of live traffic before it becomes the active one.

While an alias has a canary, the watcher reads ``ratchet.traffic`` and ``ratchet.feedback`` and
counts (learner/canary_counter.py), per arm (the proxy marks each exchange ``active`` or
``canary``) and per client (an API key, or a vouching key's user), requests, upstream failures
(what the model server did, never what a client provoked) and user ratings (one per completion,
from the key that got it, counted for the client it was served to). The counts live in Redis
(``ratchet:canary:<alias>`` and the keys beside it, ratchet/canary_state.py), all reset in the
transaction that starts the canary, so a restarted learner carries on counting.

:func:`canary_verdict` decides, with a client as the unit of evidence:

* nothing before ``min_requests`` canary answers counted by client (:func:`counted`: each
  client's up to ``client_request_share`` of them, 4xx answers not at all);
* roll back, whatever the counts say, a canary whose version's latest served drift is past the
  tolerance (learner/drift_state.py: a round that trains on from the canary measures it), with
  a reason that names the version and the replica;
* roll back if the canary's upstream failures are worse than the active arm's beyond the
  margin, each client one unit (its own failure share) and the arms compared by a test at fixed
  looks (``min_clients`` on each arm, doubling), each made once and recorded in Redis so that
  the test holds its level however often the watcher asks (learner/canary_errors.py);
* roll back, on the same looks, if the canary's clients are significantly slower than
  ``1 + max_latency_increase`` times the active arm's (each client one unit: its mean time a
  token, learner/canary_latency.py); latency never promotes;
* the test over clients (learner/canary_clients.py) promotes or rolls back at any of its looks;
* otherwise it waits: an alias that learns from ratings until ``feedback_wait_s`` (never unrated
  in its first seconds, however busy), one that does not until ``min_duration_s``. Then the test
  looks once more, at every client that rated, whatever their number (not shown within the
  margin: rolled back); where no look can be made (fewer than two clients' units), the
  clients' mean drop decides, and unrated the error rate and, with fewer clients measured than
  ``min_clients``, the latency's point estimate (:func:`_after_wait`);
* an alias with fewer clients served than ``min_clients`` on an arm waits ``feedback_wait_s``,
  then is decided the same way, on what it has, and the reason says so.

The watcher also counts every alias's requests per minute, canary or not
(learner/canary_weight.py): the next canary's share is sized by them.

Every learner replica runs a watcher. Their consumer group splits the topics' partitions between
them, so each record is counted once, into the shared counts; which arm a completion id was
answered by is shared too (a claim in ``ratchet:canary:claims:*``, learner/canary_claims.py),
because its feedback may be read by another replica than its traffic record. Only the replica
holding the alias's lease (learner/leases.py) decides, and only on the canary it read: a second
decision finds the canary gone and changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import redis

from learner.canary_clients import ClientEvidence, ClientTest, client_evidence
from learner.canary_counter import CanaryCounter
from learner.canary_errors import ErrorEvidence, ErrorLook, error_rollback, recorded_looks
from learner.canary_latency import (
    LatencyEvidence,
    LatencyLook,
    latency_rollback,
    read_client_latency,
)
from learner.canary_latency import recorded_looks as recorded_latency_looks
from learner.canary_ratings import Rating
from learner.drift_state import canary_drift_block
from learner.exchanges import read_exchanges
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import newest_ratings
from learner.readmission import reprobe
from learner.reward_guard import check_reward_gap
from ratchet.canary_state import (
    ARMS,
    ArmStats,
    canary_key,
    ratings_key,
    read_client_counts,
    read_counts,
)
from ratchet.lease import LeaseKeeper, LeaseLost
from ratchet.lifecycle import Lifecycle, LifecycleError
from ratchet.records import (
    ANONYMOUS_CLIENT,
)
from ratchet.registry import AliasRoute
from ratchet.reward_guard_state import GuardResult, write_guard
from ratchet.rewards.rated import RatedAnswer
from ratchet.secrets import server_secret
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings
from ratchet.version_exclusion import renew

log = logging.getLogger(__name__)

Verdict = Literal["wait", "promote", "rollback"]

# The reward-hacking guard compares the reward model with the users on this many of the alias's
# newest joined ratings (those of the canary's and the active version's answers).
GAP_RATINGS = 512

# (alias, rated answers) -> the live reward model's predicted rating of each; None: no usable model.
RewardPredictor = Callable[[str, list[RatedAnswer]], "list[float] | None"]


def request_cap(config: CanaryConfig) -> int:
    """The most requests (and upstream failures) of one client an arm counts."""
    return max(1, math.ceil(config.client_request_share * config.min_requests - 1e-9))


def counted(
    stats: ArmStats, per_client: dict[str, tuple[int, int]], config: CanaryConfig
) -> ArmStats:
    """An arm's stats counted by client: each client's requests up to :func:`request_cap`, its
    failures up to the requests counted for it (so one client moves the error rate by at most
    its share of the counted requests). The anonymous client of a stack without keys is
    everyone: not capped, and each of its requests counts as a client, as each of its ratings is
    a unit of the test (learner/canary_clients.py)."""
    cap = request_cap(config)
    requests = errors = clients = 0
    for client, (served, failed) in per_client.items():
        anonymous = client == ANONYMOUS_CLIENT
        taken = served if anonymous else min(served, cap)
        requests += taken
        errors += min(failed, taken)
        clients += served if anonymous else 1
    return replace(stats, requests=requests, errors=errors, clients=clients, served=stats.requests)


def canary_verdict(
    active: ArmStats,
    canary: ArmStats,
    config: CanaryConfig,
    age_s: float,
    evidence: ClientEvidence,
    expects_ratings: bool = True,
    errors: ErrorEvidence | None = None,
    error_looks: list[ErrorLook] | None = None,
    latency: LatencyEvidence | None = None,
    latency_looks: list[LatencyLook] | None = None,
) -> tuple[Verdict, str]:
    """What to do with a canary that has been running for ``age_s`` seconds, and why.
    ``active`` and ``canary`` are counted by client (:func:`counted`); ``evidence`` is the test
    over the clients that rated (learner/canary_clients.py); ``expects_ratings``: the alias
    learns from ratings, so it is not decided unrated before ``feedback_wait_s``; ``errors``:
    the arms' failures by client (learner/canary_errors.py; None: each counted request a
    client, as the anonymous client's are); ``error_looks``: the error test's looks made so far
    (recorded in Redis by the watcher; None: made now on ``errors``); ``latency`` and
    ``latency_looks``: the same for the latency test (learner/canary_latency.py; None: no
    latency measured)."""
    served = min(active.clients, canary.clients)
    few = served < config.min_clients
    waited = age_s >= config.feedback_wait_s
    note = f"decided on {served} clients, below canary.min_clients {config.min_clients}: "
    if canary.requests < config.min_requests and not (
        few and waited and canary.served >= config.min_requests
    ):
        return "wait", (
            f"{canary.requests} of {config.min_requests} canary requests counted "
            f"({canary.clients} clients, each counted up to {request_cap(config)})"
        )
    if not few or waited:
        if errors is None:
            errors = ErrorEvidence.of(
                {ANONYMOUS_CLIENT: (active.requests, active.errors)},
                {ANONYMOUS_CLIENT: (canary.requests, canary.errors)},
            )
        failing = error_rollback(errors, config, few, error_looks)
        if failing is not None:
            return "rollback", (note if few else "") + failing
        slow = None if latency is None else latency_rollback(latency, config, few, latency_looks)
        if slow is not None:
            return "rollback", (note if few else "") + slow
    test = evidence.test
    if test.decision == "pass":
        return "promote", f"ratings: not worse by {config.max_feedback_drop}: {test.reason}"
    if test.decision == "fail":
        return "rollback", f"ratings: worse by more than {config.max_feedback_drop}: {test.reason}"
    least_s = config.feedback_wait_s if expects_ratings or few else config.min_duration_s
    if age_s < least_s:
        return "wait", (
            f"ratings undecided ({_evidence(evidence)}); deciding without them after "
            f"{least_s:.0f} s"
            + (f" ({served} of {config.min_clients} clients served on each arm)" if few else "")
        )
    verdict, reason = _after_wait(active, canary, config, evidence, latency, latency_looks)
    return verdict, (note if few else "") + reason


def _after_wait(
    active: ArmStats,
    canary: ArmStats,
    config: CanaryConfig,
    evidence: ClientEvidence,
    latency: LatencyEvidence | None = None,
    latency_looks: list[LatencyLook] | None = None,
) -> tuple[Verdict, str]:
    """The wait ran out: the test's stream ends here, and it looks once at every client that
    rated, whatever their number (not shown within the margin: rolled back), so one rater more
    or fewer at canary.min_clients changes no rule. Where no look can be made (fewer than two
    clients' units to compare: a one-key app, a single rater), the clients' mean drop decides,
    and the reason says so; unrated, the error rate (checked before) lets it through. Where the
    ratings do not decide, latency must pass too: with fewer clients measured than
    ``min_clients`` on an arm (a one-key app, a stack without keys), its point estimate."""
    errors = (
        f"{canary.requests} canary requests counted, error rate {canary.error_rate:.3f} "
        f"(active {active.error_rate:.3f})"
    )
    slow = None if latency is None else latency_rollback(latency, config, True, latency_looks)
    if evidence.unrated:
        if slow is not None:
            return "rollback", f"{slow}; unrated"
        return "promote", f"unrated: no ratings from {canary.clients} clients; {errors}"
    ended = evidence.ended
    if ended.decision == "pass":
        return "promote", f"ratings: when the wait ran out, {ended.reason}"
    if ended.decision == "fail":
        return "rollback", (
            f"ratings: when the wait ran out, not shown within {config.max_feedback_drop} of "
            f"the active arm: {ended.reason}"
        )
    difference = evidence.difference
    if difference is not None and -difference > config.max_feedback_drop:
        return "rollback", (
            f"feedback: too few clients to test; they rate the canary {-difference:.3f} below "
            f"the active arm (> {config.max_feedback_drop}); {_evidence(evidence)}"
        )
    if slow is not None:
        return "rollback", f"{slow}; too few clients to test the ratings"
    return "promote", f"too few clients to test the ratings; {errors}; {_evidence(evidence)}"


def _evidence(evidence: ClientEvidence) -> str:
    active, canary = evidence.raters
    return f"ratings from {active} clients on the active arm and {canary} on the canary"


def read_ratings(client: redis.Redis, alias: str, config: AliasConfig) -> ClientEvidence:
    """The test over clients, replayed from the arms' stored ratings."""
    arms = [
        [Rating.decode(raw) for raw in client.lrange(ratings_key(alias, arm), 0, -1)]
        for arm in ARMS
    ]
    return client_evidence(arms[0], arms[1], config.canary)


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
        self._last_reprobe = time.monotonic()  # the gate has just checked the versions it excluded

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
        # A replica out of a routed version's rotation stays out while the version is routed.
        renew(self.redis, self.routes.values(), self.settings.learner.served_check.exclusion_ttl_s)
        self.reprobe_excluded()
        self.check()
        self._last_check = time.monotonic()

    def reprobe_excluded(self) -> None:
        """Every ``reprobe_s``, excluded replicas asked again and those that now serve their
        version let back in (learner/readmission.py)."""
        every = self.settings.learner.served_check.reprobe_s
        if not every or time.monotonic() - self._last_reprobe < every:
            return
        self._last_reprobe = time.monotonic()
        try:
            reprobe(self.settings, self.redis, self.lifecycle.store, self.routes.values())
        except (redis.RedisError, OSError) as exc:
            log.warning("excluded replicas not asked again: %s", exc)

    def check(self) -> None:
        for alias, route in self.routes.items():
            config = self.settings.aliases.get(alias)
            self.metrics.canary_version.labels(alias).set(route.canary or 0)
            self.metrics.active_version.labels(alias).set(route.active)
            if route.canary is None or config is None:
                continue
            version, started, raw = read_counts(self.redis, alias)
            if version != route.canary or started is None:
                continue  # a canary set by hand, or counts not reset yet: nothing to judge by
            per_client = {arm: read_client_counts(self.redis, alias, arm) for arm in ARMS}
            stats = {arm: counted(raw[arm], per_client[arm], config.canary) for arm in ARMS}
            errors = ErrorEvidence.of(per_client["active"], per_client["canary"])
            # Each look of the error test is made once and recorded: later checks read it.
            error_looks = recorded_looks(self.redis, alias, version, errors, config.canary)
            latency = LatencyEvidence.of(
                *(read_client_latency(self.redis, alias, arm) for arm in ARMS)
            )
            latency_looks = recorded_latency_looks(
                self.redis, alias, version, latency, config.canary
            )
            for arm in ARMS:
                self.metrics.canary_requests.labels(alias, arm).set(stats[arm].served)
                self.metrics.canary_error_rate.labels(alias, arm).set(stats[arm].error_rate)
            evidence = read_ratings(self.redis, alias, config)
            self.metrics.canary_rating_pairs.labels(alias).set(evidence.test.n)
            last = evidence.test.last  # how far the last look's lower bound is above -margin
            margin = config.canary.max_feedback_drop
            self.metrics.canary_rating_evidence.labels(alias).set(
                0.0 if last is None else last.lower + margin
            )
            # For the console and `ratchet status`: what the test says now.
            raters = dict(zip(ARMS, evidence.raters, strict=True))
            summary = {**evidence.test.summary(), "clients": raters}
            self.redis.hset(canary_key(alias), "ratings", json.dumps(summary))
            age_s = time.time() - started
            verdict, reason = canary_verdict(
                stats["active"],
                stats["canary"],
                config.canary,
                age_s,
                evidence,
                config.reward.learns_from_ratings,
                errors,
                error_looks,
                latency,
                latency_looks,
            )
            verdict, reason = self.overruled(alias, route, config, verdict, reason)
            if verdict != "wait":
                # Past the wait the test's stream has ended: the event keeps its last look.
                ratings = evidence.test
                if age_s >= config.canary.feedback_wait_s and ratings.decision == "continue":
                    ratings = evidence.ended
                self.decide(alias, route.canary, verdict, reason, stats, ratings)

    def overruled(
        self, alias: str, route: AliasRoute, config: AliasConfig, verdict: Verdict, reason: str
    ) -> tuple[Verdict, str]:
        """The counts' verdict after what overrules it: a canary whose version's served drift
        is past the tolerance is rolled back whatever the counts say (the fleet does not serve
        what was trained); a promotion the reward guard blocks is rolled back too."""
        assert route.canary is not None
        drifted = canary_drift_block(self.redis, alias, route.canary, self.settings)
        if drifted is not None:
            return "rollback", drifted
        guard = self.reward_gap(alias, route, config) if verdict == "promote" else None
        if guard is None:
            return verdict, reason
        blocked = guard.blocks(config.feedback.require_reward_check)
        if blocked is not None:
            return "rollback", blocked
        if not guard.checked:
            return verdict, f"{reason}; reward guard {guard.reason}"
        return verdict, reason

    def reward_gap(self, alias: str, route: AliasRoute, config: AliasConfig) -> GuardResult | None:
        """For an alias whose reward is learned from ratings: what the reward-hacking guard says
        of the canary (learner/reward_guard.py), kept for the console and `ratchet status`; None
        for other aliases. Asked only before a promotion: it reads the rated answers of both
        arms through the reward model."""
        predict = self.predict
        if predict is None or not config.reward.learns_from_ratings or route.canary is None:
            return None
        result = check_reward_gap(
            newest_ratings(self.redis, alias, GAP_RATINGS),
            route.active,
            route.canary,
            lambda answers: predict(alias, answers),
            server_secret(self.settings),
            config.feedback,
            config.canary.min_feedback,
        )
        write_guard(self.redis, alias, route.canary, result)
        return result

    def decide(
        self,
        alias: str,
        canary: int,
        verdict: Verdict,
        reason: str,
        stats: dict[str, ArmStats],
        ratings: ClientTest,
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

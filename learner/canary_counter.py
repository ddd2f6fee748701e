"""Counting for the canary: each running canary's requests, upstream failures and ratings, per
arm and per client, from ``ratchet.traffic`` and ``ratchet.feedback``, into Redis
(``ratchet:canary:<alias>``, its rating lists and its per-client counts), where every learner
replica's counter adds to the same counts and the canary watcher (learner/canary.py) reads them
to decide.

Evidence is counted by client (ratchet/canary_state.py): a request the model server refused or
that the client got wrong (any 4xx) is not counted at all; the rest count per client, and the
verdict caps what one client's requests and failures weigh. A successful answer's latency a
token (learner/canary_latency.py) is added to its client's sum and count. A rating counts for
the client of the *rated completion* (its key, or the user that key vouched for in the
request), never for the user a feedback body names.

Which arm a completion id was answered by is shared through Redis (learner/canary_claims.py),
because its rating may be read by another replica than its traffic record, and before it: the
topics are read in no fixed order, so a rating whose answer is not known yet waits for it
(:data:`RATING_WAIT_S`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import redis

from learner.canary_claims import claim_answer, claim_rating, claimed
from learner.canary_latency import request_latency
from learner.canary_ratings import Rating
from learner.canary_weight import count_requests, minute_of
from learner.metrics import LearnerMetrics
from ratchet.canary_state import (
    ERRORS_SUFFIX,
    LATENCY_COUNT_SUFFIX,
    LATENCY_SUFFIX,
    canary_key,
    clients_key,
    raters_key,
    ratings_key,
)
from ratchet.records import ANONYMOUS_CLIENT, FeedbackRecord, TrafficRecord, decode
from ratchet.registry import AliasRoute
from ratchet.settings import AliasConfig, RatchetSettings

# A rating and its answer are on different topics, read in no fixed order: a rating read before
# its answer's traffic record waits this long for it (retried with every batch), and at most this
# many wait at once.
RATING_WAIT_S = 60.0
MAX_WAITING_RATINGS = 5_000

# The anonymous client's ratings (each its own unit) an arm keeps: this many times
# canary.max_rating_pairs. Every other client stores canary.client_ratings per arm.
RATINGS_KEPT = 4

# KEYS: the arm's rating list, its per-client counts, the canary's hash. ARGV: the client, the
# encoded rating, the most one client stores, the most the list holds. Counts the rating, and
# stores it when its client and the list both have room (a client's flood cannot fill the list
# before others rate), with its place in the order of both arms' stored ratings appended
# (``Rating.seq``: a client's first ratings across the arms make its unit).
STORE_RATING_SCRIPT = """
if redis.call('HINCRBY', KEYS[2], ARGV[1], 1) > tonumber(ARGV[3]) then
  return 0
end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
local seq = redis.call('HINCRBY', KEYS[3], 'rating_seq', 1)
redis.call('RPUSH', KEYS[1], ARGV[2] .. '\t' .. seq)
return 1
"""

# The error codes (proxy/upstream.py) that count against an arm: the model server failed (502
# upstream_error: it answered 5xx, or dropped the answer or the stream), could not load the
# version (502 adapter_unavailable), could not be reached (503 upstream_unavailable), or stalled:
# nothing past the first-byte deadline and its engine's probe failed (504 upstream_stalled,
# proxy/upstream.py: the replica's fault, whatever the client reads; issue 55: a version whose
# answers never start must fail its canary). Not counted: 504 upstream_timeout, a whole answer
# or a stream not finished within proxy.upstream_timeout_s, since a client provokes one with a
# large max_tokens or a slow read; every 4xx (the client's request); and the proxy's own
# refusals and errors (429, 413, 500, 503 queue_full, ...), which say nothing about the version.
UPSTREAM_FAILURES = frozenset(
    {"upstream_error", "adapter_unavailable", "upstream_unavailable", "upstream_stalled"}
)


def is_upstream_failure(record: TrafficRecord) -> bool:
    if record.error is None:
        return False
    return record.error.get("code") in UPSTREAM_FAILURES


def is_refused(record: TrafficRecord) -> bool:
    """A 4xx: the client's request, refused by the model server or the proxy."""
    return 400 <= record.status < 500


@dataclass
class _Tally:
    """One batch's counts, written to Redis together."""

    increments: dict[str, dict[str, float]] = field(default_factory=dict)  # alias -> field -> n
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)  # (alias, minute)
    ratings: list[tuple[str, str, Rating]] = field(default_factory=list)  # (alias, arm, rating)
    clients: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (alias, arm, field)
    # (alias, arm, client + LATENCY_SUFFIX) -> the sum of its requests' latency measures
    latency: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def add(self, alias: str, name: str, value: float) -> None:
        fields = self.increments.setdefault(alias, {})
        fields[name] = fields.get(name, 0) + value


class CanaryCounter:
    """Counts canary traffic and ratings into Redis; ``routes`` (the watcher's last read of the
    routing table) says which exchanges belong to a running canary."""

    def __init__(
        self, settings: RatchetSettings, client: redis.Redis, metrics: LearnerMetrics
    ) -> None:
        self.settings = settings
        self.redis = client
        self.metrics = metrics
        self.routes: dict[str, AliasRoute] = {}
        # Ratings read before their answers: (rating, when first read), oldest first.
        self.waiting: deque[tuple[FeedbackRecord, float]] = deque()

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
        canaries = [alias for alias, route in self.routes.items() if route.canary is not None]
        for record, _ in rated:
            claim_rating(claims, record.completion_id, record.api_key_hash, canaries)
        first = len(claims) - len(rated)
        count_requests(claims, tally.requests)
        replies = claims.execute()[first : first + len(rated)]
        for (record, since), answered in zip(rated, replies, strict=True):
            if answered == 0:
                self._wait(record, since)
            else:
                self._count_rating(record, answered, tally)
        if tally.increments or tally.latency:
            self._store(tally)

    def _take_waiting(self, now: float) -> list[tuple[FeedbackRecord, float]]:
        """The waiting ratings to claim again; those past :data:`RATING_WAIT_S` are given up."""
        waiting, self.waiting = list(self.waiting), deque()
        live = [(record, since) for record, since in waiting if now - since < RATING_WAIT_S]
        if len(live) < len(waiting):
            self.metrics.canary_ratings_unmatched.labels("expired").inc(len(waiting) - len(live))
        return live

    def _wait(self, record: FeedbackRecord, since: float) -> None:
        """Keep a rating whose answer is not known yet, while a canary runs (without one no
        answer is claimed, so none would come), up to :data:`MAX_WAITING_RATINGS`."""
        if not any(route.canary is not None for route in self.routes.values()):
            return
        if len(self.waiting) >= MAX_WAITING_RATINGS:
            self.metrics.canary_ratings_unmatched.labels("overflow").inc()
            return
        self.waiting.append((record, since))

    def _count_traffic(self, record: TrafficRecord, tally: _Tally, claims: Any) -> None:
        """The request in its minute, and in its arm if it is a canary's; its completion id
        claimed for its arm (the first exchange to claim an id keeps it, as the proxy's owner
        record)."""
        minute = minute_of(record.ts)
        if minute is not None and record.alias in self.settings.aliases:
            tally.requests[record.alias, minute] += 1
        arm = self._arm_of(record.alias, record.version, record.canary_arm)
        if arm is None or is_refused(record):
            return
        tally.add(record.alias, f"{arm}_requests", 1)
        tally.clients[record.alias, arm, record.client] += 1
        if is_upstream_failure(record):
            tally.add(record.alias, f"{arm}_errors", 1)
            tally.clients[record.alias, arm, record.client + ERRORS_SUFFIX] += 1
        measure = request_latency(record)
        if measure is not None:
            # Two fields a client, as its requests and failures (learner/canary_latency.py).
            name = (record.alias, arm, record.client + LATENCY_SUFFIX)
            tally.latency[name] = tally.latency.get(name, 0.0) + measure
            tally.clients[record.alias, arm, record.client + LATENCY_COUNT_SUFFIX] += 1
        if record.response_id:
            claim_answer(claims, record, arm)

    def _count_rating(self, record: FeedbackRecord, answered: Any, tally: _Tally) -> None:
        """A rating whose claim succeeded (``answered``: the completion's claim), in its arm."""
        claim = claimed(answered)
        if claim is None:
            return  # rated already, another key's, or claimed by another replica
        alias, version, arm, held = claim
        if self._arm_of(alias, version, arm) is None:
            return  # feedback on an exchange from before this canary
        # The completion's client: "" for the key itself, which the claim checked is the
        # rater's (a claim written before clients were kept: its key's).
        client = held or record.api_key_hash or ANONYMOUS_CLIENT
        tally.add(alias, f"{arm}_feedback", 1)
        tally.add(alias, f"{arm}_feedback_sum", record.score)
        tally.ratings.append((alias, arm, Rating(client, record.score)))

    def _store(self, tally: _Tally) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for alias, arm, rating in tally.ratings:
            # A client's observation is its first client_ratings ratings of the arm
            # (learner/canary_clients.py): no more of them are stored. The anonymous client
            # (no API keys) is everyone, each rating a unit: kept up to the test's pairs.
            canary = (self.settings.aliases.get(alias) or AliasConfig()).canary
            per_client = canary.client_ratings
            kept = canary.max_rating_pairs * max(per_client, RATINGS_KEPT)
            cap = kept if rating.client == ANONYMOUS_CLIENT else per_client
            pipe.eval(
                STORE_RATING_SCRIPT,
                3,
                ratings_key(alias, arm),
                raters_key(alias, arm),
                canary_key(alias),
                rating.client,
                rating.encode(),
                cap,
                kept,
            )
        for (alias, arm, name), times in tally.clients.items():
            pipe.hincrby(clients_key(alias, arm), name, times)
        for (alias, arm, name), total in tally.latency.items():
            pipe.hincrbyfloat(clients_key(alias, arm), name, total)
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

"""Counting for the canary: each running canary's requests, upstream failures and ratings, per
arm, from ``ratchet.traffic`` and ``ratchet.feedback``, into Redis (``ratchet:canary:<alias>``
and its rating lists), where every learner replica's counter adds to the same counts and the
canary watcher (learner/canary.py) reads them to decide.

Which arm a completion id was answered by is shared through Redis
(``ratchet:canary:completion:<id>``), because its rating may be read by another replica than its
traffic record, and before it: the topics are read in no fixed order, so a rating whose answer is
not known yet waits for it (:data:`RATING_WAIT_S`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import redis

from learner.canary_ratings import Rating, rater_share, stored_cap
from learner.canary_weight import count_requests, minute_of
from learner.metrics import LearnerMetrics
from ratchet.canary_state import canary_key, raters_key, ratings_key
from ratchet.records import ANONYMOUS_CLIENT, FeedbackRecord, TrafficRecord, decode
from ratchet.registry import AliasRoute
from ratchet.settings import AliasConfig, RatchetSettings

# How long a canary-time completion id is remembered for its feedback to be credited to its arm.
COMPLETION_TTL_S = 3600
# A rating and its answer are on different topics, read in no fixed order: a rating read before
# its answer's traffic record waits this long for it (retried with every batch), and at most this
# many wait at once.
RATING_WAIT_S = 60.0
MAX_WAITING_RATINGS = 5_000

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


@dataclass
class _Tally:
    """One batch's counts, written to Redis together."""

    increments: dict[str, dict[str, float]] = field(default_factory=dict)  # alias -> field -> n
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)  # (alias, minute)
    ratings: list[tuple[str, str, Rating]] = field(default_factory=list)  # (alias, arm, rating)

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

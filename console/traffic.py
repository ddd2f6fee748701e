"""Recent traffic for the console: each alias's latest exchanges with their ratings, and the mean
rating per version, read from ``ratchet.traffic`` and ``ratchet.feedback``.

A thread reads both topics from their ends, with no consumer group (nothing is committed, and
several consoles do not split the records between them), and keeps in memory, per alias, the
newest :data:`KEPT` exchanges, each findable by completion id. A rating counts for the version
that answered, when the console saw its exchange. So both start empty when the console starts
and cover what it has seen since: the page says so. The two topics are read together but not in
step, so a rating can arrive before its exchange: the newest :data:`PENDING_RATINGS` such ratings
wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ratchet.records import (
    FEEDBACK_TOPIC,
    TRAFFIC_TOPIC,
    FeedbackRecord,
    TrafficRecord,
    decode,
)
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

KEPT = 200  # exchanges kept per alias
# Ratings whose exchange has not arrived yet (or never will: any client may rate any id).
PENDING_RATINGS = 1000
TEXT_CHARS = 600  # of a prompt or an answer, for the page


@dataclass
class Exchange:
    completion_id: str
    ts: str
    version: int
    arm: str
    status: int
    prompt: str
    answer: str
    rating: float | None = None


@dataclass(frozen=True)
class VersionRating:
    version: int
    ratings: int
    mean: float


def last_user_text(request: dict[str, Any]) -> str:
    messages = request.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        return content if isinstance(content, str) else str(content or "")
    prompt = request.get("prompt")  # the completions endpoint
    return prompt if isinstance(prompt, str) else ""


def answer_of(record: TrafficRecord) -> str:
    if not record.choices:
        return (record.error or {}).get("message", "") if record.error else ""
    choice = record.choices[0]
    message = choice.get("message") or {}
    text = message.get("content") if isinstance(message, dict) else None
    return str(text if text is not None else choice.get("text") or "")


class RecentTraffic:
    """The kept exchanges and rating sums; fed by :meth:`add` (thread-safe)."""

    def __init__(self, aliases: set[str]) -> None:
        self.aliases = aliases
        self.lock = threading.Lock()
        self.exchanges: dict[str, OrderedDict[str, Exchange]] = {a: OrderedDict() for a in aliases}
        self.owner: dict[str, str] = {}  # completion id -> alias, for the kept exchanges
        self.sums: dict[tuple[str, int], tuple[int, float]] = {}
        self.pending: OrderedDict[str, float] = OrderedDict()  # completion id -> score

    def add(self, record: object) -> None:
        if isinstance(record, TrafficRecord):
            self._traffic(record)
        elif isinstance(record, FeedbackRecord):
            self._feedback(record)

    def _traffic(self, record: TrafficRecord) -> None:
        if record.alias not in self.aliases or not record.response_id:
            return
        exchange = Exchange(
            completion_id=record.response_id,
            ts=record.ts,
            version=record.version,
            arm=record.canary_arm,
            status=record.status,
            prompt=last_user_text(record.request)[:TEXT_CHARS],
            answer=answer_of(record)[:TEXT_CHARS],
        )
        with self.lock:
            kept = self.exchanges[record.alias]
            if exchange.completion_id in kept:
                return  # a redelivered record
            kept[exchange.completion_id] = exchange
            self.owner[exchange.completion_id] = record.alias
            while len(kept) > KEPT:
                evicted, _ = kept.popitem(last=False)
                self.owner.pop(evicted, None)
            score = self.pending.pop(exchange.completion_id, None)
            if score is not None:
                self._rate(record.alias, exchange, score)

    def _feedback(self, record: FeedbackRecord) -> None:
        with self.lock:
            alias = self.owner.get(record.completion_id)
            if alias is not None:
                self._rate(alias, self.exchanges[alias][record.completion_id], record.score)
                return
            # The exchange may still be on its way; a redelivered rating keeps the first.
            self.pending.setdefault(record.completion_id, record.score)
            while len(self.pending) > PENDING_RATINGS:
                self.pending.popitem(last=False)

    def _rate(self, alias: str, exchange: Exchange, score: float) -> None:
        """Under the lock: the exchange's rating, and its version's sum."""
        if exchange.rating is not None:
            return  # the proxy takes one rating per completion; a redelivery
        exchange.rating = score
        n, total = self.sums.get((alias, exchange.version), (0, 0.0))
        self.sums[(alias, exchange.version)] = (n + 1, total + score)

    def recent(self, alias: str, completion_id: str | None = None) -> list[Exchange]:
        """Newest first; only the one asked for when ``completion_id`` is given."""
        with self.lock:
            kept = self.exchanges.get(alias, OrderedDict())
            if completion_id:
                found = kept.get(completion_id.strip())
                return [found] if found else []
            return list(reversed(kept.values()))

    def ratings(self, alias: str) -> list[VersionRating]:
        with self.lock:
            return [
                VersionRating(version, n, total / n)
                for (a, version), (n, total) in sorted(self.sums.items())
                if a == alias and n
            ]


class TrafficReader:
    """Feeds a RecentTraffic from Kafka in a daemon thread; Kafka errors are retried."""

    def __init__(self, settings: RatchetSettings, recent: RecentTraffic) -> None:
        self.settings = settings
        self.recent = recent
        self.started = time.time()

    def start(self) -> None:
        threading.Thread(target=self._run, name="console-traffic", daemon=True).start()

    def _run(self) -> None:
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError
        from kafka.structs import TopicPartition

        s = self.settings
        while True:
            try:
                consumer = KafkaConsumer(
                    bootstrap_servers=s.kafka_bootstrap_servers,
                    group_id=None,
                    enable_auto_commit=False,
                    **s.kafka.client_options(),
                )
                partitions = [
                    TopicPartition(topic, p)
                    for topic in (TRAFFIC_TOPIC, FEEDBACK_TOPIC)
                    for p in consumer.partitions_for_topic(topic) or ()
                ]
                if not partitions:  # the topics do not exist yet (a new stack)
                    consumer.close()
                    time.sleep(2.0)
                    continue
                consumer.assign(partitions)
                consumer.seek_to_end(*partitions)
                while True:
                    for messages in consumer.poll(timeout_ms=500, max_records=500).values():
                        for message in messages:
                            self.recent.add(decode(message.topic, message.value))
            except KafkaError as exc:
                log.warning("console: reading recent traffic (%s); retrying", exc)
                time.sleep(2.0)

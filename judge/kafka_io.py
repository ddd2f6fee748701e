"""The judge's side of Kafka: consume traffic, produce outputs and wait for their acks, commit.

A mixin of :class:`judge.service.JudgeService` (which owns ``settings``, ``metrics`` and
``stopping``); the blocking kafka-python calls run in the service's executor.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError, KafkaError

from judge.metrics import JudgeMetrics
from ratchet.bus import ensure_topics, make_consumer
from ratchet.records import (
    DEADLETTER_TOPIC,
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    TRAFFIC_TOPIC,
    DeadLetter,
    HeldoutPrompt,
    Record,
    ScoredGroup,
    SourceMessage,
)
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)


class JudgeKafka:
    settings: RatchetSettings
    metrics: JudgeMetrics
    stopping: asyncio.Event
    producer: KafkaProducer
    consumer: KafkaConsumer

    def _connect(self) -> None:
        s = self.settings
        while True:
            try:
                topics = [GROUPS_TOPIC, HELDOUT_TOPIC, DEADLETTER_TOPIC]
                ensure_topics(s.kafka_bootstrap_servers, s.kafka, topics)
                self.producer = KafkaProducer(
                    bootstrap_servers=s.kafka_bootstrap_servers,
                    acks="all",
                    linger_ms=5,
                    compression_type=None if s.kafka.compression == "none" else s.kafka.compression,
                    **s.kafka.client_options(),
                )
                self.consumer = make_consumer(
                    s.kafka_bootstrap_servers,
                    s.kafka,
                    [TRAFFIC_TOPIC],
                    s.judge.consumer_group,
                    max_poll_records=s.judge.poll_records,
                    # Groups take seconds each on CPU; don't let the group coordinator evict us.
                    max_poll_interval_ms=30 * 60 * 1000,
                )
                return
            except KafkaError as exc:
                log.warning("kafka unreachable (%s); retrying", exc)
                if self.stopping.is_set():
                    raise SystemExit(0) from None
                time.sleep(1.0)

    def _poll(self) -> list[SourceMessage]:
        polled = self.consumer.poll(timeout_ms=1000, max_records=self.settings.judge.poll_records)
        return [m for messages in polled.values() for m in messages]

    def _produce(self, outputs: list[Record]) -> bool:
        """Send a batch's outputs and wait for the broker's acks, retrying until they land.
        False: stopped before they did."""
        while True:
            try:
                futures = [
                    self.producer.send(r.TOPIC, key=_key_of(r), value=r.to_json()) for r in outputs
                ]
                self.producer.flush(timeout=30)
                for future in futures:
                    future.get(timeout=0)
                return True
            except KafkaError as exc:
                # Not committed: the same batch stays ours to finish. Retry until it lands.
                log.warning("could not produce a batch (%s); retrying", exc)
                if self.stopping.is_set():
                    return False  # uncommitted: the next judge re-reads this batch
                time.sleep(1.0)

    def _commit(self) -> bool:
        """Commit the batch's offsets; False: not committed (a rebalance, or stopping)."""
        while True:
            try:
                self.consumer.commit()
                return True
            except CommitFailedError as exc:
                # The group rebalanced while we worked: these partitions are another judge's now.
                # It re-reads the batch and skips what we marked judged; retrying cannot succeed.
                log.warning("batch not committed, the group rebalanced (%s)", exc)
                self.metrics.failures.labels("-", "commit_rebalanced").inc()
                return False
            except KafkaError as exc:
                log.warning("could not commit a batch (%s); retrying", exc)
                if self.stopping.is_set():
                    return False
                time.sleep(1.0)

    def _close(self) -> None:
        self.consumer.close()
        self.producer.close(timeout=5)


def _key_of(record: Record) -> bytes:
    if isinstance(record, ScoredGroup):
        return record.alias.encode()
    if isinstance(record, HeldoutPrompt):
        return record.prompt_hash.encode()
    if isinstance(record, DeadLetter):
        return record.key()
    raise TypeError(type(record))

"""The learner's two Kafka consumers, and where each partition of ``ratchet.groups`` was read to.

* ``ratchet.groups``: a consumer group with manual commits. A partition's offset is committed
  only up to its oldest group still waiting for a round (or all it has read), and only while the
  partition is assigned here: another learner's offsets are its own.
* ``ratchet.heldout``: read whole, without a group, on every start: the gate's pool of prompts
  never trained on. It commits nothing.

A rebalance tells us which partitions we lost from kafka-python's IO thread (:class:`Revoked`);
they are only noted there and forgotten by the loop's next poll (:meth:`Consumers.take_revoked`).
After an outage mid-batch, :meth:`Consumers.rewind` seeks back to the first message not yet
read, so the retried step reads it again instead of reading on past it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.structs import OffsetAndMetadata, TopicPartition

from learner.metrics import LearnerMetrics
from ratchet.bus import ensure_topics, make_consumer
from ratchet.records import (
    ALL_TOPICS,
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    HeldoutPrompt,
    ScoredGroup,
    SourceMessage,
    parse,
)
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

Polled = dict[TopicPartition, list[SourceMessage]]

# A round takes minutes on CPU; the group coordinator must not evict us meanwhile.
MAX_POLL_INTERVAL_MS = 60 * 60 * 1000


@dataclass
class Waiting:
    """A group taken for a round, with where it was read (its offset is committed past only once
    its round's outcome is stored)."""

    group: ScoredGroup
    partition: TopicPartition
    offset: int
    arrived: float = field(default_factory=time.monotonic)


class Consumers:
    """The groups and held-out consumers and the groups' read positions."""

    def __init__(self, settings: RatchetSettings, metrics: LearnerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.groups: KafkaConsumer | None = None
        self.heldout: KafkaConsumer | None = None
        self.read_up_to: dict[TopicPartition, int] = {}  # next offset after the last one read
        self._revoked: set[TopicPartition] = set()  # by a rebalance, see revoked()
        self._revoked_lock = threading.Lock()

    def connect(self) -> None:
        s = self.settings
        ensure_topics(s.kafka_bootstrap_servers, s.kafka, list(ALL_TOPICS))
        self.groups = make_consumer(
            s.kafka_bootstrap_servers,
            s.kafka,
            [],
            s.learner.consumer_group,
            max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        )
        self.groups.subscribe([GROUPS_TOPIC], listener=Revoked(self))
        self.heldout = make_consumer(s.kafka_bootstrap_servers, s.kafka, [HELDOUT_TOPIC], None)

    def read_heldout(self) -> list[HeldoutPrompt]:
        """The held-out prompts that arrived since the last read (none before connecting)."""
        if self.heldout is None:
            return []
        prompts = []
        for messages in self.heldout.poll(timeout_ms=0, max_records=1000).values():
            for message in messages:
                record = parse(HELDOUT_TOPIC, message.value)
                if isinstance(record, HeldoutPrompt):
                    prompts.append(record)
                elif isinstance(record, str) and record != "unknown_schema":
                    # Read without a group from the start each time: only counted, not
                    # dead-lettered again on every restart.
                    self.metrics.failures.labels("-", f"heldout_{record}").inc()
        return prompts

    def poll_groups(self) -> Polled:
        assert self.groups is not None
        polled: Polled = self.groups.poll(timeout_ms=1000, max_records=256)
        return polled

    def read(self, tp: TopicPartition, message: SourceMessage) -> None:
        """``message`` is handled: a commit may move past it (unless its group waits)."""
        self.read_up_to[tp] = message.offset + 1

    def rewind(self, polled: Polled) -> None:
        """Seek each partition back to its first message of ``polled`` not yet handled."""
        assert self.groups is not None
        for tp, messages in polled.items():
            first_unread = next(
                (m.offset for m in messages if m.offset >= self.read_up_to.get(tp, 0)), None
            )
            if first_unread is not None:
                self.groups.seek(tp, first_unread)

    def commit(self, waiting: Iterable[Waiting]) -> None:
        """Commit each partition up to its oldest group still waiting (or all it has read); only
        partitions assigned to us: another learner's offsets are its own."""
        assert self.groups is not None
        oldest: dict[TopicPartition, int] = dict(self.read_up_to)
        for w in waiting:
            oldest[w.partition] = min(oldest.get(w.partition, w.offset), w.offset)
        assigned = self.groups.assignment()
        oldest = {tp: offset for tp, offset in oldest.items() if tp in assigned}
        if oldest:
            self.groups.commit(
                {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in oldest.items()}
            )

    def revoked(self, partitions: set[TopicPartition]) -> None:
        """Partitions of ratchet.groups another learner takes over, noted here and forgotten by
        the loop's next poll. kafka-python calls this from its IO thread, which must not block
        (a commit here would fail the rebalance) and must not touch what a round is using."""
        with self._revoked_lock:
            self._revoked |= partitions
        log.info("ratchet.groups partitions revoked: %s", sorted(tp.partition for tp in partitions))

    def take_revoked(self) -> set[TopicPartition]:
        """The partitions revoked since the last call, their read positions forgotten: the new
        owner reads them again from the committed offset."""
        with self._revoked_lock:
            partitions, self._revoked = self._revoked, set()
        for tp in partitions:
            self.read_up_to.pop(tp, None)
        return partitions

    def close(self) -> None:
        for consumer in (self.groups, self.heldout):
            if consumer is not None:
                consumer.close()


# kafka-python ships no types (an Any base), and subscribe() checks the listener's class.
class Revoked(ConsumerRebalanceListener):  # type: ignore[misc]
    """Tells the consumers which partitions of ratchet.groups they lost in a rebalance."""

    def __init__(self, consumers: Consumers) -> None:
        self.consumers = consumers

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.consumers.revoked(set(revoked))

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("ratchet.groups partitions assigned: %s", sorted(tp.partition for tp in assigned))

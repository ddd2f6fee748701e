"""The Kafka bus every service shares: topic creation and consumers with manual commits."""

from __future__ import annotations

import contextlib
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from ratchet.settings import KafkaSettings


def ensure_topics(bootstrap: str, kafka: KafkaSettings, topics: list[str]) -> list[str]:
    """Create the topics a service owns when they are missing; return the ones created."""
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=5000,
        bootstrap_timeout_ms=2000,
        **kafka.client_options(),
    )
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            new = [
                NewTopic(
                    name=t,
                    num_partitions=kafka.topic_partitions,
                    replication_factor=kafka.topic_replication,
                    topic_configs={"retention.ms": str(kafka.topic_retention_ms)},
                )
                for t in missing
            ]
            # Another replica may win the race to create them; that is fine.
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(new, timeout_ms=5000)
        return missing
    finally:
        admin.close()


def make_consumer(
    bootstrap: str, kafka: KafkaSettings, topics: list[str], group_id: str | None, **extra: Any
) -> KafkaConsumer:
    """A consumer with manual commits: services commit only after their output is produced."""
    options: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": kafka.session_timeout_ms,
        "heartbeat_interval_ms": kafka.session_timeout_ms // 3,
        **kafka.client_options(),
    }
    return KafkaConsumer(*topics, **{**options, **extra})  # a caller's option wins


def consumer_lag(
    bootstrap: str, kafka: KafkaSettings, group: str, topic: str, timeout_s: float = 5.0
) -> int | None:
    """Records on ``topic`` that consumer group ``group`` has not committed yet; None if Kafka
    is away."""
    from kafka.errors import KafkaError
    from kafka.structs import TopicPartition

    try:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            request_timeout_ms=int(timeout_s * 1000) + 1000,
            **kafka.client_options(),
        )
    except KafkaError:
        return None
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = consumer.end_offsets(tps) if tps else {}
        lag: int = sum(max(0, end - (consumer.committed(tp) or 0)) for tp, end in ends.items())
        return lag
    except KafkaError:
        return None
    finally:
        consumer.close()

"""The loop that reads users' exchanges (``ratchet.traffic`` and ``ratchet.feedback``) in a
learner thread: the canary watcher's and the ratings collector's, each as its own consumer
group; and the read of one traffic record back, by where it is, for a rating's join."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import redis
from kafka import KafkaConsumer
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.structs import TopicPartition

from ratchet.bus import make_consumer
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, TrafficRecord, decode
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0  # one record from a live broker comes in milliseconds


def read_exchanges(
    settings: RatchetSettings,
    group_suffix: str,
    offset_reset: Literal["earliest", "latest"],
    stopping: threading.Event,
    handle: Callable[[list[Any]], None],
    tick: Callable[[], None],
) -> None:
    """Until ``stopping``: ``tick()``, then ``handle(messages)`` for each polled batch, whose
    offsets are committed after it. Kafka, Redis and network errors are logged and retried; so
    is anything else ``handle`` raises (with its traceback): a record it cannot take must be
    caught there, per record, and the thread never dies of one."""
    consumer = None
    while not stopping.is_set():
        try:
            if consumer is None:
                consumer = make_consumer(
                    settings.kafka_bootstrap_servers,
                    settings.kafka,
                    [TRAFFIC_TOPIC, FEEDBACK_TOPIC],
                    settings.learner.consumer_group + group_suffix,
                    auto_offset_reset=offset_reset,
                )
            tick()
            polled = consumer.poll(timeout_ms=500, max_records=500)
            handle([m for messages in polled.values() for m in messages])
            if polled:
                consumer.commit()
        except (KafkaError, redis.RedisError, OSError) as exc:
            log.warning("reading exchanges (%s): %s; retrying", group_suffix, exc)
            time.sleep(1.0)
        except Exception:
            log.exception("reading exchanges (%s) failed; retrying the batch", group_suffix)
            time.sleep(1.0)
    if consumer is not None:
        consumer.close()


class TrafficFetcher:
    """Reads the traffic record at a partition and offset of ``ratchet.traffic`` back (a
    :data:`learner.ratings.TrafficFetch`): one consumer of no group, assigned and sought."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self._consumer: KafkaConsumer | None = None

    def __call__(self, partition: int, offset: int) -> TrafficRecord | None:
        if self._consumer is None:
            s = self.settings
            self._consumer = make_consumer(s.kafka_bootstrap_servers, s.kafka, [], None)
        where = TopicPartition(TRAFFIC_TOPIC, partition)
        self._consumer.assign([where])
        self._consumer.seek(where, offset)
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while time.monotonic() < deadline:
            for message in self._consumer.poll(timeout_ms=500, max_records=1).get(where, []):
                if message.offset != offset:
                    return None  # past retention: Kafka starts after it
                record = decode(TRAFFIC_TOPIC, message.value)
                return record if isinstance(record, TrafficRecord) else None
        raise KafkaTimeoutError(f"{TRAFFIC_TOPIC}[{partition}]@{offset} not read in time")

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()

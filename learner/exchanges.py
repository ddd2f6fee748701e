"""The loop that reads users' exchanges (``ratchet.traffic`` and ``ratchet.feedback``) in a
learner thread: the canary watcher's and the ratings collector's, each as its own consumer
group."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import redis
from kafka.errors import KafkaError

from ratchet.bus import make_consumer
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)


def read_exchanges(
    settings: RatchetSettings,
    group_suffix: str,
    offset_reset: Literal["earliest", "latest"],
    stopping: threading.Event,
    handle: Callable[[list[Any]], None],
    tick: Callable[[], None],
) -> None:
    """Until ``stopping``: ``tick()``, then ``handle(messages)`` for each polled batch, whose
    offsets are committed after it. Kafka, Redis and network errors are logged and retried."""
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
    if consumer is not None:
        consumer.close()

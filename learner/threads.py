"""The learner process's loop and its threads: the service's steps (learner/service.py) in the
main thread, the canary watcher (learner/canary.py) and the ratings collector
(learner/reward_training.py) each in a thread of its own. A thread that dies ends the process
(the supervisor restarts it): without its watcher no canary would ever end."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

import redis
from kafka.errors import KafkaError
from prometheus_client import start_http_server

from learner.canary import CanaryWatcher
from learner.leases import AliasLeases
from learner.ratings import joins_ratings
from learner.reward_training import RatingsCollector, RewardTrainer, reward_predictor
from ratchet.lifecycle import EventSink, Lifecycle, LifecycleError
from ratchet.records import GROUPS_TOPIC

if TYPE_CHECKING:
    from learner.service import LearnerService

log = logging.getLogger(__name__)


def run(service: LearnerService) -> None:
    """The service's steps until SIGTERM or SIGINT, retried after an outage; then a clean stop."""
    s = service.settings.learner
    start_http_server(s.metrics_port, addr=s.metrics_host, registry=service.metrics.registry)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stopping.set())
    if not connect_until_up(service):
        return
    watcher = start_canary_watcher(service)
    collector = start_ratings_collector(service)
    log.info("learner consuming %s as group %s", GROUPS_TOPIC, s.consumer_group)
    while not service.stopping.is_set():
        if not watcher.is_alive():
            # Without its watcher no canary would ever end: exit, the supervisor restarts us.
            raise SystemExit("the canary watcher thread died; see the log above")
        if collector is not None and not collector.is_alive():
            raise SystemExit("the ratings collector thread died; see the log above")
        try:
            service.step()
        except (KafkaError, redis.RedisError, OSError, LifecycleError) as exc:
            # Nothing is committed past an unfinished round: it is retried from the log.
            log.warning("learner step failed (%s); retrying", exc)
            service.metrics.failures.labels("-", type(exc).__name__).inc()
            time.sleep(1.0)
    watcher.join(timeout=10)
    if collector is not None:
        collector.join(timeout=10)
    service.lease_keeper.stop()
    service.consumers.close()
    if service.lifecycle.sink is not None:
        service.lifecycle.sink.close()


def connect_until_up(service: LearnerService) -> bool:
    """Connect to Kafka, retrying while it is unreachable; False if told to stop first."""
    while not service.stopping.is_set():
        try:
            service.consumers.connect()
            return True
        except KafkaError as exc:
            log.warning("kafka unreachable (%s); retrying", exc)
            time.sleep(1.0)
    return False


def start_canary_watcher(service: LearnerService) -> threading.Thread:
    models = service.rounds.gate.scorer.reward_models
    predictor = None if models is None else reward_predictor(service.redis, models)
    # The round loop's leases, shared: a round training on from a canary holds the alias's
    # lease for minutes, and the canary's decision must not wait for it.
    leases = service.leases.sharing("canary")
    lifecycle = Lifecycle(
        service.writer, service.store, EventSink(service.settings), actor="canary"
    )
    watcher = CanaryWatcher(
        service.settings, lifecycle, service.metrics, service.stopping, leases, predictor
    )
    thread = threading.Thread(target=watcher.run, name="canary", daemon=True)
    thread.start()
    return thread


def start_ratings_collector(service: LearnerService) -> threading.Thread | None:
    """For aliases that learn from ratings or compare their judge with them: join ratings with
    answers, train reward models."""
    settings = service.settings
    if not any(joins_ratings(c) for c in settings.aliases.values()):
        return None
    trainer = RewardTrainer(settings, service.redis, service.store, service.rounds.base_model_path)
    leases = AliasLeases(
        service.redis,
        settings.learner.lease_ttl_s,
        service.lease_keeper,
        service.metrics,
        "reward_model",
    )
    collector = RatingsCollector(
        settings,
        service.redis,
        trainer,
        leases,
        service.metrics,
        service.stopping,
        policy_training=service.rounds.training,
    )
    thread = threading.Thread(target=collector.run, name="ratings", daemon=True)
    thread.start()
    return thread

"""`ratchet learner`: scored groups in, gated candidate adapters out.

The main loop reads ``ratchet.groups`` (a consumer group, manual commits) and ``ratchet.heldout``
(all of it, no group: the gate's pool of prompts never trained on). Each group is either dropped,
counted by reason (duplicate id, all-equal rewards, sampled by a version more than
``max_staleness`` rounds of training behind where the next round starts, learning paused or
off), or waits for its alias's next round. A round (learner/round.py) runs when
``batch_groups`` wait, or with at least ``min_groups`` waiting once ``interval_s`` has passed
since the oldest one arrived and since the alias's last round or gate here ended (the judge
pauses while the learner trains and gates: the few groups in flight when a round began would
otherwise start the next one on their own the moment it ended), and only in the learner replica
holding the alias's lease
(learner/leases.py), which first drops the groups another replica has
trained meanwhile and those gone stale since they arrived (a carried candidate dropped, a
promotion). While the alias has a canary, a round runs only when it trains on from that canary
(``learner.train_during_canary``, ratchet/carry.py); its candidate is held, one per alias, and
gated once the canary has ended (its groups' offsets stay uncommitted until then). It trains
the groups sampled nearest to where it starts first: its own answers, when it carries on from a
candidate (ratchet/carry.py). No API key fills more than
``learning.max_key_share`` of a round (learner/fair.py): its surplus groups wait for later rounds
(counted), and when too many wait, the key with the most loses its oldest. A partition's offset
is committed only past groups whose round outcome is stored, and only while it is assigned here.
Canaries are watched by learner/canary.py in a thread of their own; the guard (learner/guard.py)
pauses an alias's learning after a round that shows reward hacking or collapse.

Here: what becomes of each group read, when a round is due, and one pass of the loop.
Elsewhere: the Kafka consumers and offsets (learner/intake.py), the lineage walk behind "stale"
(learner/lineage.py), work under an alias's lease (learner/under_lease.py), the round itself
(learner/round.py), held candidates (learner/held.py), imported versions (learner/imports.py),
where each candidate stands (learner/candidate.py), the loop and its threads
(learner/threads.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import redis
from kafka.errors import KafkaError
from kafka.structs import TopicPartition

from learner.fair import counts_by_key, fair_select, fair_size
from learner.guard import Guard
from learner.held import HeldRounds, train_through_canary
from learner.heldout import HeldoutPool
from learner.imports import Imports
from learner.intake import Consumers, Waiting
from learner.leases import AliasLeases
from learner.lineage import Lineage
from learner.metrics import LearnerMetrics
from learner.parallel import follow, send_stop, start_from_env
from learner.round import RoundReport, Rounds, trained_key
from learner.threads import run
from learner.trainer import LoraGRPOLearner
from learner.under_lease import AliasWork
from ratchet.carry import Start
from ratchet.lease import LeaseKeeper
from ratchet.lifecycle import EventSink, Lifecycle
from ratchet.progress import LearnerProgress
from ratchet.records import (
    GROUPS_TOPIC,
    DeadLetter,
    HeldoutPrompt,
    ScoredGroup,
    SourceMessage,
    parse,
)
from ratchet.registry import AliasRoute, InvalidRoutes, RegistryWriter
from ratchet.secrets import redis_connection_url
from ratchet.settings import ConfigError, RatchetSettings
from ratchet.store import AdapterStore

log = logging.getLogger(__name__)


def key_of_waiting(waiting: Waiting) -> str:
    return waiting.group.client


class LearnerService:
    def __init__(self, settings: RatchetSettings, base_model_path: Path) -> None:
        self.settings = settings
        self.metrics = LearnerMetrics()
        assert settings.store_dir is not None
        self.store = AdapterStore(settings.store_dir)
        self.writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
        self.redis = self.writer.redis
        self.lifecycle = Lifecycle(self.writer, self.store, EventSink(settings), actor="learner")
        self.rounds = Rounds(
            settings, base_model_path, self.store, self.lifecycle, self.metrics, self.read_heldout
        )
        self.stopping = threading.Event()
        self.waiting: dict[str, list[Waiting]] = defaultdict(list)
        self.heldout: dict[str, HeldoutPool] = defaultdict(
            lambda: HeldoutPool(settings.learner.heldout_pool)
        )
        self.routes: dict[str, AliasRoute] = {}
        self.invalid_routes = InvalidRoutes()  # no round for these until their hash is fixed
        self.routes_read_at = 0.0
        self.imports_read_at = 0.0
        self.guard = Guard(settings.learner, self.redis, self.writer, self.lifecycle, self.metrics)
        self.lineage = Lineage(self.store)
        self._starved: set[str] = set()  # aliases told to wait for held-out prompts (logged once)
        self.read_counts: Counter[str] = Counter()  # groups read per alias, not yet published
        self._reporting: set[str] = set()  # aliases whose progress this replica publishes
        self.consumers = Consumers(settings, self.metrics)
        self.lease_keeper = LeaseKeeper()
        self.leases = AliasLeases(
            self.redis, settings.learner.lease_ttl_s, self.lease_keeper, self.metrics, "round"
        )
        self.work = AliasWork(self.leases, self.lifecycle, self.metrics, self.refresh_routes)
        self.held = HeldRounds(
            self.rounds, self.work, lambda: self.routes, self.waiting, self.heldout, self.fail_round
        )
        self.imports = Imports(
            self.rounds, self.work, self.metrics, lambda: self.routes, self.waiting, self.heldout
        )
        self.resumed = False  # the held candidates a restart left in Redis, taken up once

    # --- intake ---------------------------------------------------------------------------------

    def take(self, group: ScoredGroup, partition: TopicPartition, offset: int) -> str:
        """Decide what becomes of one group: "waiting", or the reason it was dropped."""
        alias = group.alias
        config = self.settings.aliases.get(alias)
        if config is None:
            return "unknown_alias"
        if not config.learning.enabled:
            return "learning_disabled"
        route = self.routes.get(alias) or AliasRoute(alias=alias, base_model=config.base_model)
        if route.paused:
            return "paused"
        if any(w.group.group_id == group.group_id for w in self.waiting[alias]):
            return "duplicate"
        if self.redis.zscore(trained_key(alias), group.group_id) is not None:
            return "duplicate"
        self.guard.saw(group)
        if not group.rewards or max(group.rewards) == min(group.rewards):
            return "zero_spread"
        if not self.fresh(alias, group.version, route):
            return "stale"
        waiting = self.waiting[alias]
        waiting.append(Waiting(group, partition, offset))
        while len(waiting) > self.settings.learner.max_waiting_groups:
            # The oldest (most off-policy) group of the key with the most waiting: a flood from
            # one key pushes out its own groups, not the others'. Its offset is committed past.
            counts = Counter(key_of_waiting(w) for w in waiting)
            largest = max(counts, key=counts.__getitem__)
            waiting.remove(next(w for w in waiting if key_of_waiting(w) == largest))
            self.metrics.groups.labels(alias, "overflow").inc()
        return "waiting"

    def fresh(
        self, alias: str, version: int, route: AliasRoute, start: Start | None = None
    ) -> bool:
        """Whether a group sampled by ``version`` may train the alias's next round."""
        start = start or self.rounds.start_of_round(alias, route.active, route.canary)
        lag = self.lineage.policy_lag(alias, version, route.active, start)
        return lag is not None and lag <= self.settings.learner.max_staleness

    def add_heldout(self, prompt: HeldoutPrompt) -> None:
        pool = self.heldout[prompt.alias]
        pool.add(prompt)
        self.metrics.heldout.labels(prompt.alias).set(len(pool))

    # --- rounds ---------------------------------------------------------------------------------

    def ready(self, alias: str) -> bool:
        s = self.settings.learner
        waiting = self.waiting.get(alias) or []
        route = self.routes.get(alias)
        if not waiting or route is None or route.paused or alias in self.held:
            return False
        if alias in self.invalid_routes.now:
            return False
        if route.canary is not None and not self.trains_through_canary(alias, route):
            return False
        config = self.settings.aliases[alias]
        share = config.learning.max_key_share
        pairs = self.heldout[alias].pairs_available(config.gate.max_pairs, share)
        if pairs < config.gate.min_pairs:
            # A round now could not pass its gate: its groups would be spent on a sure reject.
            if alias not in self._starved:
                self._starved.add(alias)
                log.info(
                    "%s: %d groups wait for held-out prompts (%d pairs of gate.min_pairs %d, "
                    "learning.max_key_share %.2f)",
                    alias,
                    len(waiting),
                    pairs,
                    config.gate.min_pairs,
                    share,
                )
            return False
        self._starved.discard(alias)
        usable = fair_size(counts_by_key(waiting, key_of_waiting), s.batch_groups, share)
        if usable >= s.batch_groups:
            return True
        since = max(waiting[0].arrived, self.work.worked_at.get(alias, 0.0))
        return usable >= s.min_groups and time.monotonic() - since >= s.interval_s

    def trains_through_canary(self, alias: str, route: AliasRoute) -> bool:
        """Whether the alias's next round trains on from its canary (ratchet/carry.py)."""
        if not self.settings.learner.train_during_canary:
            return False
        return self.rounds.start_of_round(alias, route.active, route.canary).version == route.canary

    def run_round(self, alias: str) -> RoundReport | None:
        """A round on the waiting groups sampled nearest to where it starts, oldest first among
        equals, no key above its share (the rest wait for a later round); they stop waiting
        once its outcome is stored, or once it is held (None: a round through a canary)."""
        share = self.settings.aliases[alias].learning.max_key_share
        route = self.routes[alias]
        start = self.rounds.start_of_round(alias, route.active, route.canary)
        waiting = self.waiting[alias]
        lags = {
            id(w): self.lineage.policy_lag(alias, w.group.version, route.active, start) or 0
            for w in waiting
        }
        batch, passed_over = fair_select(
            sorted(waiting, key=lambda w: lags[id(w)]),  # stable: oldest first within a lag
            key_of_waiting,
            self.settings.learner.batch_groups,
            share,
        )
        groups = [w.group for w in batch]
        report: RoundReport | None = None
        if route.canary is not None:
            held = train_through_canary(
                self.rounds, alias, route, batch, self.heldout[alias], len(waiting), start
            )
            self.held.hold(alias, held)
        else:
            report = self.rounds.run(
                alias, route, groups, self.heldout[alias], waiting=len(waiting), start=start
            )
        spent = {id(w) for w in batch}
        self.waiting[alias] = [w for w in waiting if id(w) not in spent]
        self.metrics.deferred.labels(alias).inc(passed_over)
        self.metrics.waiting.labels(alias).set(len(self.waiting[alias]))
        self.metrics.groups.labels(alias, "trained").inc(len(batch))
        self.guard.after_round(alias, groups)
        return report

    def fail_round(self, alias: str, exc: Exception) -> None:
        """Count a round that failed (not an outage) and pause the alias with the reason: a bug
        or bad data would otherwise fail the same way forever. Its groups stay uncommitted."""
        self.metrics.failures.labels(alias, "round").inc()
        self.metrics.rounds.labels(alias, "failed").inc()
        self.guard.pause(alias, f"round_failed: {type(exc).__name__}: {str(exc)[:200]}")

    def leased_round(self, alias: str) -> list[RoundReport]:
        """A round under the alias's lease (learner/under_lease.py); none if another learner
        holds it. The groups another replica trained meanwhile, or gone stale, are dropped first."""

        def due() -> str | None:
            self.drop_trained(alias)
            self.drop_stale(alias)
            if not self.ready(alias):
                return None
            self.rounds.candidates.drop_orphans(alias)  # no other round of it runs: we lead
            return alias

        def work(_: str) -> list[RoundReport]:
            report = self.run_round(alias)
            return [] if report is None else [report]

        on_error = partial(self.fail_round, alias)
        return self.work.under_lease(alias, "round", due, work, on_error) or []

    def drop_trained(self, alias: str) -> None:
        """Drop waiting groups whose round outcome is stored (by another learner, which read
        them too before a rebalance moved their partition)."""
        waiting = self.waiting.get(alias) or []
        if not waiting:
            return
        scores = self.redis.zmscore(trained_key(alias), [w.group.group_id for w in waiting])
        keep = [w for w, score in zip(waiting, scores, strict=True) if score is None]
        if len(keep) < len(waiting):
            self.metrics.groups.labels(alias, "duplicate").inc(len(waiting) - len(keep))
            self.waiting[alias] = keep
            self.metrics.waiting.labels(alias).set(len(keep))

    def drop_stale(self, alias: str) -> None:
        """Drop waiting groups that went stale since they arrived: the candidate that sampled
        them is no longer carried, or promotions moved the live version on."""
        waiting = self.waiting.get(alias) or []
        route = self.routes.get(alias)
        if not waiting or route is None:
            return
        start = self.rounds.start_of_round(alias, route.active, route.canary)
        keep = [w for w in waiting if self.fresh(alias, w.group.version, route, start)]
        if len(keep) < len(waiting):
            self.metrics.groups.labels(alias, "stale").inc(len(waiting) - len(keep))
            self.waiting[alias] = keep
            self.metrics.waiting.labels(alias).set(len(keep))

    # --- the loop -------------------------------------------------------------------------------

    def commit_offsets(self) -> None:
        pending = [w for waiting in self.waiting.values() for w in waiting]
        self.consumers.commit([*self.held.unsettled(), *pending])

    def forget_revoked(self) -> None:
        """Forget the revoked partitions' waiting groups: the new owner reads them again from the
        committed offset (and drops those whose round outcome is stored by then)."""
        partitions = self.consumers.take_revoked()
        if not partitions:
            return
        for alias, waiting in self.waiting.items():
            self.waiting[alias] = [w for w in waiting if w.partition not in partitions]
            self.metrics.waiting.labels(alias).set(len(self.waiting[alias]))
        self.held.forget(partitions)

    def read_heldout(self) -> None:
        """Add the held-out prompts that arrived since the last read to the pools. Their consumer
        has no group and commits nothing, so a round may call this between training and its
        gate; there an outage leaves the pool as it is (the gate draws what it holds)."""
        for prompt in self.consumers.read_heldout():
            self.add_heldout(prompt)

    def poll(self) -> None:
        self.read_heldout()
        polled = self.consumers.poll_groups()
        self.forget_revoked()
        if not polled:
            return
        self.refresh_routes()
        for tp, messages in polled.items():
            for message in messages:
                try:
                    alias = self.intake(message, tp)
                except (KafkaError, redis.RedisError, OSError):
                    # An outage: read this message and the rest of the batch again once the
                    # step is retried, instead of reading on past them.
                    self.consumers.rewind(polled)
                    raise
                self.consumers.read(tp, message)
                if alias is not None:
                    self.read_counts[alias] += 1
        for alias, waiting in self.waiting.items():
            self.metrics.waiting.labels(alias).set(len(waiting))

    def intake(self, message: SourceMessage, tp: TopicPartition) -> str | None:
        """One message of ratchet.groups: taken, dropped with a counted outcome, or (when it is
        not a group, or this code fails on it) dead-lettered, so it can never stop the others.
        Returns the configured alias of the group read, whatever became of it."""
        record = parse(GROUPS_TOPIC, message.value)
        if isinstance(record, str):  # counted by parse; another schema is skipped, per contract
            if record != "unknown_schema":
                self.dead_letter(message, "-", record)
            return None
        if not isinstance(record, ScoredGroup):
            return None
        alias = record.alias if record.alias in self.settings.aliases else "-"
        try:
            outcome = self.take(record, tp, message.offset)
        except (KafkaError, redis.RedisError, OSError):
            raise  # an outage, not this record's fault
        except Exception as exc:
            log.exception("group at offset %d could not be taken; dead-lettered", message.offset)
            self.dead_letter(message, alias, "handler_error", f"{type(exc).__name__}: {exc}")
            return None if alias == "-" else alias
        if outcome != "waiting":
            self.metrics.groups.labels(record.alias, outcome).inc()
        return None if alias == "-" else alias

    def dead_letter(self, message: SourceMessage, alias: str, reason: str, error: str = "") -> None:
        self.metrics.failures.labels(alias, reason).inc()
        consumer = self.settings.learner.consumer_group
        self.lifecycle.unsent.append(DeadLetter.of_message(message, consumer, reason, error))

    def refresh_routes(self) -> None:
        table = self.writer.read_all(self.routes)
        changed = [
            route
            for alias, route in table.routes.items()
            if (route.active, route.canary) != self.versions_of(alias)
        ]
        self.routes = table.routes
        # A canary ended (by whoever decided it): its candidate promoted or rejected.
        self.rounds.candidates.follow_route(changed)
        for alias in self.invalid_routes.update(table.invalid):
            self.metrics.failures.labels(alias, "invalid_route").inc()
        self.routes_read_at = time.monotonic()
        for alias, route in self.routes.items():
            self.metrics.active_version.labels(alias).set(route.active)
        self.guard.track(self.routes)

    def step(self) -> list[RoundReport]:
        """One pass of the loop: read, run the rounds that are due, commit."""
        if not self.resumed:
            self.held.resume(self.settings.aliases)
            self.resumed = True
        self.poll()
        if time.monotonic() - self.routes_read_at >= 1.0:
            self.refresh_routes()  # operators' pauses and promotions show in the metrics too
        due = [alias for alias in list(self.waiting) if self.ready(alias)]
        self.publish_progress()  # before any round: the judge learns of the reads at once
        reports = []
        for alias in due:
            self.refresh_routes()
            if self.ready(alias):
                reports += self.leased_round(alias)
        for alias in list(self.held.held):
            reports += self.held.settle(alias)
        if time.monotonic() - self.imports_read_at >= 1.0:
            self.imports_read_at = time.monotonic()
            for alias in self.imports.waiting_aliases():
                self.imports.gate_next(alias)
        # Events first: a round's outcome is in Redis; its events must reach Kafka before the
        # offsets move on (retried here until they do).
        if self.lifecycle.flush_events(raise_errors=False):
            self.commit_offsets()
        return reports

    def versions_of(self, alias: str) -> tuple[int, int | None] | None:
        route = self.routes.get(alias)
        return None if route is None else (route.active, route.canary)

    def publish_progress(self) -> None:
        """Each alias's progress between rounds, with the groups read since the last call. Only
        for aliases this replica reads or holds groups of (their partition is ours), and once
        more when it stops, so its hash does not claim groups it no longer holds."""
        reads, self.read_counts = self.read_counts, Counter()
        for alias in self.settings.aliases:
            waiting = len(self.waiting.get(alias) or ())
            read = reads.get(alias, 0)
            if not (read or waiting or alias in self._reporting):
                continue
            if read or waiting:
                self._reporting.add(alias)
            else:
                self._reporting.discard(alias)
            route = self.routes.get(alias)
            progress = LearnerProgress(
                alias,
                phase="waiting_heldout" if waiting and alias in self._starved else "idle",
                waiting=waiting,
                batch_groups=self.settings.learner.batch_groups,
                heldout=len(self.heldout[alias]),
                version=route.active if route else 0,
            )
            self.rounds.progress.report(progress, read_delta=read)


def base_model(settings: RatchetSettings) -> Path:
    """The base weights the learner trains adapters of: ``learner.base_model_path``, which a
    deployment must set (the embedded dev stack sets it for its own model)."""
    path = settings.learner.base_model_path
    if not path:
        raise ConfigError(
            "the learner needs its base model: set learner.base_model_path in ratchet.yaml (or "
            "RATCHET_LEARNER__BASE_MODEL_PATH) to the folder of the weights vLLM serves as "
            "--model"
        )
    return Path(path)


def serve(settings: RatchetSettings) -> None:
    base = base_model(settings)  # before anything starts: a refusal leaves nothing behind
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.learner.cpu_threads is not None:  # for every model the learner runs
        import torch

        torch.set_num_threads(settings.learner.cpu_threads)
    ranks = start_from_env(settings.learner.device)  # torchrun: data parallel rounds
    if ranks.rank > 0:
        follow_rounds(settings, base)
        return
    run(LearnerService(settings, base))
    if ranks.size > 1:  # a clean stop; after a failure torchrun stops the other ranks
        send_stop()


def follow_rounds(settings: RatchetSettings, base: Path) -> None:
    """A rank other than 0: trains each round rank 0 leads (learner/parallel.py), nothing else."""
    s = settings.learner
    device = None if s.device == "auto" else s.device
    follow(LoraGRPOLearner(base, s.lora, s, device=device))

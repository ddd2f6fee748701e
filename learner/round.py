"""One round for one alias: train -> write -> gate -> outcome.

1. train: load the live version's adapter and optimizer state (a fresh LoRA on v0), or those of
   a rejected candidate not shown worse (ratchet/carry.py), take ``steps_per_round`` GRPO
   steps (learner/trainer.py);
2. write: the next version number from Redis ``INCR``, the adapter written atomically to the
   store (``base_model_name_or_path`` = vLLM's ``--model``), a ``candidate`` event;
3. gate: first every vLLM replica must serve what was trained (learner/served_check.py, with
   the fingerprint and drift step 1 measured, learner/drift.py), else the candidate is rejected
   with a reason that names the replica; then the candidate against the live version on
   held-out prompts drawn at random from the pool, seeded by the candidate's version, no key
   above ``learning.max_key_share`` of them (learner/heldout.py, learner/gate.py);
4. outcome: canary (or promote at once when ``canary.weight`` is 0) or reject, written to Redis
   in ONE transaction with the ids of the groups the round used and where the next round starts.

A round that starts from the alias's canary (ratchet/carry.py: the next round trains on from it
while its canary runs) stops after step 2: its candidate is *held* (learner/held.py), gated and
settled once the canary has ended, against the version live then. Imported versions are gated
and settled as a round's candidate is, without training (learner/imports.py). Where each
candidate stands is one value, moved in one place (learner/candidate.py).

The service commits the groups' offsets only after step 4. A learner killed before step 4
re-reads the groups and trains them again (a new version number; the orphaned folder is never
served). Killed after step 4, it re-reads them and drops them all as duplicates: a round's
outcome is never applied twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from learner.canary_weight import canary_weight, requests_per_second
from learner.candidate import Candidate, Candidates, Stage
from learner.drift import DRIFT_KEY, Measures
from learner.drift_state import keep_drift
from learner.gate import Gate
from learner.gate_verdict import GateResult
from learner.gating import gate_candidate
from learner.heldout import HeldoutPool
from learner.metrics import LearnerMetrics
from learner.parallel import lead_round
from learner.rank_failure import RanksFailed
from learner.reporter import ProgressReporter
from learner.round_stats import RoundStats, StepProgress
from learner.sharded_forwards import sharded_forwards
from learner.trainer import LoraGRPOLearner
from ratchet.bill import Bill, total
from ratchet.canary_state import reset_counts
from ratchet.carry import Start, carry_after, read_carry, start_of_round, write_carry
from ratchet.lifecycle import Lifecycle
from ratchet.progress import LearnerProgress, Phase
from ratchet.records import ScoredGroup
from ratchet.registry import AliasRoute
from ratchet.rewards.reward_model import RewardModels
from ratchet.rewards.reward_status import RewardStatus
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.store import AdapterStore
from ratchet.versions import next_version

log = logging.getLogger(__name__)

TRAINED_TTL_S = 30 * 24 * 3600  # a group id older than the topic's retention cannot come back


def trained_key(alias: str) -> str:
    """Sorted set of the group ids whose round outcome is stored (score: when)."""
    return f"ratchet:learner:{alias}:trained"


def mark_trained(pipe: Any, alias: str, ids: list[str], keep: int) -> None:
    """Queue the groups' ids as trained (a round's outcome is stored) on a Redis pipeline; the
    set keeps the newest ``keep`` (``learner.trained_groups_max``) within TRAINED_TTL_S."""
    now = time.time()
    pipe.zadd(trained_key(alias), {gid: now for gid in ids})
    pipe.zremrangebyscore(trained_key(alias), 0, now - TRAINED_TTL_S)
    pipe.zremrangebyrank(trained_key(alias), 0, -keep - 1)


def training_bill(groups: list[ScoredGroup], stats: RoundStats) -> Bill:
    """What a round cost before its gate: its groups' sampling and judging (as the judge billed
    each) and its training (answer tokens trained on, seconds)."""
    bill = total(g.bill for g in groups)
    bill.add(Bill(train_tokens=stats.completion_tokens, train_seconds=stats.seconds))
    return bill


@dataclass(frozen=True)
class Gated:
    """A candidate once its gate has spoken: what :meth:`Rounds.settle` writes. ``live`` is the
    version it was gated against, ``start`` where its round started; ``bill`` its whole cost,
    its gate's included."""

    alias: str
    version: int
    live: int
    start: Start
    group_ids: list[str]
    mean_reward: float
    result: GateResult
    bill: Bill


@dataclass
class Left:
    """The groups a round leaves waiting, reported once it is over (:meth:`Rounds.reporting`)."""

    count: int


@dataclass
class RoundReport:
    alias: str
    version: int
    stats: RoundStats
    gate: GateResult
    outcome: str  # promoted | canary | rejected


class Rounds:
    """Runs rounds, and keeps what they share: the trainer (its base model loaded on the first
    round, then kept in memory) and the gate."""

    def __init__(
        self,
        settings: RatchetSettings,
        base_model_path: Path,
        store: AdapterStore,
        lifecycle: Lifecycle,
        metrics: LearnerMetrics,
        read_heldout: Callable[[], None] = lambda: None,
    ) -> None:
        """``read_heldout`` adds the held-out prompts that arrived since it last ran to the
        pools rounds are given: the gate calls it before it draws, so what came in while the
        round trained (minutes, at the speed of traffic) is drawn too."""
        self.settings = settings
        self.read_heldout = read_heldout
        self.base_model_path = base_model_path
        self.store = store
        self.lifecycle = lifecycle
        self.redis = lifecycle.writer.redis
        self.metrics = metrics
        assert settings.store_dir is not None
        self.gate = Gate(
            settings,
            RewardModels(settings.store_dir, base_model_path),
            lambda alias: RewardStatus.read(self.redis, alias),
        )
        ejections = metrics.gate_replica_ejections
        self.gate.replicas.on_ejected = lambda url: ejections.labels(url).inc()
        self._trainer: LoraGRPOLearner | None = None
        # Set while a round trains the policy: the reward models' retrains wait for it to clear.
        self.training = threading.Event()
        # Shared with the service's loop: one throttle and one view of what Redis holds.
        self.progress = ProgressReporter(self.redis, metrics)
        self._progress: dict[str, LearnerProgress] = {}  # each running round's, as reported
        self.candidates = Candidates(self.redis, metrics.candidate_record_errors)
        # Served equals trained: each round's drift and each candidate's fingerprint.
        self.measures = Measures(settings, metrics)

    def run(
        self,
        alias: str,
        route: AliasRoute,
        groups: list[ScoredGroup],
        heldout: HeldoutPool,
        waiting: int | None = None,
        start: Start | None = None,
    ) -> RoundReport:
        """A round on ``groups``, gated on prompts drawn from the alias's ``heldout`` pool.
        ``waiting``: the alias's groups waiting, the round's included (default: the round's);
        ``start``: where it starts (default: :meth:`start_of_round`).
        Each phase is published as the alias's progress, and ``idle`` once the round is over,
        however it ended."""
        config = self.settings.aliases[alias]
        waiting = len(groups) if waiting is None else waiting
        with self.reporting(alias, route, heldout, waiting) as left:
            start = start or self.start_of_round(alias, route.active, route.canary)
            stats = self.train(alias, route.active, start, groups)
            version = self.write(alias, route.active, start, groups, stats)
            result = gate_candidate(self, alias, config, route, version, heldout)
            bill = training_bill(groups, stats) + (result.bill or Bill())
            ids = [g.group_id for g in groups]
            gated = Gated(alias, version, route.active, start, ids, stats.mean_reward, result, bill)
            outcome = self.settle(gated)
            left.count = max(0, waiting - len(groups))
        return RoundReport(alias, version, stats, result, outcome)

    @contextlib.contextmanager
    def reporting(
        self, alias: str, route: AliasRoute, heldout: HeldoutPool, waiting: int
    ) -> Iterator[Left]:
        """The progress a round (or an import's gate) publishes while it runs (:meth:`report`),
        and ``idle`` once it is over, however it ended, with the groups it leaves waiting: all
        ``waiting`` unless the round sets what it took (a round that fails leaves them)."""
        self._progress[alias] = LearnerProgress(
            alias,
            waiting=waiting,
            batch_groups=self.settings.learner.batch_groups,
            heldout=len(heldout),
            version=route.active,
            round_started_at=time.time(),
        )
        left = Left(waiting)
        try:
            yield left
        finally:
            self.report(alias, "idle", waiting=left.count, round_started_at=0.0)
            del self._progress[alias]

    def report(self, alias: str, phase: Phase | None = None, **changes: Any) -> None:
        """Publish the running round's progress with these changes; a new phase resets its
        counters and detail, and is logged."""
        current = self._progress.get(alias)
        if current is None:  # no round of ours runs for the alias
            return
        if phase is not None and phase != current.phase:
            changes = {"step": 0, "steps": 0, "detail": "", **changes, "phase": phase}
        progress = replace(current, **changes)
        self._progress[alias] = progress
        if progress.phase != current.phase:
            log.info("%s: %s", alias, progress.describe())
        self.progress.report(progress)

    def report_gate_pair(self, alias: str, answered: int, detail: str) -> None:
        """The gate's progress: ``answered`` of the pairs drawn, and its running result."""
        self.report(alias, step=answered, detail=detail)

    def trainer(self) -> LoraGRPOLearner:
        if self._trainer is None:
            s = self.settings.learner
            device = None if s.device == "auto" else s.device
            self._trainer = LoraGRPOLearner(self.base_model_path, s.lora, s, device=device)
            # Adapters must name their base exactly as vLLM's --model does, not a normalised path.
            self._trainer.base_model_id = s.base_model_path or str(self.base_model_path)
        return self._trainer

    def next_version(self, alias: str) -> int:
        return next_version(self.redis, self.store, alias)

    def start_of_round(self, alias: str, live: int, canary: int | None = None) -> Start:
        """The live version, or the carried candidate when there is one for it (ratchet/carry.py;
        the alias's ``canary`` among them) and its folder is still in the store."""
        start = start_of_round(
            read_carry(self.redis, alias), live, self.settings.learner.max_candidate_rounds, canary
        )
        if start.carried and not self.store.exists(alias, start.version):
            log.warning("%s: carried v%d is not in the store: starting from v%d",
                        alias, start.version, live)  # fmt: skip
            return Start(live)
        return start

    # --- the steps --------------------------------------------------------------------------

    def train(self, alias: str, live: int, start: Start, groups: list[ScoredGroup]) -> RoundStats:
        if start.carried:
            log.info(
                "%s: round on %d groups from candidate v%d (round %d beyond v%d): training",
                alias, len(groups), start.version, start.rounds + 1, live,
            )  # fmt: skip
        else:
            log.info("%s: round on %d groups from v%d: training", alias, len(groups), live)
        trainer = self.trainer()
        started = time.perf_counter()
        steps = self.settings.learner.steps_per_round
        self.report(alias, "train", version=start.version, steps=steps)
        adapter = self.store.path(alias, start.version) if start.version > 0 else None
        if trainer.ranks.size > 1:  # the other ranks train the round with us
            # A load that fails on any rank fails on all; sharded, the followers run the drift's
            # and the fingerprint's forwards with us (learner/sharded_forwards.py).
            forwards = sharded_forwards(self.measures, trainer, start.version)
            lead_round(trainer, groups, adapter, forwards)
        else:
            trainer.load_adapter(adapter)
        self.measures.before_training(trainer, alias, start.version, groups)
        # Where the canary watcher sees it: a canary this round trains on from is stopped by it.
        keep_drift(self.redis, alias, self.measures.drift.get(alias))

        def on_step(step: StepProgress) -> None:
            self.metrics.step_loss.labels(alias).set(step.loss)
            self.report(alias, step=step.step, steps=step.steps, detail=step.line())

        self.training.set()
        try:
            stats = trainer.train_round(groups, on_step)
        except RanksFailed:  # every rank ended the round at the same step: the alias is paused
            raise
        except Exception as exc:
            if trainer.ranks.size > 1:
                # Failed inside a collective (FSDP's gathers, a timed-out sum): the other ranks
                # are out of step with this one. End the process group (torchrun restarts it).
                raise SystemExit(f"data-parallel round failed: {exc!r}") from exc
            raise
        finally:
            self.training.clear()
        self.measures.after_training(trainer, alias)  # sharded: the fingerprint, with every rank
        self.metrics.round_seconds.labels(alias, "train").observe(time.perf_counter() - started)
        m = self.metrics
        m.train_reward.labels(alias).set(stats.mean_reward)
        m.train_tokens.labels(alias).inc(stats.completion_tokens)
        m.tokens_per_second.labels(alias).set(stats.tokens_per_second)
        if stats.loss == stats.loss:  # not NaN
            m.loss.labels(alias).set(stats.loss)
            m.clip_fraction.labels(alias).set(stats.clip_frac_low + stats.clip_frac_high)
            m.approx_kl.labels(alias).set(stats.approx_kl)
        m.epochs.labels(alias).set(stats.epochs)
        return stats

    def write(
        self,
        alias: str,
        parent: int,
        start: Start,
        groups: list[ScoredGroup],
        stats: RoundStats,
        stage: Stage = Stage.TRAINED,
    ) -> int:
        """The candidate written to the store as the next version, and its ``candidate`` event.
        Its ``parent`` is the version it would replace, the live one (or the canary it trained on
        from: live by the time it is gated); the lineage rollbacks and staleness walk follows
        it. ``trained_from`` is where its weights started, ``start.rounds`` beyond ``parent``.
        Its candidate record starts at ``stage`` (held: trained on from a canary), in the same
        transaction as the event, so no crash leaves it at a stage it never meant."""
        version = self.next_version(alias)
        self.report(alias, "write", version=version)
        served = self.measures.for_candidate(self.trainer(), alias)
        self.trainer().save_candidate(
            self.store,
            alias,
            version,
            parent=parent,
            meta={
                "group_ids": [g.group_id for g in groups],
                "alias": alias,
                "trained_from": start.version,
                "rounds_beyond_parent": start.rounds + 1,
                **served,
            },
        )
        summary = {k: v for k, v in stats.as_dict().items() if k != "round"}
        summary["trained_from"] = start.version
        # What scored the groups: the guard compares training rewards only between rounds
        # scored alike (a retrained reward model moves the reward by itself).
        summary["judged_by"] = sorted({g.judge_model or "" for g in groups})
        if DRIFT_KEY in served:  # for the console's rounds table
            summary[DRIFT_KEY] = served[DRIFT_KEY]
        candidate = Candidate(
            alias,
            version,
            parent,
            stage,
            group_ids=tuple(g.group_id for g in groups),
            stats=stats.as_dict(),
            bill=training_bill(groups, stats).as_dict(),
        )
        self.lifecycle.record(
            self.lifecycle.event(
                alias, "candidate", version=version, previous_version=parent, detail=summary
            ),
            also=partial(self.candidates.add, candidate),
        )
        log.info(
            "%s: candidate v%d trained on %d groups (reward %.3f, %.1fs)",
            alias,
            version,
            len(groups),
            stats.mean_reward,
            stats.seconds,
        )
        return version

    def settle(self, gated: Gated) -> str:
        """Reject, start a canary or promote, in one transaction with the groups marked trained
        and the carry for the next round. A gate that failed leaves the carry as it was. The
        outcome's event carries the round's bill."""
        alias, result = gated.alias, gated.result
        config = self.settings.aliases[alias]
        self.report(alias, "settle", detail=result.reason)
        carry = carry_after(
            gated.start,
            gated.live,
            gated.version,
            result.passed,
            result.win_rate,
            result.ci_high,
            config.gate.threshold,
            to_canary=config.canary.weight > 0 and self.settings.learner.train_during_canary,
        )

        def spend(pipe: Any) -> None:
            mark_trained(pipe, alias, gated.group_ids, self.settings.learner.trained_groups_max)
            if result.win_rate is not None:
                write_carry(pipe, alias, carry)

        detail = {
            "gate": result.as_dict(),
            "mean_reward": gated.mean_reward,
            "bill": gated.bill.as_dict(),
        }
        outcome = self.decide(alias, config, gated.version, result, detail, spend)
        if carry is not None and carry.canary:
            log.info("%s: the next round trains on from v%d while its canary runs",
                     alias, gated.version)  # fmt: skip
        elif carry is not None:
            log.info("%s: v%d not shown worse (win rate %.3f): the next round trains on from it",
                     alias, gated.version, carry.win_rate)  # fmt: skip
        return outcome

    def decide(
        self,
        alias: str,
        config: AliasConfig,
        version: int,
        result: GateResult,
        detail: dict[str, Any],
        also: Callable[[Any], None],
    ) -> str:
        """Reject, start a canary or promote on the gate's ``result``; ``also`` writes in the
        same transaction what else the outcome settles."""

        def moved(stage: Stage, reason: str = "") -> Callable[[Any], None]:
            def write(pipe: Any) -> None:
                also(pipe)
                self.candidates.reached(alias, version, stage, reason, pipe)
                if stage == Stage.CANARY:
                    reset_counts(pipe, alias, version)

            return write

        if not result.passed:
            outcome = "rejected"
            self.lifecycle.reject(
                alias,
                version,
                {"reason": result.reason, **detail},
                also=moved(Stage.REJECTED, result.reason),
            )
        elif config.canary.weight > 0:
            outcome = "canary"
            rate = requests_per_second(self.redis, alias)
            weight = canary_weight(config.canary, rate)
            detail["requests_per_minute"] = round(rate * 60, 1)
            self.lifecycle.start_canary(alias, version, weight, detail, also=moved(Stage.CANARY))
        else:
            outcome = "promoted"
            self.lifecycle.promote(alias, version, detail, also=moved(Stage.PROMOTED))
        self.metrics.rounds.labels(alias, outcome).inc()
        self.metrics.last_round_timestamp.labels(alias).set(time.time())
        log.info("%s: v%d %s (%s)", alias, version, outcome, result.reason)
        return outcome

"""A candidate's gate as a round runs it: every vLLM replica checked to serve what was trained
(learner/served_check.py: one that serves other weights fails the gate with a reason that names
it; one that cannot load the candidate is out of its rotation, ratchet/version_exclusion.py, and
the gate and canary go on without it), the held-out prompts drawn, the gate asked
(learner/gate.py), and what its verdict leaves behind: the ``gate`` event, the judge's spend,
the first pairs for the console. The candidate moves to ``gating`` (learner/candidate.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import redis
from kafka.errors import KafkaError

from learner.drift import DRIFT_KEY, FINGERPRINT_KEY, drift_block
from learner.fingerprint import Fingerprint
from learner.gate import GateError
from learner.gate_verdict import GateResult
from learner.heldout import HeldoutPool
from learner.served_check import ServedVerdict, check_replicas
from ratchet.bill import Bill
from ratchet.gate_pairs import write_gate_pairs
from ratchet.records import HeldoutPrompt
from ratchet.registry import AliasRoute, served_name
from ratchet.settings import AliasConfig
from ratchet.spend import add_spend
from ratchet.version_exclusion import exclude, read_versions

if TYPE_CHECKING:
    from learner.round import Rounds

log = logging.getLogger(__name__)


def gate_candidate(
    rounds: Rounds,
    alias: str,
    config: AliasConfig,
    route: AliasRoute,
    version: int,
    heldout: HeldoutPool,
) -> GateResult:
    """The gate's verdict on the candidate against the live version, and its ``gate`` event."""
    live = route.active
    started = time.perf_counter()
    seed = rounds.settings.learner.seed
    try:
        rounds.read_heldout()
    except (KafkaError, OSError) as exc:
        log.warning("%s: held-out prompts not read before the gate: %s", alias, exc)
    # Seeded by the version: each round draws afresh, and a round's draw can be replayed.
    prompts = heldout.draw(
        config.gate.max_pairs, config.learning.max_key_share, f"{seed}:{alias}:{version}"
    )
    log.info("%s: gating v%d against v%d on %d held-out pairs", alias, version, live, len(prompts))
    rounds.report(alias, "gate", steps=len(prompts))
    rounds.candidates.begin_gate(alias, version, live)
    candidate = served_name(alias, version, route.base_model)
    blocked = served_block(rounds, alias, version, candidate)
    if blocked is not None:  # never gated, so never a canary
        result = not_gated(config, blocked)
        rounds.metrics.failures.labels(alias, "served").inc()
    else:
        load_exclusions(rounds, alias, (live, version))
        result = ask_gate(rounds, alias, config, prompts, candidate, route)
    seconds = time.perf_counter() - started
    rounds.metrics.round_seconds.labels(alias, "gate").observe(seconds)
    account_gate_judge(rounds, alias, result.bill)
    # The gate's cost: its judge calls (Gate.evaluate) and its time, timed once, here.
    result = replace(result, bill=(result.bill or Bill()) + Bill(gate_seconds=seconds))
    keep_gate_pairs(rounds, alias, version, result)
    rounds.lifecycle.record(
        rounds.lifecycle.event(
            alias, "gate", version=version, previous_version=live, detail=result.as_dict()
        )
    )
    if result.win_rate is not None:
        rounds.metrics.gate_win_rate.labels(alias).set(result.win_rate)
        rounds.metrics.gate_ci_low.labels(alias).set(result.ci_low or 0.0)
    return result


def served_block(rounds: Rounds, alias: str, version: int, candidate: str) -> str | None:
    """Why the candidate must not be gated: its round's drift past the tolerance, or a replica
    that does not serve what was trained (learner/served_check.py); None when it may be."""
    if not rounds.settings.learner.served_check.enabled:
        return None
    try:
        meta = rounds.store.meta(alias, version)
    except (OSError, ValueError):
        meta = {}
    drift = drift_block(meta.get(DRIFT_KEY), rounds.settings)
    if drift is not None:
        log.warning("%s: v%d not gated: %s", alias, version, drift)
        return drift
    fingerprint = Fingerprint.from_dict(meta.get(FINGERPRINT_KEY))
    verdict = check_replicas(rounds.settings, rounds.metrics, alias, candidate, fingerprint)
    if not verdict.passed:
        return verdict.reason
    return exclude_unloaded(rounds, alias, version, verdict)


def exclude_unloaded(
    rounds: Rounds, alias: str, version: int, verdict: ServedVerdict
) -> str | None:
    """The replicas that could not load the candidate out of its rotation, before its gate: in
    Redis for the proxies (and the canary that follows), and in the gate's own replicas. None
    when done; why the candidate must not be gated when the exclusion could not be kept (its
    canary would reach the replicas that cannot serve it)."""
    if not verdict.excluded:
        return None
    reasons = {c.replica: c.describe(verdict.limit) for c in verdict.excluded}
    ttl_s = rounds.settings.learner.served_check.exclusion_ttl_s
    try:
        exclude(rounds.redis, alias, version, reasons, ttl_s)
    except (redis.RedisError, OSError) as exc:
        return f"{verdict.reason}; the exclusion was not kept: {exc}"
    rounds.gate.replicas.exclusions.add(alias, version, reasons)
    log.warning("%s: v%d %s", alias, version, verdict.reason)
    return None


def load_exclusions(rounds: Rounds, alias: str, versions: tuple[int, ...]) -> None:
    """The gate's replicas told every exclusion of the versions it compares, as Redis has them:
    the active version's were written by an earlier round, which a restarted learner's gate
    would not know, and would send that version's requests to a replica that cannot serve it.
    Redis away: the gate keeps what it knows (the candidate's, added by
    :func:`exclude_unloaded`)."""
    try:
        found = read_versions(rounds.redis, alias, versions)
    except (redis.RedisError, OSError) as exc:
        log.warning("%s: exclusions of v%s not read for the gate: %s", alias, versions, exc)
        return
    rounds.gate.replicas.exclusions.set_alias(alias, found)


def ask_gate(
    rounds: Rounds,
    alias: str,
    config: AliasConfig,
    prompts: list[HeldoutPrompt],
    candidate: str,
    route: AliasRoute,
) -> GateResult:
    """The gate's verdict on the ``candidate`` (a served name) against the live version."""
    try:
        return asyncio.run(
            rounds.gate.evaluate(
                alias,
                config,
                prompts,
                candidate,
                served_name(alias, route.active, route.base_model),
                seed=rounds.settings.learner.seed,
                progress=lambda scored, drawn, win_rate: rounds.report_gate_pair(
                    alias, scored, f"win rate {win_rate:.3f} after {scored} of {drawn} pairs"
                ),
            )
        )
    except GateError as exc:
        rounds.metrics.failures.labels(alias, "gate").inc()
        return not_gated(config, f"gate failed: {exc}")


def not_gated(config: AliasConfig, reason: str) -> GateResult:
    """A failed verdict without pairs: the gate could not, or must not, compare the versions."""
    return GateResult(
        passed=False,
        reason=reason,
        pairs=0,
        win_rate=None,
        ci_low=None,
        ci_high=None,
        threshold=config.gate.threshold,
        min_pairs=config.gate.min_pairs,
    )


def account_gate_judge(rounds: Rounds, alias: str, bill: Bill | None) -> None:
    """The gate's judge calls in the counters and in the alias's judge spend today (the
    learning.max_cost_per_day budget the judge enforces); a Redis outage loses the spend."""
    if bill is None or not bill.judge_calls:
        return
    rounds.metrics.gate_judge_calls.labels(alias).inc(bill.judge_calls)
    rounds.metrics.gate_judge_cost.labels(alias).inc(bill.judge_cost_usd)
    try:
        add_spend(rounds.redis, alias, bill.judge_cost_usd)
    except (redis.RedisError, OSError) as exc:
        log.warning("%s: the gate's judge spend was not recorded: %s", alias, exc)


def keep_gate_pairs(rounds: Rounds, alias: str, version: int, result: GateResult) -> None:
    """The gate's first pairs, for the console; losing them loses nothing else."""
    try:
        write_gate_pairs(rounds.redis, alias, version, list(result.sample))
    except (redis.RedisError, OSError) as exc:
        log.warning("%s: gate pairs of v%d not kept: %s", alias, version, exc)

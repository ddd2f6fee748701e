"""A candidate's gate as a round runs it: the held-out prompts drawn, the gate asked
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

from learner.gate import GateError
from learner.gate_verdict import GateResult
from learner.heldout import HeldoutPool
from ratchet.bill import Bill
from ratchet.gate_pairs import write_gate_pairs
from ratchet.registry import AliasRoute, served_name
from ratchet.settings import AliasConfig
from ratchet.spend import add_spend

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
    try:
        result = asyncio.run(
            rounds.gate.evaluate(
                alias,
                config,
                prompts,
                served_name(alias, version, route.base_model),
                served_name(alias, live, route.base_model),
                seed=seed,
                progress=lambda scored, drawn, win_rate: rounds.report_gate_pair(
                    alias, scored, f"win rate {win_rate:.3f} after {scored} of {drawn} pairs"
                ),
            )
        )
    except GateError as exc:
        result = GateResult(
            passed=False,
            reason=f"gate failed: {exc}",
            pairs=0,
            win_rate=None,
            ci_low=None,
            ci_high=None,
            threshold=config.gate.threshold,
            min_pairs=config.gate.min_pairs,
        )
        rounds.metrics.failures.labels(alias, "gate").inc()
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

"""What the console's pages show, read from Redis and the adapter store into plain records.

Nothing here renders or writes: each function reads one thing an operator asks about (which
version answers, how the canary is doing, what the last rounds did, what the gate compared) and
returns it as data for the templates (console/render.py). Everything is read from the kernel's
keys (ratchet/registry.py, canary_state.py, rounds.py, gate_pairs.py, progress.py, rewards/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from ratchet.bill import Bill
from ratchet.canary_state import ArmStats, read_counts, read_ratings_summary
from ratchet.gate_pairs import GatePair, read_gate_pairs
from ratchet.progress import read_progress
from ratchet.registry import AliasRoute, RegistryWriter, served_name
from ratchet.reward_guard_state import guard_line
from ratchet.rewards.agreement import probes_agreement, read_agreement
from ratchet.rewards.reward_status import RewardStatus, describe_reward_model
from ratchet.rounds import RoundRow, promotion_bills, rounds_of
from ratchet.secrets import redis_connection_url
from ratchet.settings import RatchetSettings
from ratchet.spend import budget_line, read_spend
from ratchet.store import AdapterStore

HISTORY_READ = 500  # lifecycle events read per alias page
EVENTS_SHOWN = 20


@dataclass(frozen=True)
class CanaryView:
    version: int
    weight: float
    arms: dict[str, ArmStats]
    ratings: dict[str, Any] | None  # the sequential test's summary, once the watcher checked


@dataclass(frozen=True)
class AliasSummary:
    """One row of the overview."""

    alias: str
    active: int
    served_as: str
    canary: CanaryView | None
    paused: bool
    pause_reason: str | None
    learner: str  # what the learner is doing, one line
    reward_model: str | None  # for aliases that learn from ratings
    agreement: str | None  # for aliases judged by RULER
    last_round: RoundRow | None
    judge_spend: str = ""  # today's judge spend, against learning.max_cost_per_day when set
    # What the canary's reward-hacking guard said of the canary, or of the active version it
    # was promoted as (learner/reward_guard.py): "could not check" shows here.
    reward_guard: str | None = None


@dataclass(frozen=True)
class VersionNode:
    """One version in the alias's lineage."""

    version: int
    parent: int | None
    status: str  # live, canary, promoted, rejected, rolled back, candidate
    round: RoundRow | None
    # From the version's ratchet.json: its lineage's training so far.
    rounds: int | None = None
    groups_seen: int | None = None
    tokens_seen: int | None = None
    # "import" and the folder it came from, for an adapter trained elsewhere (`ratchet import`).
    origin: str | None = None
    source: str | None = None
    # A promoted version's cost: its round and the rejected ones since the previous promotion.
    cost: Bill | None = None


@dataclass
class AliasDetail:
    summary: AliasSummary
    lineage: list[VersionNode]
    rounds: list[RoundRow]
    events: list[dict[str, Any]]
    gate_pairs: dict[int, list[GatePair]] = field(default_factory=dict)


class ConsoleData:
    """Reads the console's data; one instance per process (it holds the Redis client)."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self.writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
        self.redis: redis.Redis = self.writer.redis
        assert settings.store_dir is not None
        self.store = AdapterStore(settings.store_dir)

    def redis_up(self) -> bool:
        try:
            return bool(self.redis.ping())
        except (redis.RedisError, OSError):
            return False

    def routes(self) -> dict[str, AliasRoute]:
        table = self.writer.read_all()
        return {a: r for a, r in table.routes.items() if a in self.settings.aliases}

    def summaries(self) -> list[AliasSummary]:
        return [self.summary(alias, route) for alias, route in sorted(self.routes().items())]

    def summary(self, alias: str, route: AliasRoute) -> AliasSummary:
        history = self.writer.history(alias, limit=HISTORY_READ)
        rounds = rounds_of(history)
        return AliasSummary(
            alias=alias,
            active=route.active,
            served_as=served_name(alias, route.active, route.base_model),
            canary=self.canary(alias, route),
            paused=route.paused,
            pause_reason=pause_reason(history) if route.paused else None,
            learner=self.learner_line(alias),
            reward_model=self.reward_model_line(alias),
            agreement=self.agreement_line(alias),
            last_round=rounds[-1] if rounds else None,
            judge_spend=self.judge_spend_line(alias),
            reward_guard=guard_line(self.redis, alias, (route.canary, route.active)),
        )

    def canary(self, alias: str, route: AliasRoute) -> CanaryView | None:
        if route.canary is None:
            return None
        version, _, arms = read_counts(self.redis, alias)
        if version != route.canary:  # set by hand, or not counted yet
            arms = {arm: ArmStats() for arm in arms}
        summary = read_ratings_summary(self.redis, alias) if version == route.canary else None
        return CanaryView(route.canary, route.canary_weight, arms, summary)

    def judge_spend_line(self, alias: str) -> str:
        cap = self.settings.aliases[alias].learning.max_cost_per_day
        try:
            return budget_line(read_spend(self.redis, alias), cap)
        except (redis.RedisError, OSError):
            return "judge spend today: unknown (Redis unreachable)"

    def learner_line(self, alias: str) -> str:
        progress = read_progress(self.redis, alias)
        return "no learner progress" if progress is None else progress.describe()

    def reward_model_line(self, alias: str) -> str | None:
        config = self.settings.aliases[alias]
        if not config.reward.learns_from_ratings:
            return None
        return describe_reward_model(alias, RewardStatus.read(self.redis, alias))

    def agreement_line(self, alias: str) -> str | None:
        if not probes_agreement(self.settings.aliases[alias]):
            return None
        measures = read_agreement(self.redis, alias)
        return measures.line() if measures is not None else None

    def detail(self, alias: str) -> AliasDetail | None:
        route = self.routes().get(alias)
        if route is None:
            return None
        history = self.writer.history(alias, limit=HISTORY_READ)
        rounds = rounds_of(history)
        recent = rounds[-5:]
        return AliasDetail(
            summary=self.summary(alias, route),
            lineage=self.lineage(alias, route, rounds),
            rounds=rounds,
            events=history[:EVENTS_SHOWN],
            gate_pairs={r.version: read_gate_pairs(self.redis, alias, r.version) for r in recent},
        )

    def lineage(self, alias: str, route: AliasRoute, rounds: list[RoundRow]) -> list[VersionNode]:
        """v0 and every version the store holds, each with its parent and fate."""
        by_version = {r.version: r for r in rounds}
        costs = promotion_bills(rounds)
        nodes = [VersionNode(0, None, status_of(0, route, None), None)]
        for version in self.store.versions(alias):
            try:
                meta = self.store.meta(alias, version)
            except (OSError, ValueError):  # a folder being written, or a damaged one
                meta = {}
            parent = meta.get("parent_version")
            row = by_version.get(version)
            nodes.append(
                VersionNode(
                    version,
                    parent if isinstance(parent, int) else None,
                    status_of(version, route, row),
                    row,
                    rounds=_count(meta.get("rounds")),
                    groups_seen=_count(meta.get("groups_seen")),
                    tokens_seen=_count(meta.get("completion_tokens_seen")),
                    origin=_text(meta.get("origin")),
                    source=_text(meta.get("source")),
                    cost=costs.get(version),
                )
            )
        return nodes


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def status_of(version: int, route: AliasRoute, row: RoundRow | None) -> str:
    if version == route.active:
        return "live"
    if version == route.canary:
        return "canary"
    return row.outcome if row is not None else "written"


def pause_reason(history: list[dict[str, Any]]) -> str | None:
    for event in history:
        if event.get("kind") == "pause":
            reason = (event.get("detail") or {}).get("reason")
            return str(reason) if reason else None
    return None

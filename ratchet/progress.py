"""What the learner is doing for each alias, and how many groups it still needs.

The learner replica that runs an alias's rounds publishes a :class:`LearnerProgress` in Redis
(``ratchet:learner:<alias>:progress``, a hash with a TTL, so a learner that dies stops being
believed). ``ratchet status`` and the console show it; the judge reads it for backpressure
(:func:`sampling_decision`): it samples for an alias only while the groups produced and not yet
trained on are fewer than a bound, and, on a machine where sampling and training share the
cores, not while a round trains.

"Not yet trained on" is counted across every judge and learner replica by two Redis counters:
each judge adds the groups Kafka acknowledged to ``ratchet:judge:<alias>:groups_produced``, the
learner adds the groups it has read (whatever became of them) to the progress hash's ``read``
field. Pending groups = produced - read (still in Kafka) + the learner's ``waiting`` ones. A
learner that re-reads uncommitted groups after a restart counts them twice, so the judge then
samples a little more than the bound, never less than needed.

Only usable groups count against the bound: a round takes at most ``learning.max_key_share`` of
its groups from one client (learner/fair.py), so a flooding client's groups past that share wait
in vain. Counted, they filled the bound, the judge stopped sampling, and the other clients'
records were skipped while the learner waited for their groups (audit M-1). The judge knows the
clients of the groups it cleared and passes how many of the pending ones are past their client's
share (:func:`unusable_groups`); past the bound, only a client under its share is sampled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import redis

Phase = Literal["idle", "waiting_heldout", "train", "write", "gate", "settle"]
PHASES: tuple[Phase, ...] = ("idle", "waiting_heldout", "train", "write", "gate", "settle")
# Phases in which a round takes the machine: the learner computing (train, write) and the gate,
# whose answers from both versions take vLLM. A judge told not to sample while a round trains
# waits through the gate too: its groups then come from where the next round starts (the gate's
# outcome decides that), and the gate is not slowed by them.
BUSY_PHASES = frozenset({"train", "write", "gate"})
# A progress hash not rewritten for this long belongs to a dead or stalled learner. Longer than
# one optimizer step on a CPU (tens of seconds), which is the longest the learner goes silent.
PROGRESS_TTL_S = 300


def progress_key(alias: str) -> str:
    """Hash: the alias's :class:`LearnerProgress`, written by the learner holding its lease."""
    return f"ratchet:learner:{alias}:progress"


def produced_key(alias: str) -> str:
    """String counter: groups the judges produced for the alias (Kafka acknowledged them)."""
    return f"ratchet:judge:{alias}:groups_produced"


@dataclass(frozen=True)
class LearnerProgress:
    """One alias as the learner sees it. Times are Unix seconds."""

    alias: str
    phase: Phase = "idle"
    waiting: int = 0  # usable groups read and waiting for the next round
    read: int = 0  # groups read from ratchet.groups, ever (the counter the judge subtracts)
    batch_groups: int = 0  # groups a round trains on
    heldout: int = 0  # held-out prompts in the gate's pool
    version: int = 0  # train: the version the round trains from; then the candidate's
    step: int = 0  # train: optimizer steps done; gate: pairs answered
    steps: int = 0  # train: steps in the round; gate: pairs drawn
    detail: str = ""  # one line for people: loss and tokens/s, or the running win rate
    round_started_at: float = 0.0
    updated_at: float = 0.0

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if k not in ("alias", "read")}

    @classmethod
    def from_hash(cls, alias: str, raw: dict[Any, Any]) -> LearnerProgress | None:
        """None for an empty or unreadable hash (a newer learner's format, or a hand edit)."""
        data = {
            (k.decode() if isinstance(k, bytes) else k): (
                v.decode(errors="replace") if isinstance(v, bytes) else v
            )
            for k, v in raw.items()
        }
        if not data:
            return None
        values: dict[str, Any] = {"alias": alias}
        try:
            for f in fields(cls):
                if f.name == "alias" or f.name not in data:
                    continue
                kind = _FIELD_KINDS[f.name]
                values[f.name] = int(float(data[f.name])) if kind is int else kind(data[f.name])
        except ValueError:
            return None
        if values.get("phase", "idle") not in PHASES:
            return None
        return cls(**values)

    @property
    def busy(self) -> bool:
        return self.phase in BUSY_PHASES

    def describe(self, now: float | None = None) -> str:
        """One line for ``ratchet status``."""
        now = time.time() if now is None else now
        if self.phase in ("idle", "waiting_heldout"):
            text = f"{self.phase}: {self.waiting}/{self.batch_groups} groups"
            if self.phase == "waiting_heldout":
                text += f", {self.heldout} held-out prompts"
            return text
        took = f"{now - self.round_started_at:.0f}s" if self.round_started_at else "?"
        counted = f" {self.step}/{self.steps}" if self.steps else ""
        which = f"from v{self.version}" if self.phase == "train" else f"v{self.version}"
        text = f"round {which}, {self.phase}{counted}, {took} in"
        return f"{text}: {self.detail}" if self.detail else text


_FIELD_KINDS: dict[str, type] = {
    f.name: type(f.default) for f in fields(LearnerProgress) if f.name != "alias"
}


def publish(client: redis.Redis, progress: LearnerProgress, read_delta: int = 0) -> None:
    """Write the alias's progress (and add ``read_delta`` to its read counter) with its TTL."""
    key = progress_key(progress.alias)
    pipe = client.pipeline(transaction=True)
    mapping: dict[Any, Any] = {**progress.to_hash(), "updated_at": str(time.time())}
    pipe.hset(key, mapping=mapping)
    if read_delta:
        pipe.hincrby(key, "read", read_delta)
    pipe.expire(key, PROGRESS_TTL_S)
    pipe.execute()


def read_progress(client: redis.Redis, alias: str) -> LearnerProgress | None:
    return LearnerProgress.from_hash(alias, client.hgetall(progress_key(alias)))


@dataclass(frozen=True)
class SamplingDecision:
    sample: bool
    reason: str  # why not, for the judge's skip counter: "backpressure" or "learner_training"
    pending: int  # groups produced and not yet trained on, as far as Redis knows


def pending_groups(progress: LearnerProgress | None, produced: int) -> int:
    """Groups produced and not yet trained on: unread in Kafka, plus waiting in the learner."""
    if progress is None:
        return 0
    return max(0, produced - progress.read) + progress.waiting


def client_cap(size: int, share: float, clients: int) -> int:
    """How many of ``size`` groups one client's may be while ``clients`` clients have some:
    ``share`` of them, or an even split among fewer clients (learner/fair.py's rule for a
    round, which a service cannot import)."""
    effective = max(share, 1.0 / clients) if clients else share
    return math.floor(effective * size + 1e-9)


def unusable_groups(counts: Mapping[str, int], size: int, share: float) -> int:
    """Of pending groups counted per client, those past their client's cap of ``size``. Every
    client in ``counts`` shares the rounds, one with 0 groups (the one asking for its first)
    too: a client alone may fill every round, not once another's group is on the way."""
    cap = client_cap(size, share, len(counts))
    return sum(max(0, count - cap) for count in counts.values())


def sampling_decision(
    progress: LearnerProgress | None,
    produced: int,
    max_pending: int,
    pause_while_training: bool,
    unusable: int = 0,
) -> SamplingDecision:
    """Whether a judge should sample a group for the alias now.

    ``produced``: the alias's groups_produced counter; ``max_pending``: the bound on groups
    produced and not yet trained on (0: no bound); ``unusable``: how many of those no round can
    take (past their client's share), which do not count against the bound. Without a live
    learner's progress there is nothing to go by, so the judge samples (the groups wait in Kafka
    for the learner)."""
    if progress is None:
        return SamplingDecision(True, "", 0)
    pending = pending_groups(progress, produced)
    usable = max(0, pending - unusable)
    if pause_while_training and progress.busy:
        return SamplingDecision(False, "learner_training", pending)
    if max_pending and usable >= max_pending:
        return SamplingDecision(False, "backpressure", pending)
    if progress.phase == "waiting_heldout" and usable >= progress.batch_groups > 0:
        # A round's groups are in and it waits for held-out prompts, which only traffic brings:
        # more groups would not start it sooner, and would take vLLM from that traffic.
        return SamplingDecision(False, "backpressure", pending)
    return SamplingDecision(True, "", pending)

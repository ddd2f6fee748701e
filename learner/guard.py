"""The reward-hacking guard: signs that learning has gone wrong, as pure functions.

* Reward up, gate down: the training reward rose in each of the last ``guard_rounds`` rounds,
  yet the gate rejected every one of those candidates (rounds scored by the same judge models
  only: a reward model retrained between rounds moves the reward by itself). The policy is
  getting better at what the judge rewards on training prompts and no better on held-out ones:
  the judge is being gamed.
* Collapse: most groups read since the last round are one answer repeated (the policy stopped
  exploring; such groups also carry no GRPO signal).
* Runaway length: answers have grown several times longer than in the alias's first round
  (a classic way to please an LLM judge, and a cost the user pays).
* Reward model fooled (aliases whose reward is learned from ratings): on the canary's rated
  answers, the reward model's predictions exceed the users' ratings by more than it does on the
  active version's, beyond what the rated answers' noise explains. A candidate trained against
  the reward model that found its blind spots scores well with it and not with the users.

Each returns a reason (a sentence for the pause event and the metric label), or None.
:class:`Guard` applies the first three after each round and pauses the alias's learning on a
reason; it also keeps the reason of each pause, whoever paused, for the paused metric.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import redis

from learner.metrics import LearnerMetrics
from ratchet.lifecycle import Lifecycle
from ratchet.records import ScoredGroup, answer_identity
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import LearnerSettings

log = logging.getLogger(__name__)

HISTORY_READ = 200  # events of an alias's history read for its rounds and its last pause


def baseline_length_key(alias: str) -> str:
    """The mean answer length of the alias's first round: what runaway length is measured by."""
    return f"ratchet:learner:{alias}:baseline_length"


@dataclass(frozen=True)
class RoundOutcome:
    version: int
    train_reward: float
    passed: bool
    judged_by: tuple[str, ...] | None = None  # the judge models of its groups (None: unknown)


def reward_up_gate_down(rounds: list[RoundOutcome], window: int) -> str | None:
    """``rounds`` oldest first. A reason when the last ``window`` rounds all rose and all failed."""
    if len(rounds) < window:
        return None
    last = rounds[-window:]
    if len({r.judged_by for r in last if r.judged_by is not None}) > 1:
        return None  # scored by different judges (a retrained reward model): not comparable
    rising = all(b.train_reward > a.train_reward for a, b in itertools.pairwise(last))
    if rising and not any(r.passed for r in last):
        rewards = ", ".join(f"{r.train_reward:.3f}" for r in last)
        return (
            f"reward_hacking: training reward rose over {window} rounds ({rewards}) while the "
            "gate rejected every candidate"
        )
    return None


def is_collapsed(group: ScoredGroup) -> bool:
    """All answers in the group are the same (text ignoring case and surrounding space, and
    tool calls): a group of tool calls with empty text is collapsed only if the calls agree."""
    answers = {answer_identity(s.message, fold_text=True) for s in group.samples}
    return len(group.samples) > 1 and len(answers) == 1


def collapse(identical: int, total: int, share: float) -> str | None:
    if total and identical / total >= share:
        return f"collapse: {identical} of {total} recent groups are one answer repeated"
    return None


def mean_length(groups: list[ScoredGroup]) -> float:
    lengths = [len(s.token_ids) for g in groups for s in g.samples]
    return sum(lengths) / len(lengths) if lengths else 0.0


def runaway_length(current: float, baseline: float | None, growth: float) -> str | None:
    if baseline and current > growth * baseline:
        return (
            f"runaway_length: answers average {current:.0f} tokens, "
            f"{current / baseline:.1f}x the first round's {baseline:.0f}"
        )
    return None


# One-sided 95% normal quantile: the reward-model gap must exceed max_gap at this confidence.
GAP_Z = 1.645


def reward_model_gap(
    canary: list[tuple[float, float]],
    active: list[tuple[float, float]],
    max_gap: float,
    min_pairs: int,
) -> str | None:
    """``(predicted, rated)`` for each arm's rated answers. A reason when the reward model's
    overrating of the canary's answers exceeds its overrating of the active's by more than
    ``max_gap`` with 95% confidence, with at least ``min_pairs`` rated answers on each arm.

    With ``g = predicted - rated`` per answer, the excess is ``d = mean(g_canary) -
    mean(g_active)`` with standard error ``se = sqrt(var(g_canary)/n_c + var(g_active)/n_a)``
    (sample variances; an arm of one answer takes the bound 1, as ``g`` lies in [-1, 1]); the
    verdict is ``d - GAP_Z * se > max_gap``. A candidate trained against the reward model is
    overrated a little by construction, and a dozen rated answers move ``d`` by about 0.1 by
    chance: a point estimate alone rolled back and paused a candidate on 12 answers.
    """
    if len(canary) < min_pairs or len(active) < min_pairs:
        return None
    (mean_canary, var_canary), (mean_active, var_active) = _moments(canary), _moments(active)
    excess = mean_canary - mean_active
    margin = GAP_Z * math.sqrt(var_canary / len(canary) + var_active / len(active))
    if excess - margin > max_gap:
        return (
            f"reward_hacking: the reward model overrates the canary's {len(canary)} rated "
            f"answers by {mean_canary:+.3f} and the active version's {len(active)} by "
            f"{mean_active:+.3f} (more than {max_gap} apart at 95% confidence: "
            f"{excess:+.3f} ± {margin:.3f})"
        )
    return None


def _moments(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean and sample variance of ``predicted - rated``; one answer takes the bound 1."""
    gaps = [p - r for p, r in pairs]
    return statistics.fmean(gaps), statistics.variance(gaps) if len(gaps) > 1 else 1.0


def rounds_from_history(history: list[dict[str, Any]]) -> list[RoundOutcome]:
    """Round outcomes, oldest first, from an alias's Redis history (newest first): each
    ``candidate`` event's training reward joined with the ``gate`` event of its version. Only
    rounds after the newest pause or resume count: resuming starts the guard's window afresh."""
    for cut, event in enumerate(history):
        if event.get("kind") in ("pause", "resume"):
            history = history[:cut]
            break
    gates = {
        e.get("version"): bool((e.get("detail") or {}).get("passed"))
        for e in history
        if e.get("kind") == "gate"
    }
    rounds = []
    for event in reversed(history):
        if event.get("kind") != "candidate" or event.get("version") not in gates:
            continue
        detail = event.get("detail") or {}
        reward = detail.get("mean_reward")
        judged_by = detail.get("judged_by")
        if reward is not None:
            rounds.append(
                RoundOutcome(
                    event["version"],
                    float(reward),
                    gates[event["version"]],
                    tuple(judged_by) if isinstance(judged_by, list) else None,
                )
            )
    return rounds


class Guard:
    """Watches each alias's groups and rounds, and pauses its learning when one of the signs
    above shows. ``paused_reason`` holds the label of each paused alias's metric."""

    def __init__(
        self,
        settings: LearnerSettings,
        client: redis.Redis,
        writer: RegistryWriter,
        lifecycle: Lifecycle,
        metrics: LearnerMetrics,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.writer = writer
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.recent: dict[str, list[bool]] = defaultdict(list)  # collapsed? per group read
        self.paused_reason: dict[str, str] = {}

    def saw(self, group: ScoredGroup) -> None:
        """Note one group read (before it is dropped or waits) for the collapse check."""
        self.recent[group.alias].append(is_collapsed(group))

    def after_round(self, alias: str, groups: list[ScoredGroup]) -> None:
        """Pause the alias's learning when the signs of reward hacking or collapse show."""
        s = self.settings
        recent, self.recent[alias] = self.recent[alias], []
        length = mean_length(groups)
        baseline = self.redis.get(baseline_length_key(alias))
        if baseline is None:
            self.redis.set(baseline_length_key(alias), length)
        reason = (
            reward_up_gate_down(
                rounds_from_history(self.writer.history(alias, HISTORY_READ)), s.guard_rounds
            )
            or collapse(sum(recent), len(recent), s.collapse_share)
            or runaway_length(length, float(baseline) if baseline else None, s.max_length_growth)
        )
        if reason:
            self.pause(alias, reason)

    def pause(self, alias: str, reason: str) -> None:
        self.lifecycle.pause(alias, reason)
        label = reason.split(":", 1)[0]
        self.paused_reason[alias] = label
        self.metrics.paused.labels(alias, label).set(1)
        log.warning("%s: learning paused: %s", alias, reason)

    def track(self, routes: dict[str, AliasRoute]) -> None:
        """Follow pauses and resumes made elsewhere (by an operator, or before a restart) in the
        paused metric, with the reason of the newest pause event."""
        for alias, route in routes.items():
            reason = self.paused_reason.get(alias)
            if route.paused and reason is None:
                reason = self._pause_reason(alias)
                self.paused_reason[alias] = reason
                self.metrics.paused.labels(alias, reason).set(1)
            elif not route.paused and reason is not None:
                self.metrics.paused.remove(alias, reason)
                del self.paused_reason[alias]

    def _pause_reason(self, alias: str) -> str:
        for event in self.writer.history(alias, HISTORY_READ):
            if event.get("kind") == "pause":
                return str((event.get("detail") or {}).get("reason", "manual")).split(":", 1)[0]
        return "manual"

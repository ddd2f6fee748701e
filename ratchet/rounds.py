"""An alias's learning rounds, read back from its Redis history (newest-first lifecycle events):
one row per candidate the learner wrote, with its gate and its fate. Shared by `ratchet status`,
`ratchet report` and the console."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ratchet.bill import Bill, read_bill, total

OUTCOME_KINDS = ("promote", "canary", "reject", "rollback")


@dataclass
class RoundRow:
    version: int
    ts: str
    mean_reward: float | None
    groups: int | None
    win_rate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    pairs: int | None = None
    passed: bool | None = None
    outcome: str = "trained"  # trained (no gate yet) | promoted | canary | rejected | rolled back
    # The version it was gated against, and the one its weights started from: another
    # (rejected) candidate when the learner trained on from it (ratchet/carry.py).
    live: int | None = None
    trained_from: int | None = None
    # The mean per-prompt score lift over the live version and its 95% interval (scored pairs).
    lift: float | None = None
    lift_low: float | None = None
    lift_high: float | None = None
    # Where the candidate came from: None for the learner's own rounds, "import" for an adapter
    # trained elsewhere (`ratchet import`), whose folder is ``source``.
    origin: str | None = None
    source: str | None = None
    # What the round cost (ratchet/bill.py), from its outcome event; None before the outcome.
    bill: Bill | None = None
    # Mean |Δ logprob| per token between vLLM's logprobs of the round's groups and the learner's
    # under the same weights (learner/drift.py), on the replica furthest from the learner's;
    # None where not measured. The replica: None for a drift measured before it was per replica.
    served_drift: float | None = None
    served_drift_replica: str | None = None

    def lift_text(self) -> str:
        """``lift +0.050 [+0.010, +0.090]``, or "" where no lift was measured."""
        if self.lift is None or self.lift_low is None or self.lift_high is None:
            return ""
        return f"lift {self.lift:+.3f} [{self.lift_low:+.3f}, {self.lift_high:+.3f}]"

    @property
    def carried_on(self) -> bool:
        return self.trained_from is not None and self.trained_from != self.live


_OUTCOME_WORDS = {
    "promote": "promoted",
    "canary": "canary",
    "reject": "rejected",
    "rollback": "rolled back",
}


def rounds_of(history: list[dict[str, Any]]) -> list[RoundRow]:
    """One row per candidate the learner wrote, oldest first, with its gate and fate.

    History is JSON in Redis, which more than the learner can write: a field of the wrong type
    reads as missing (a version that is not an int drops its event), so what reaches the console's
    plot and the CLI's tables is numbers.
    """
    rows: dict[int, RoundRow] = {}
    for event in reversed(history):  # history is newest first
        if not isinstance(event, dict):
            continue
        kind, version = event.get("kind"), _int(event.get("version"))
        detail = event.get("detail")
        detail = detail if isinstance(detail, dict) else {}
        if kind == "candidate" and version is not None:
            ts = event.get("ts")
            rows[version] = RoundRow(
                version=version,
                ts=ts if isinstance(ts, str) else "",
                mean_reward=_float(detail.get("mean_reward")),
                groups=_int(detail.get("groups")),
                live=_int(event.get("previous_version")),
                trained_from=_int(detail.get("trained_from")),
                origin=_str(detail.get("origin")),
                source=_str(detail.get("source")),
            )
            rows[version].served_drift, rows[version].served_drift_replica = _served_drift(
                detail.get("served_drift")
            )
        elif kind == "gate" and version in rows:
            row = rows[version]
            row.win_rate, row.ci_low = _float(detail.get("win_rate")), _float(detail.get("ci_low"))
            row.ci_high, row.pairs = _float(detail.get("ci_high")), _int(detail.get("pairs"))
            row.lift, row.lift_low, row.lift_high = (
                _float(detail.get(name)) for name in ("lift", "lift_low", "lift_high")
            )
            passed = detail.get("passed")
            row.passed = passed if isinstance(passed, bool) else None
        elif kind in OUTCOME_KINDS:
            # A rollback names the restored version; the one rolled back is previous_version.
            target = _int(event.get("previous_version")) if kind == "rollback" else version
            if target in rows:
                rows[target].outcome = _OUTCOME_WORDS[kind]
                if kind != "rollback":
                    rows[target].bill = read_bill(detail.get("bill")) or rows[target].bill
    return sorted(rows.values(), key=lambda row: row.ts)


def _served_drift(value: Any) -> tuple[float | None, str | None]:
    """From a candidate event's ``served_drift`` (learner/drift.py): the mean of the replica
    furthest from the learner, and that replica (None for a drift from before it was measured
    per replica: its overall mean)."""
    if not isinstance(value, dict):
        return None, None
    replicas = value.get("replicas")
    worst: tuple[float, str] | None = None
    if isinstance(replicas, dict):
        for name, entry in replicas.items():
            mean = _float(entry.get("mean_abs")) if isinstance(entry, dict) else None
            if mean is not None and (worst is None or mean > worst[0]):
                worst = (mean, str(name))
    if worst is not None:
        return worst
    return _float(value.get("mean_abs")), None


def _int(value: Any) -> int | None:
    """An int (not a bool, which JSON's true would give), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def promotion_bills(rows: list[RoundRow]) -> dict[int, Bill]:
    """What each promoted version cost: its own round and every round since the previous
    promotion (the rejected candidates paid for it too), by version."""
    bills: dict[int, Bill] = {}
    since: list[Bill | None] = []
    for row in rows:
        since.append(row.bill)
        if row.outcome == "promoted":
            bills[row.version] = total(since)
            since = []
    return bills

"""An alias's learning rounds, read back from its Redis history (newest-first lifecycle events):
one row per candidate the learner wrote, with its gate and its fate. Shared by `ratchet status`,
`ratchet report` and the console."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """One row per candidate the learner wrote, oldest first, with its gate and fate."""
    rows: dict[int, RoundRow] = {}
    for event in reversed(history):  # history is newest first
        kind, version = event.get("kind"), event.get("version")
        detail = event.get("detail") or {}
        if kind == "candidate" and version is not None:
            rows[version] = RoundRow(
                version=version,
                ts=event.get("ts", ""),
                mean_reward=detail.get("mean_reward"),
                groups=detail.get("groups"),
                live=event.get("previous_version"),
                trained_from=detail.get("trained_from"),
            )
        elif kind == "gate" and version in rows:
            row = rows[version]
            row.win_rate, row.ci_low = detail.get("win_rate"), detail.get("ci_low")
            row.ci_high, row.pairs = detail.get("ci_high"), detail.get("pairs")
            row.passed = detail.get("passed")
        elif kind in OUTCOME_KINDS:
            # A rollback names the restored version; the one rolled back is previous_version.
            target = event.get("previous_version") if kind == "rollback" else version
            if target in rows:
                rows[target].outcome = _OUTCOME_WORDS[kind]
    return sorted(rows.values(), key=lambda row: row.ts)

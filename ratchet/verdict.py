"""What the gate said of a version, read back for anyone who would put it live by hand.

`ratchet alias set` and the console's promote both ask here, so a version the gate rejected, or
one it never judged, is not served by accident. The verdict lives in two places the learner
already writes: the adapter store's ``status.json`` (``rejected``, durable) and the alias's Redis
history (the ``gate`` event, with ``passed``; trimmed to its newest events). A version that was
promoted or rolled back has been served before, so one whose gate event was trimmed away still
counts as having passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ratchet.store import AdapterStore

Verdict = Literal["base model", "passed", "served before", "rejected", "never gated"]
SERVABLE: frozenset[Verdict] = frozenset({"base model", "passed", "served before"})


@dataclass(frozen=True)
class GateVerdict:
    alias: str
    version: int
    verdict: Verdict
    reason: str = ""  # the gate's own reason, when it gave one

    @property
    def servable(self) -> bool:
        return self.verdict in SERVABLE

    def describe(self) -> str:
        """The refusal an operator reads: what the gate said and how to go past it."""
        said = "was rejected by the gate" if self.verdict == "rejected" else f"is {self.verdict}"
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.alias}@v{self.version} {said}{why}"


def gate_verdict(
    store: AdapterStore, history: Iterable[dict[str, Any]], alias: str, version: int
) -> GateVerdict:
    """The gate's verdict on ``alias@v<version>``; ``history`` is the alias's, newest first."""
    if version == 0:
        return GateVerdict(alias, 0, "base model")
    # The CLI may run where the learner's store is not mounted: then the history alone decides.
    status = store.status(alias, version)
    state = status.get("status") if isinstance(status, dict) else None
    if state == "rejected":
        return GateVerdict(alias, version, "rejected", _reason(status))
    gate = next((e for e in history if _is_gate_of(e, version)), None)
    if gate is not None:
        detail = gate.get("detail")
        passed = isinstance(detail, dict) and detail.get("passed") is True
        return GateVerdict(alias, version, "passed" if passed else "rejected", _reason(detail))
    if state in ("promoted", "rolled_back"):
        return GateVerdict(alias, version, "served before")
    return GateVerdict(alias, version, "never gated")


def _is_gate_of(event: Any, version: int) -> bool:
    return (
        isinstance(event, dict) and event.get("kind") == "gate" and event.get("version") == version
    )


def _reason(detail: Any) -> str:
    reason = detail.get("reason") if isinstance(detail, dict) else None
    return str(reason)[:200] if reason else ""

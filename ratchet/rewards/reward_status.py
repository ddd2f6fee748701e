"""The live reward model of an alias as the services read it: its status in Redis (written by the
learner, read by the judge, the gate, ``ratchet status`` and the console) and its names in the
adapter store. No numpy here, unlike ratchet/rewards/reward_model.py: the console reads it from the
base install."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REWARD_SUFFIX = ".reward"  # the store name of an alias's reward models: <alias>.reward@v<N>


def reward_store_name(alias: str) -> str:
    return f"{alias}{REWARD_SUFFIX}"


def describe_reward_model(alias: str, status: RewardStatus | None) -> str:
    """Why an alias that learns from ratings learns or waits, in one line (``ratchet status``,
    the console)."""
    if status is None:
        return "waiting: no reward model yet (users' ratings are being collected)"
    if status.version == 0:
        return f"waiting: no reward model yet ({status.reason})"
    name = reward_model_name(alias, status.version)
    if not status.usable:
        return f"waiting: {name}: {status.reason}"
    return f"rewards from {name}: {status.reason}"


def status_key(alias: str) -> str:
    """Hash: the alias's newest reward model and whether it may give rewards (RewardStatus)."""
    return f"ratchet:feedback:{alias}:reward"


@dataclass(frozen=True)
class RewardStatus:
    """What the learner last trained for an alias; written by it, read by judge, gate, status."""

    version: int
    usable: bool
    reason: str
    auc: float | None = None
    trained_ratings: int = 0
    eval_ratings: int = 0
    auc_low: float | None = None  # the lower end of the AUC's 95% interval, what decides

    def to_hash(self) -> dict[str, str]:
        return {
            "version": str(self.version),
            "usable": "1" if self.usable else "0",
            "reason": self.reason,
            "auc": "" if self.auc is None else repr(self.auc),
            "trained_ratings": str(self.trained_ratings),
            "eval_ratings": str(self.eval_ratings),
            "auc_low": "" if self.auc_low is None else repr(self.auc_low),
        }

    def write(self, client: Any, alias: str) -> None:
        """Into a (synchronous) Redis client or pipeline."""
        mapping: dict[Any, Any] = self.to_hash()
        client.hset(status_key(alias), mapping=mapping)

    @classmethod
    def read(cls, client: Any, alias: str) -> RewardStatus | None:
        """From a (synchronous) Redis client."""
        return cls.from_hash(client.hgetall(status_key(alias)))

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> RewardStatus | None:
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        if not data.get("version"):
            return None
        return cls(
            version=int(data["version"]),
            usable=data.get("usable") == "1",
            reason=data.get("reason", ""),
            auc=float(data["auc"]) if data.get("auc") else None,
            trained_ratings=int(data.get("trained_ratings") or 0),
            eval_ratings=int(data.get("eval_ratings") or 0),
            auc_low=float(data["auc_low"]) if data.get("auc_low") else None,
        )


def reward_model_name(alias: str, version: int) -> str:
    """What a ScoredGroup's judge_model says when this reward model scored it."""
    return f"{reward_store_name(alias)}@v{version}"

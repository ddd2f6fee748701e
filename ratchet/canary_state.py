"""A running canary's counts in Redis: written by the learner's canary watcher
(learner/canary.py), read by it, by `ratchet status` and by the console.

- ``ratchet:canary:<alias>`` (hash): the canary ``version`` and its ``started`` time, per arm
  ``<arm>_requests``, ``<arm>_errors``, ``<arm>_feedback`` and ``<arm>_feedback_sum``, and
  ``ratings``: the ratings' sequential test as of the watcher's last check (JSON, see
  ``SequentialTest.summary``), and ``error_look:v<version>:<j>``: the error test's looks, each
  made once (learner/canary_errors.py);
- ``ratchet:canary:<alias>:ratings:<arm>`` (list): the arm's counted ratings, oldest first;
- ``ratchet:canary:<alias>:raters:<arm>`` (hash): ratings per client on the arm, stored or not
  (each client stores at most the ratings its observation is made of: learner/canary_clients.py);
- ``ratchet:canary:<alias>:clients:<arm>`` (hash): per client served on the arm, ``<client>``:
  its requests, ``<client>\terrors``: its upstream failures (what counts toward
  ``min_requests`` and the error rate is capped per client: learner/canary_counter.py), and
  ``<client>\tlat`` / ``<client>\tlatn``: the sum and number of its successful requests'
  latencies (learner/canary_latency.py).

All of it is reset in the transaction that starts a canary.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from ratchet.registry import decode_hash

ARMS = ("active", "canary")


def canary_key(alias: str) -> str:
    return f"ratchet:canary:{alias}"


def ratings_key(alias: str, arm: str) -> str:
    """List of an arm's counted ratings, oldest first (:meth:`Rating.encode`)."""
    return f"ratchet:canary:{alias}:ratings:{arm}"


def raters_key(alias: str, arm: str) -> str:
    """Hash of client -> ratings it gave on the arm (how many the list may still take from it)."""
    return f"ratchet:canary:{alias}:raters:{arm}"


def clients_key(alias: str, arm: str) -> str:
    """Hash of client -> requests served on the arm, and client + "\terrors" -> its failures."""
    return f"ratchet:canary:{alias}:clients:{arm}"


ERRORS_SUFFIX = "\terrors"
# A client's successful requests' latency sum and count (learner/canary_latency.py).
LATENCY_SUFFIX = "\tlat"
LATENCY_COUNT_SUFFIX = "\tlatn"


def reset_counts(pipe: Any, alias: str, version: int) -> None:
    """Queue the commands that start counting a new canary (into the caller's transaction)."""
    pipe.delete(
        canary_key(alias),
        *(ratings_key(alias, arm) for arm in ARMS),
        *(raters_key(alias, arm) for arm in ARMS),
        *(clients_key(alias, arm) for arm in ARMS),
    )
    pipe.hset(canary_key(alias), mapping={"version": version, "started": time.time()})


@dataclass(frozen=True)
class ArmStats:
    requests: int = 0
    errors: int = 0  # upstream failures (UPSTREAM_FAILURES): what a client provokes is not counted
    feedback: int = 0
    feedback_sum: float = 0.0
    clients: int = 0  # distinct clients served (0: not read, as in `ratchet status`)
    served: int = 0  # requests served, each client's all (``requests`` may be capped per client)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def read_counts(
    client: redis.Redis, alias: str
) -> tuple[int | None, float | None, dict[str, ArmStats]]:
    """(canary version the counts belong to, its start as a Unix time, stats per arm)."""
    raw = decode_hash(client.hgetall(canary_key(alias)))
    version = int(raw["version"]) if raw.get("version") else None
    started = float(raw["started"]) if raw.get("started") else None
    stats = {
        arm: ArmStats(
            requests=int(raw.get(f"{arm}_requests", 0)),
            errors=int(raw.get(f"{arm}_errors", 0)),
            feedback=int(raw.get(f"{arm}_feedback", 0)),
            feedback_sum=float(raw.get(f"{arm}_feedback_sum", 0.0)),
        )
        for arm in ARMS
    }
    return version, started, stats


def read_client_counts(client: redis.Redis, alias: str, arm: str) -> dict[str, tuple[int, int]]:
    """Per client served on the arm: (requests, upstream failures)."""
    raw = decode_hash(client.hgetall(clients_key(alias, arm)))
    counts: dict[str, tuple[int, int]] = {}
    for name, value in raw.items():
        if name.endswith((LATENCY_SUFFIX, LATENCY_COUNT_SUFFIX)):
            continue  # read by learner/canary_latency.py
        who = name.removesuffix(ERRORS_SUFFIX)
        requests, errors = counts.get(who, (0, 0))
        if name.endswith(ERRORS_SUFFIX):
            counts[who] = (requests, int(value))
        else:
            counts[who] = (int(value), errors)
    return counts


def read_ratings_summary(client: redis.Redis, alias: str) -> dict[str, Any] | None:
    """The ratings' sequential test as the watcher last saw it, None before its first check."""
    raw = client.hget(canary_key(alias), "ratings")
    return json.loads(raw) if isinstance(raw, bytes) else None

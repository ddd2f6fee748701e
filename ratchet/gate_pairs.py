"""A bounded sample of each gate's held-out pairs, for people to read side by side.

The learner's gate keeps the first :data:`KEPT` pairs it scored in a round: the held-out prompt,
the candidate's and the live version's answers, and the pair's outcome (1: the candidate won,
0: the live version won, 0.5: a tie). The console shows them next to the round's verdict.

Redis key ``ratchet:learner:<alias>:gate_pairs:<version>`` (list of :class:`GatePair` JSON, in
the order scored), at most :data:`KEPT` entries, expiring after :data:`TTL_S`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import redis

KEPT = 16
TTL_S = 30 * 24 * 3600
ANSWER_CHARS = 4000  # an answer is cut to this for the sample (a page shows it, nothing learns)


def gate_pairs_key(alias: str, version: int) -> str:
    return f"ratchet:learner:{alias}:gate_pairs:{version}"


@dataclass(frozen=True)
class GatePair:
    prompt_messages: list[dict[str, Any]]
    candidate: str  # the candidate's answer text
    incumbent: str  # the live version's
    outcome: float

    @property
    def verdict(self) -> str:
        if self.outcome > 0.5:
            return "candidate better"
        if self.outcome < 0.5:
            return "live version better"
        return "tie"


def write_gate_pairs(client: redis.Redis, alias: str, version: int, pairs: list[GatePair]) -> None:
    if not pairs:
        return
    key = gate_pairs_key(alias, version)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.rpush(key, *(json.dumps(asdict(p)) for p in pairs[:KEPT]))
    pipe.expire(key, TTL_S)
    pipe.execute()


def read_gate_pairs(client: redis.Redis, alias: str, version: int) -> list[GatePair]:
    raw = client.lrange(gate_pairs_key(alias, version), 0, -1)
    return [GatePair(**json.loads(item)) for item in raw]

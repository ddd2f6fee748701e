"""How far an alias's judge agrees with its users, on the answers the users rated.

The learner's ratings join (learner/ratings.py) queues each rated served answer of a RULER-judged
alias; the judge (judge/agreement.py) scores it among fresh re-samples of its prompt, as it would
score a training group, and keeps (judge score, user rating) pairs here. This module is the pure
core both sides and ``ratchet status`` share: the keys, the pair encoding, and the measures
(also those of ``ratchet judge calibrate``, judge/calibrate.py, on a team's labelled groups).

- **Pairwise accuracy**: over every two rated answers the users scored differently, the share the
  judge orders the same way (a judge tie counts half). 0.5 is a coin; 1.0 full agreement.
- **Spearman**: the rank correlation of judge scores and ratings (ties get their mean rank).

Both compare answers to different prompts: RULER's scores are relative to their group, so this
is a lower bound on how well the judge ranks answers to one prompt. It is still what matters
before training: a judge whose order disagrees with the users' teaches the model the wrong way.

Redis keys:

- ``ratchet:feedback:<alias>:to_judge`` (list of :class:`RatedExchange` JSON): rated answers
  the judge has not scored yet, each with the request it answered, newest last, at most
  :data:`AGREEMENT_QUEUE` (older ones are dropped when the judge falls behind: the measure needs
  a sample, not every rating);
- ``ratchet:judge:<alias>:agreement`` (list of ``"<judge score>\\t<rating>"``): the newest pairs,
  at most ``feedback.agreement_window``.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis

from ratchet.records import TrafficRecord
from ratchet.rewards.rated import RatedAnswer
from ratchet.settings import AliasConfig

AGREEMENT_QUEUE = 64
# What of a request decides the answers the judge re-samples: the conversation, the tools and
# how they may be used, and the output's form and length.
REPLAYED_REQUEST_KEYS = (
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "max_tokens",
    "max_completion_tokens",
)
# A request larger than this (as JSON) is not queued whole: the queue holds AGREEMENT_QUEUE of
# them in Redis, and the measure needs a sample of the ratings, not every one.
MAX_REPLAYED_REQUEST_CHARS = 65_536


def to_judge_key(alias: str) -> str:
    return f"ratchet:feedback:{alias}:to_judge"


def agreement_key(alias: str) -> str:
    return f"ratchet:judge:{alias}:agreement"


def probes_agreement(config: AliasConfig) -> bool:
    """Whether the alias's judge is compared with its users: RULER judges it, and it is on."""
    return config.reward.kind in ("ruler", "mixed") and config.feedback.judge_agreement


@dataclass(frozen=True)
class RatedExchange:
    """A rated answer queued for the judge, with the request it answered as it was served, so
    the judge re-samples the same prompt under the same tools and constraints. ``request`` is
    None when that request cannot be replayed (cut to fit Kafka, or too large to queue): the
    judge counts such an answer and drops it rather than re-sample a different prompt."""

    rated: RatedAnswer
    request: dict[str, Any] | None

    def encode(self) -> str:
        return json.dumps(
            {"rated": asdict(self.rated), "request": self.request}, ensure_ascii=False
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> RatedExchange:
        """ValueError for an entry that is not one (the caller counts and drops it)."""
        try:
            data = json.loads(raw)
            rated = RatedAnswer(**data["rated"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"not a rated exchange: {exc}") from exc
        request = data.get("request")
        return cls(rated, request if isinstance(request, dict) else None)


def replayed_request(record: TrafficRecord) -> dict[str, Any] | None:
    """What the judge needs of the record's request to re-sample its prompt
    (:data:`REPLAYED_REQUEST_KEYS`), or None when the request was cut to fit Kafka or that part
    is over :data:`MAX_REPLAYED_REQUEST_CHARS`."""
    if record.request_cut:
        return None
    request = record.request
    kept = {k: request[k] for k in REPLAYED_REQUEST_KEYS if request.get(k) is not None}
    if len(json.dumps(kept, ensure_ascii=False)) > MAX_REPLAYED_REQUEST_CHARS:
        return None
    return kept


def encode_pair(judge_score: float, rating: float) -> str:
    return f"{judge_score:.6f}\t{rating:.6f}"


def decode_pair(raw: bytes | str) -> tuple[float, float]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    judge_score, rating = text.split("\t")
    return float(judge_score), float(rating)


@dataclass(frozen=True)
class Agreement:
    pairs: int  # rated answers the judge scored
    pairwise_accuracy: float | None  # None: the users gave them all one rating
    spearman: float | None  # None: the judge or the users gave one score to all

    def line(self) -> str:
        """What ``ratchet status`` prints."""
        if self.pairwise_accuracy is None:
            return f"judge-user agreement: {self.pairs} rated answers scored, not yet comparable"
        rho = "-" if self.spearman is None else f"{self.spearman:+.2f}"
        return (
            f"judge-user agreement: pairwise {self.pairwise_accuracy:.2f}, Spearman {rho} "
            f"over {self.pairs} rated answers"
        )


def pairwise_agreement(scores: Sequence[float], labels: Sequence[float]) -> tuple[float, int]:
    """(agreeing pairs, pairs with different labels); a judge tie counts half."""
    agree, total = 0.0, 0
    for i, j in itertools.combinations(range(len(labels)), 2):
        if labels[i] == labels[j]:
            continue
        total += 1
        judged = scores[i] - scores[j]
        if judged == 0:
            agree += 0.5
        elif (judged > 0) == (labels[i] > labels[j]):
            agree += 1
    return agree, total


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks starting at 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho; None when either side is constant (it is undefined there)."""
    ra, rb = ranks(a), ranks(b)
    if len(set(ra)) < 2 or len(set(rb)) < 2:
        return None
    return statistics.correlation(ra, rb)


def read_agreement(client: redis.Redis, alias: str) -> Agreement | None:
    """The measures over the alias's kept pairs; None before the judge scored any."""
    pairs = [decode_pair(raw) for raw in client.lrange(agreement_key(alias), 0, -1)]
    return agreement(pairs) if pairs else None


def agreement(pairs: Sequence[tuple[float, float]]) -> Agreement:
    """The measures over (judge score, user rating) pairs."""
    judge = [p[0] for p in pairs]
    users = [p[1] for p in pairs]
    agreed, compared = pairwise_agreement(judge, users)
    accuracy = agreed / compared if compared else None
    return Agreement(len(pairs), accuracy, spearman(judge, users))

"""Ratings joined with the answers they rate, for aliases whose reward is learned from them.

``ratchet.feedback`` says only "completion X got score s from key K"; the prompt and the answer
are on ``ratchet.traffic``, and either may arrive first. :class:`RatingsJoin` keeps each side in
Redis until the other comes (``feedback.join_ttl_s``), and appends each joined rating to the
alias's training list once:

Its Redis keys:

- ``ratchet:feedback:exchange:<completion id>`` (string): the answer (alias, prompt, text, key
  hash), until it is rated or expires;
- ``ratchet:feedback:pending:<completion id>`` (string): a rating whose traffic record has not
  arrived yet;
- ``ratchet:feedback:rated:<completion id>`` (string): set once a completion's rating is joined,
  so a second one is dropped;
- ``ratchet:feedback:<alias>:ratings`` (list): joined ratings (:class:`RatedAnswer` JSON), newest
  last, at most ``feedback.max_ratings``;
- ``ratchet:feedback:<alias>:new`` (string): ratings joined since the reward model last trained.

A rating counts only from the key that received the answer (the proxy checks it too).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any, Literal

import redis

from ratchet.records import FeedbackRecord, TrafficRecord, prompt_hash
from ratchet.rewards.reward_model import RatedAnswer
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

Outcome = Literal[
    "joined", "pending", "stored", "duplicate", "wrong_key", "no_answer", "not_feedback_alias"
]


def exchange_key(completion_id: str) -> str:
    return f"ratchet:feedback:exchange:{completion_id}"


def pending_key(completion_id: str) -> str:
    return f"ratchet:feedback:pending:{completion_id}"


def rated_key(completion_id: str) -> str:
    return f"ratchet:feedback:rated:{completion_id}"


def ratings_key(alias: str) -> str:
    return f"ratchet:feedback:{alias}:ratings"


def new_ratings_key(alias: str) -> str:
    return f"ratchet:feedback:{alias}:new"


def answer_text(record: TrafficRecord) -> str | None:
    """The first choice's text of a successful chat exchange, else None."""
    if record.status != 200 or record.endpoint != "chat.completions" or not record.choices:
        return None
    message = record.choices[0].get("message") or {}
    content = message.get("content")
    return content if isinstance(content, str) and content else None


class RatingsJoin:
    """Joins traffic and feedback records in Redis (see the module docstring)."""

    def __init__(self, settings: RatchetSettings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client

    def feedback_aliases(self) -> set[str]:
        return {a for a, c in self.settings.aliases.items() if c.reward.kind == "feedback"}

    def on_traffic(self, record: TrafficRecord) -> Outcome:
        config = self.settings.aliases.get(record.alias)
        if config is None or config.reward.kind != "feedback":
            return "not_feedback_alias"
        text = answer_text(record)
        messages = record.request.get("messages")
        if text is None or not record.response_id or not isinstance(messages, list):
            return "no_answer"
        exchange = {
            "alias": record.alias,
            "prompt_messages": messages,
            "answer": text,
            "key": record.api_key_hash or "",
            "prompt_hash": prompt_hash(messages, record.request.get("tools")),
        }
        ttl = config.feedback.join_ttl_s
        # The first record of an id keeps it, as the proxy's owner record does.
        if not self.redis.set(
            exchange_key(record.response_id), json.dumps(exchange), nx=True, ex=ttl
        ):
            return "duplicate"
        pending = self.redis.get(pending_key(record.response_id))
        if isinstance(pending, bytes):
            rating = json.loads(pending)
            return self._join(record.response_id, exchange, rating["score"], rating["key"])
        return "stored"

    def on_feedback(self, record: FeedbackRecord) -> Outcome:
        if not self.feedback_aliases():
            return "not_feedback_alias"
        raw = self.redis.get(exchange_key(record.completion_id))
        if not isinstance(raw, bytes):
            # Not here yet (or never: it expires). Kept until its traffic record arrives.
            rating = {"score": record.score, "key": record.api_key_hash or ""}
            ttl = self._longest_ttl()
            stored = self.redis.set(
                pending_key(record.completion_id), json.dumps(rating), nx=True, ex=ttl
            )
            return "pending" if stored else "duplicate"
        return self._join(
            record.completion_id, json.loads(raw), record.score, record.api_key_hash or ""
        )

    def _longest_ttl(self) -> int:
        return max((c.feedback.join_ttl_s for c in self.settings.aliases.values()), default=3600)

    def _join(
        self, completion_id: str, exchange: dict[str, Any], score: float, key: str
    ) -> Outcome:
        if key != exchange["key"]:
            return "wrong_key"
        alias = exchange["alias"]
        config = self.settings.aliases.get(alias)
        if config is None:
            return "not_feedback_alias"
        ttl = config.feedback.join_ttl_s
        if not self.redis.set(rated_key(completion_id), b"1", nx=True, ex=ttl):
            return "duplicate"
        answer = RatedAnswer(
            prompt_messages=exchange["prompt_messages"],
            answer=exchange["answer"],
            score=float(score),
            key=key,
            prompt_hash=exchange["prompt_hash"],
            completion_id=completion_id,
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(ratings_key(alias), json.dumps(asdict(answer)))
        pipe.ltrim(ratings_key(alias), -config.feedback.max_ratings, -1)
        pipe.incr(new_ratings_key(alias))
        pipe.delete(exchange_key(completion_id), pending_key(completion_id))
        pipe.execute()
        return "joined"


def read_ratings(client: redis.Redis, alias: str) -> list[RatedAnswer]:
    raw = client.lrange(ratings_key(alias), 0, -1)
    return [RatedAnswer(**json.loads(item)) for item in raw]

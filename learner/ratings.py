"""Ratings joined with the answers they rate: training data for reward models, and the rated
answers the judge scores to measure its agreement with the users.

``ratchet.feedback`` says only "completion X got score s from key K"; the prompt and the answer
are on ``ratchet.traffic``, and either may arrive first. :class:`RatingsJoin` keeps each side in
Redis until the other comes (``feedback.join_ttl_s``), and hands each joined rating on once: to
the alias's training list when its reward learns from ratings
(``RewardConfig.learns_from_ratings``), and to the judge's agreement queue when it is judged by
RULER (``feedback.judge_agreement``).

With ``feedback.regenerate_window_s`` set, a key asking the same prompt again within the window
rates its first answer 0 (an implicit rating, joined like any other unless it was rated first).

Its Redis keys:

- ``ratchet:feedback:exchange:<completion id>`` (string): the answer (alias, prompt, text, key
  hash), until it is rated or expires;
- ``ratchet:feedback:pending:<completion id>`` (string): a rating whose traffic record has not
  arrived yet;
- ``ratchet:feedback:rated:<completion id>`` (string): set once a completion's rating is joined,
  so a second one is dropped;
- ``ratchet:feedback:asked:<alias>:<key hash>:<prompt hash>`` (string): the completion id and
  time of the key's last answer to that prompt, for the regenerate signal;
- ``ratchet:feedback:<alias>:ratings`` (list): joined ratings (:class:`RatedAnswer` JSON), newest
  last, at most ``feedback.max_ratings``;
- ``ratchet:feedback:<alias>:new`` (string): ratings joined since the reward model last trained;
- ``ratchet:feedback:<alias>:to_judge`` (list, ratchet/rewards/agreement.py): rated answers the
  judge has not scored yet, the newest :data:`AGREEMENT_QUEUE`.

A rating counts only from the key that received the answer (the proxy checks it too).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import datetime
from typing import Any, Literal

import redis

from ratchet.records import FeedbackRecord, TrafficRecord, prompt_hash
from ratchet.rewards.agreement import AGREEMENT_QUEUE, probes_agreement, to_judge_key
from ratchet.rewards.reward_model import RatedAnswer
from ratchet.settings import AliasConfig, RatchetSettings

log = logging.getLogger(__name__)

Outcome = Literal[
    "joined",
    "implicit",  # a regenerated answer's implicit rating, joined
    "pending",
    "stored",
    "duplicate",
    "wrong_key",
    "no_answer",
    "not_feedback_alias",
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


def asked_key(alias: str, key_hash: str, prompt_digest: str) -> str:
    return f"ratchet:feedback:asked:{alias}:{key_hash}:{prompt_digest}"


def trains_reward_model(config: AliasConfig) -> bool:
    return config.reward.learns_from_ratings


def joins_ratings(config: AliasConfig) -> bool:
    return trains_reward_model(config) or probes_agreement(config)


def seconds_of(ts: str) -> float:
    """A record's ISO time as a Unix time (0.0 if unreadable: then no window matches it)."""
    try:
        return datetime.fromisoformat(ts).timestamp()
    except ValueError:
        return 0.0


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
        """Aliases whose reward models train on joined ratings."""
        return {a for a, c in self.settings.aliases.items() if trains_reward_model(c)}

    def joined_aliases(self) -> set[str]:
        return {a for a, c in self.settings.aliases.items() if joins_ratings(c)}

    def on_traffic(self, record: TrafficRecord) -> list[Outcome]:
        """Keep the answer for its rating; with the regenerate signal on, also rate the key's
        previous answer to the same prompt 0. The outcomes: this answer's, then that one's."""
        config = self.settings.aliases.get(record.alias)
        if config is None or not joins_ratings(config):
            return ["not_feedback_alias"]
        text = answer_text(record)
        messages = record.request.get("messages")
        if text is None or not record.response_id or not isinstance(messages, list):
            return ["no_answer"]
        exchange = {
            "alias": record.alias,
            "prompt_messages": messages,
            "answer": text,
            "key": record.api_key_hash or "",
            "prompt_hash": prompt_hash(messages, record.request.get("tools")),
            "version": record.version,
        }
        outcomes = [self._store(record.response_id, exchange, config)]
        window = config.feedback.regenerate_window_s
        if window and record.api_key_hash and outcomes[0] != "duplicate":
            regenerated = self._regenerated(record, exchange, window)
            if regenerated is not None:
                outcomes.append(regenerated)
        return outcomes

    def _store(self, completion_id: str, exchange: dict[str, Any], config: AliasConfig) -> Outcome:
        # The first record of an id keeps it, as the proxy's owner record does.
        ttl = config.feedback.join_ttl_s
        if not self.redis.set(exchange_key(completion_id), json.dumps(exchange), nx=True, ex=ttl):
            return "duplicate"
        pending = self.redis.get(pending_key(completion_id))
        if isinstance(pending, bytes):
            rating = json.loads(pending)
            return self._join(completion_id, exchange, rating["score"], rating["key"])
        return "stored"

    def _regenerated(
        self, record: TrafficRecord, exchange: dict[str, Any], window_s: int
    ) -> Outcome | None:
        """The key asked this prompt before, within the window (by the records' own times, so a
        backlog read late still counts): its previous answer is rated 0, unless already rated."""
        assert record.response_id is not None
        now = seconds_of(record.ts)
        key = asked_key(record.alias, exchange["key"], exchange["prompt_hash"])
        previous = self.redis.set(key, f"{record.response_id}\t{now}", ex=window_s, get=True)
        if not isinstance(previous, bytes):
            return None
        previous_id, _, asked_at = previous.decode(errors="replace").partition("\t")
        if previous_id == record.response_id or not 0 <= now - float(asked_at or 0) <= window_s:
            return None
        raw = self.redis.get(exchange_key(previous_id))
        if not isinstance(raw, bytes):
            return None  # rated already, or expired
        outcome = self._join(previous_id, json.loads(raw), 0.0, exchange["key"])
        return "implicit" if outcome == "joined" else outcome

    def on_feedback(self, record: FeedbackRecord) -> Outcome:
        if not self.joined_aliases():
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
        if config is None or not joins_ratings(config):
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
            version=exchange.get("version"),
        )
        encoded = json.dumps(asdict(answer))
        pipe = self.redis.pipeline(transaction=True)
        if trains_reward_model(config):
            pipe.rpush(ratings_key(alias), encoded)
            pipe.ltrim(ratings_key(alias), -config.feedback.max_ratings, -1)
            pipe.incr(new_ratings_key(alias))
        if probes_agreement(config):
            pipe.rpush(to_judge_key(alias), encoded)
            pipe.ltrim(to_judge_key(alias), -AGREEMENT_QUEUE, -1)
        pipe.delete(exchange_key(completion_id), pending_key(completion_id))
        pipe.execute()
        return "joined"


def read_ratings(client: redis.Redis, alias: str) -> list[RatedAnswer]:
    return newest_ratings(client, alias, 0)


def newest_ratings(client: redis.Redis, alias: str, count: int) -> list[RatedAnswer]:
    """The alias's newest ``count`` joined ratings, oldest first (0: all of them)."""
    raw = client.lrange(ratings_key(alias), -count if count else 0, -1)
    return [RatedAnswer(**json.loads(item)) for item in raw]

"""Ratings joined with the answers they rate: training data for reward models, and the rated
answers the judge scores to measure its agreement with the users.

``ratchet.feedback`` says only "completion X got score s from key K"; the prompt and the answer
are on ``ratchet.traffic``, and either may arrive first. :class:`RatingsJoin` keeps a small note
of each answer in Redis (who got it, and where its traffic record is in Kafka) until its rating
comes (``feedback.join_ttl_s``), and a waiting rating until its answer comes; only when both are
there is the traffic record read back from Kafka (:data:`TrafficFetch`) for its prompt and
answer. Redis so holds a few hundred bytes per exchange whatever its size, and whole prompts only
for the answers that get rated: most exchanges are never rated, and their prompts are in Kafka
already. Each joined rating is handed on once: to the alias's training list when its reward
learns from ratings (``RewardConfig.learns_from_ratings``), and to the judge's agreement queue
when it is judged by RULER (``feedback.judge_agreement``), there with the request it answered
(``ratchet.rewards.agreement.RatedExchange``: whole, for the judge to re-sample the same prompt
under the same tools, or not at all when it was cut). A joined rating keeps an excerpt of
its prompt and answer (its text and tool calls), at most what the reward model reads
(:data:`PROMPT_EXCERPT_CHARS`).

The training list is bounded by count (``feedback.max_ratings``) and bytes
(``feedback.max_ratings_bytes``); past either, the client holding the most ratings loses its
oldest (as the gate's held-out pool does, learner/heldout.py): a flood from one client only
ever replaces its own ratings once it holds the most, never everybody else's. A client is the
rating's ``client`` (the key, or a vouching key's user); only the key that got an answer may
rate it.

With ``feedback.regenerate_window_s`` set, a key asking the same prompt again within the window
rates its first answer 0 (an implicit rating, joined like any other unless it was rated first).

Its Redis keys (every one with a TTL):

- ``ratchet:feedback:exchange:<completion id>`` (string, ``join_ttl_s``): the answer's note
  (learner/join_note.py: alias, key digest, client, Kafka partition and offset; about 40
  bytes), until it is rated;
- ``ratchet:feedback:pending:<completion id>`` (string, ``join_ttl_s``): a rating whose traffic
  record has not arrived yet;
- ``ratchet:feedback:rated:<completion id>`` (string, ``join_ttl_s``): set once a completion's
  rating is joined, so a second one is dropped;
- ``ratchet:feedback:asked:<alias>:<key hash>:<prompt hash>`` (string, the window): the completion
  id and time of the key's last answer to that prompt (JSON), for the regenerate signal;
- ``ratchet:feedback:<alias>:ratings`` (list, :data:`RATINGS_TTL_S` from the last rating): joined
  ratings (:class:`RatedAnswer` JSON), newest last, bounded as above; with ``...:owners`` (list,
  the client of each, in step), ``...:clients`` (sorted set, ratings per client) and ``...:bytes``
  (string, the list's size);
- ``ratchet:feedback:<alias>:new`` (string, :data:`RATINGS_TTL_S`): ratings joined since the
  reward model last trained;
- ``ratchet:feedback:<alias>:to_judge`` (list, ratchet/rewards/agreement.py): rated answers the
  judge has not scored yet, the newest :data:`AGREEMENT_QUEUE`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any, Literal

import redis

from learner.join_note import JoinNote
from ratchet.records import (
    FeedbackRecord,
    TrafficRecord,
    answer_as_text,
    prompt_hash,
    tool_calls_of,
)
from ratchet.rewards.agreement import (
    AGREEMENT_QUEUE,
    RatedExchange,
    probes_agreement,
    replayed_request,
    to_judge_key,
)
from ratchet.rewards.rated import RatedAnswer
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
    "gone",  # its traffic record is no longer in Kafka (past retention)
    "bad_id",  # a completion id that is not one (vLLM echoes a client's request_id)
    "not_feedback_alias",
]

# The traffic record at (partition, offset) of ratchet.traffic; None when Kafka no longer has it.
# It raises a KafkaError when Kafka cannot answer: the batch is then read again.
TrafficFetch = Callable[[int, int], TrafficRecord | None]

# Completion ids: printable ASCII without spaces, as vLLM makes them. A client's request_id
# becomes the id, so anything else (a tab, a newline, 10 KB) is refused, never parsed.
COMPLETION_ID = re.compile(r"[!-~]{1,256}")
# What a joined rating keeps of its prompt and of its answer: the reward model reads at most
# 1024 prompt tokens and 2048 in all (ratchet/rewards/reward_model.py AnswerFeatures), and a
# token is rarely over 16 characters. Bounds a rating at ~32 K characters whatever the prompt.
PROMPT_EXCERPT_CHARS = 16_384
ANSWER_EXCERPT_CHARS = 16_384
# A ratings list no rating has reached for this long is dropped: it is training data for a
# reward model nobody rates any more, and every Redis key must expire.
RATINGS_TTL_S = 30 * 24 * 3600

# KEYS: ratings, owners, clients, bytes. ARGV: the rating, its client, max count, max bytes, TTL.
# Appends the rating; while the list is over either bound, the client with the most ratings loses
# its oldest. Returns how many were evicted.
APPEND_RATING = """
local entry, client = ARGV[1], ARGV[2]
local max_count, max_bytes, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('RPUSH', KEYS[1], entry)
redis.call('RPUSH', KEYS[2], client)
redis.call('ZINCRBY', KEYS[3], 1, client)
local bytes = redis.call('INCRBY', KEYS[4], #entry)
local count = redis.call('LLEN', KEYS[1])
local evicted = 0
while count > 1 and (count > max_count or bytes > max_bytes) do
  local largest = redis.call('ZREVRANGE', KEYS[3], 0, 0)[1]
  local index = largest and redis.call('LPOS', KEYS[2], largest)
  local old
  if index then
    old = redis.call('LINDEX', KEYS[1], index)
    redis.call('LSET', KEYS[1], index, '\\0evicted')
    redis.call('LREM', KEYS[1], 1, '\\0evicted')
    redis.call('LSET', KEYS[2], index, '\\0evicted')
    redis.call('LREM', KEYS[2], 1, '\\0evicted')
    if tonumber(redis.call('ZINCRBY', KEYS[3], -1, largest)) <= 0 then
      redis.call('ZREM', KEYS[3], largest)
    end
  else
    -- owners out of step with the list (written by hand): the oldest goes
    old = redis.call('LPOP', KEYS[1])
    redis.call('LPOP', KEYS[2])
  end
  bytes = redis.call('INCRBY', KEYS[4], -#old)
  count = count - 1
  evicted = evicted + 1
end
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
return evicted
"""


def exchange_key(completion_id: str) -> str:
    return f"ratchet:feedback:exchange:{completion_id}"


def pending_key(completion_id: str) -> str:
    return f"ratchet:feedback:pending:{completion_id}"


def rated_key(completion_id: str) -> str:
    return f"ratchet:feedback:rated:{completion_id}"


def ratings_key(alias: str) -> str:
    return f"ratchet:feedback:{alias}:ratings"


def ratings_bookkeeping_keys(alias: str) -> list[str]:
    """The ratings list's companions, in APPEND_RATING's order after the list itself."""
    return [
        f"ratchet:feedback:{alias}:ratings:owners",
        f"ratchet:feedback:{alias}:ratings:clients",
        f"ratchet:feedback:{alias}:ratings:bytes",
    ]


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


def valid_completion_id(completion_id: str | None) -> bool:
    return completion_id is not None and COMPLETION_ID.fullmatch(completion_id) is not None


def answer_message(record: TrafficRecord) -> dict[str, Any] | None:
    """The first choice's message of a successful chat exchange, when it has text or tool calls
    (an agent's answer is often a call alone), else None."""
    if record.status != 200 or record.endpoint != "chat.completions" or not record.choices:
        return None
    message = record.choices[0].get("message")
    return message if isinstance(message, dict) and answer_as_text(message) else None


def excerpt_tool_calls(message: dict[str, Any], budget: int) -> list[dict[str, Any]] | None:
    """The answer's tool calls, their names and arguments cut to ``budget`` characters in all
    (the calls after it is spent are left out); None without calls."""
    out: list[dict[str, Any]] = []
    for name, arguments in tool_calls_of(message):
        if budget <= 0:
            break
        name = name[:budget]
        arguments = arguments[: budget - len(name)]
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
        budget -= len(name) + len(arguments)
    return out or None


def excerpt_messages(messages: list[Any], budget: int) -> list[dict[str, Any]]:
    """The messages with their text cut to ``budget`` characters in all, the first kept (the
    reward model reads a prompt's head): every message keeps its role, later ones may be
    empty. Content parts keep their text parts only."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "\n".join(t for t in texts if isinstance(t, str))
        text = content if isinstance(content, str) else ""
        out.append({"role": str(message.get("role", "user")), "content": text[:budget]})
        budget = max(0, budget - len(text))
    return out


class RatingsJoin:
    """Joins traffic and feedback records in Redis (see the module docstring)."""

    def __init__(self, settings: RatchetSettings, client: redis.Redis, fetch: TrafficFetch) -> None:
        self.settings = settings
        self.redis = client
        self.fetch = fetch
        self._append = client.register_script(APPEND_RATING)

    def feedback_aliases(self) -> set[str]:
        """Aliases whose reward models train on joined ratings."""
        return {a for a, c in self.settings.aliases.items() if trains_reward_model(c)}

    def joined_aliases(self) -> set[str]:
        return {a for a, c in self.settings.aliases.items() if joins_ratings(c)}

    def on_traffic(self, record: TrafficRecord, partition: int, offset: int) -> list[Outcome]:
        """Note the answer (read at ``partition``/``offset`` of ratchet.traffic) for its rating;
        with the regenerate signal on, also rate the key's previous answer to the same prompt 0.
        The outcomes: this answer's, then that one's."""
        config = self.settings.aliases.get(record.alias)
        if config is None or not joins_ratings(config):
            return ["not_feedback_alias"]
        messages = record.request.get("messages")
        if (
            answer_message(record) is None
            or not record.response_id
            or not isinstance(messages, list)
        ):
            return ["no_answer"]
        if not valid_completion_id(record.response_id):
            return ["bad_id"]
        note = JoinNote.of(record.alias, record.api_key_hash, record.client, partition, offset)
        outcomes = [self._store(record, note, config)]
        window = config.feedback.regenerate_window_s
        if window and record.api_key_hash and outcomes[0] != "duplicate":
            digest = prompt_hash(messages, record.request.get("tools"))
            regenerated = self._regenerated(record, digest, window)
            if regenerated is not None:
                outcomes.append(regenerated)
        return outcomes

    def _store(self, record: TrafficRecord, note: JoinNote, config: AliasConfig) -> Outcome:
        # The first record of an id keeps it, as the proxy's owner record does.
        assert record.response_id is not None
        ttl = config.feedback.join_ttl_s
        if not self.redis.set(exchange_key(record.response_id), note.encode(), nx=True, ex=ttl):
            return "duplicate"
        pending = self.redis.get(pending_key(record.response_id))
        if isinstance(pending, bytes):
            rating = json.loads(pending)
            return self._join(record.response_id, note, record, rating["score"], rating["key"])
        return "stored"

    def _regenerated(self, record: TrafficRecord, digest: str, window_s: int) -> Outcome | None:
        """The key asked this prompt before, within the window (by the records' own times, so a
        backlog read late still counts): its previous answer is rated 0, unless already rated."""
        assert record.response_id is not None
        now = seconds_of(record.ts)
        key = asked_key(record.alias, record.api_key_hash or "", digest)
        asked = json.dumps({"id": record.response_id, "at": now})
        previous = self.redis.set(key, asked, ex=window_s, get=True)
        if not isinstance(previous, bytes):
            return None
        try:
            before = json.loads(previous)
            previous_id, asked_at = str(before["id"]), float(before["at"])
        except (ValueError, TypeError, KeyError):
            return None  # written by an older version, or by hand: no signal
        if previous_id == record.response_id or not 0 <= now - asked_at <= window_s:
            return None
        raw = self.redis.get(exchange_key(previous_id))
        if not isinstance(raw, bytes):
            return None  # rated already, or expired
        previous_note = JoinNote.decode(raw)
        outcome = self._join(previous_id, previous_note, None, 0.0, record.api_key_hash or "")
        return "implicit" if outcome == "joined" else outcome

    def on_feedback(self, record: FeedbackRecord) -> Outcome:
        if not self.joined_aliases():
            return "not_feedback_alias"
        if not valid_completion_id(record.completion_id):
            return "bad_id"
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
            record.completion_id,
            JoinNote.decode(raw),
            None,
            record.score,
            record.api_key_hash or "",
        )

    def _longest_ttl(self) -> int:
        return max((c.feedback.join_ttl_s for c in self.settings.aliases.values()), default=3600)

    def _join(
        self,
        completion_id: str,
        note: JoinNote,
        record: TrafficRecord | None,
        score: float,
        key: str,
    ) -> Outcome:
        """Join the rating with its answer: ``record`` when at hand, else read back from Kafka."""
        if not note.owned_by(key):
            return "wrong_key"  # ownership is the API key's, whoever the client
        alias = note.alias
        config = self.settings.aliases.get(alias)
        if config is None or not joins_ratings(config):
            return "not_feedback_alias"
        ttl = config.feedback.join_ttl_s
        if self.redis.exists(rated_key(completion_id)):
            return "duplicate"
        if record is None:
            record = self.fetch(note.partition, note.offset)
        message = None if record is None else answer_message(record)
        messages = None if record is None else record.request.get("messages")
        if record is None or message is None or not isinstance(messages, list):
            self.redis.delete(exchange_key(completion_id))
            return "gone"
        if not self.redis.set(rated_key(completion_id), b"1", nx=True, ex=ttl):
            return "duplicate"
        content = message.get("content")
        text = content[:ANSWER_EXCERPT_CHARS] if isinstance(content, str) else ""
        answer = RatedAnswer(
            prompt_messages=excerpt_messages(messages, PROMPT_EXCERPT_CHARS),
            answer=text,
            tool_calls=excerpt_tool_calls(message, ANSWER_EXCERPT_CHARS - len(text)),
            score=float(score),
            key=key,
            prompt_hash=prompt_hash(messages, record.request.get("tools")),
            completion_id=completion_id,
            version=record.version,
            client=note.client_for(key),
        )
        self._hand_on(alias, config, answer, record)
        self.redis.delete(exchange_key(completion_id), pending_key(completion_id))
        return "joined"

    def _hand_on(
        self, alias: str, config: AliasConfig, answer: RatedAnswer, record: TrafficRecord
    ) -> None:
        if trains_reward_model(config):
            encoded = json.dumps(asdict(answer), ensure_ascii=False)
            keys = [ratings_key(alias), *ratings_bookkeeping_keys(alias)]
            feedback = config.feedback
            limits = [feedback.max_ratings, feedback.max_ratings_bytes, RATINGS_TTL_S]
            self._append(keys, [encoded, answer.owner, *limits])
            pipe = self.redis.pipeline(transaction=True)
            pipe.incr(new_ratings_key(alias))
            pipe.expire(new_ratings_key(alias), RATINGS_TTL_S)
            pipe.execute()
        if probes_agreement(config):
            # The judge re-samples the prompt the answer was served for, whole, with its tools.
            queued = RatedExchange(answer, replayed_request(record)).encode()
            pipe = self.redis.pipeline(transaction=True)
            pipe.rpush(to_judge_key(alias), queued)
            pipe.ltrim(to_judge_key(alias), -AGREEMENT_QUEUE, -1)
            pipe.expire(to_judge_key(alias), config.feedback.join_ttl_s)
            pipe.execute()


def read_ratings(client: redis.Redis, alias: str) -> list[RatedAnswer]:
    return newest_ratings(client, alias, 0)


def newest_ratings(client: redis.Redis, alias: str, count: int) -> list[RatedAnswer]:
    """The alias's newest ``count`` joined ratings, oldest first (0: all of them)."""
    raw = client.lrange(ratings_key(alias), -count if count else 0, -1)
    return [RatedAnswer(**json.loads(item)) for item in raw]

"""The judge's marks in Redis: which traffic records are judged, which prompts were seen lately,
and which keep giving groups without signal.

Every mark only saves work: without Redis a record or prompt may be judged twice, and nothing is
lost, so each read falls back to "not marked" and each write to "not written".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import redis
import redis.asyncio as aioredis

from ratchet.records import HeldoutPrompt, Record, ScoredGroup

log = logging.getLogger(__name__)


def done_key(request_id: str) -> str:
    """String: set (with judge.done_ttl_s) once the record's outputs are acknowledged by Kafka."""
    return f"ratchet:judge:done:{request_id}"


def seen_key(alias: str, prompt_digest: str) -> str:
    """String, for ``learning.dedup_window_s``: ``v<version>`` once a group of the prompt was
    sampled from that version; ``1`` once it was held out."""
    return f"ratchet:judge:seen:{alias}:{prompt_digest}"


def flat_key(alias: str, prompt_digest: str) -> str:
    """String, for ``learning.dedup_window_s``: how many of the prompt's groups in a row, the
    last one included, had answers that all scored alike (no GRPO signal)."""
    return f"ratchet:judge:flat:{alias}:{prompt_digest}"


def repeat_reason(
    seen: bytes | None, flat: bytes | None, version: int, skip_after: int
) -> str | None:
    """Why a training prompt is not sampled from ``version`` now, from its marks: a group of
    it was sampled from this version within the window (``recent_duplicate``; any other mark,
    an older judge's included, counts too), or its last ``skip_after`` groups carried no signal
    (``no_signal``; 0: never). None: sample it."""
    if seen is not None and (not seen.startswith(b"v") or seen == b"v%d" % version):
        return "recent_duplicate"
    if skip_after and flat is not None and flat.isdigit() and int(flat) >= skip_after:
        return "no_signal"
    return None


class SeenMark(NamedTuple):
    key: str
    window_s: int
    value: bytes = b"1"


class Sampled(NamedTuple):
    """A prompt a group was sampled for: its seen mark, its digest and the group."""

    seen: SeenMark
    digest: str
    group: ScoredGroup


class JudgeMarks:
    def __init__(self, client: aioredis.Redis, done_ttl_s: int) -> None:
        self.redis = client
        self.done_ttl_s = done_ttl_s

    async def prompt_marks(self, alias: str, digest: str) -> tuple[bytes | None, bytes | None]:
        """The prompt's seen and flat marks (:func:`repeat_reason` reads them)."""
        try:
            marks = await self.redis.mget(seen_key(alias, digest), flat_key(alias, digest))
        except (redis.RedisError, OSError):
            return None, None
        seen, flat = (m.encode() if isinstance(m, str) else m for m in marks)
        return seen, flat

    async def seen(self, key: str) -> bool:
        try:
            return bool(await self.redis.exists(key))
        except (redis.RedisError, OSError):
            return False  # without Redis a repeat may be judged twice; nothing is lost

    async def done(self, request_id: str) -> bool:
        if not self.done_ttl_s:
            return False
        try:
            return bool(await self.redis.exists(done_key(request_id)))
        except (redis.RedisError, OSError):
            return False  # without Redis a re-read record may be judged twice; nothing is lost

    async def mark_done(self, outputs: list[Record]) -> None:
        ttl = self.done_ttl_s
        ids = {r.traffic_request_id for r in outputs if isinstance(r, ScoredGroup | HeldoutPrompt)}
        if not ttl or not ids:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for request_id in ids:
                pipe.set(done_key(request_id), b"1", ex=ttl)
            await pipe.execute()
        except (redis.RedisError, OSError) as exc:
            log.warning("could not mark %d records judged (%s)", len(ids), exc)

    async def mark_seen(self, marks: Sequence[SeenMark]) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for mark in marks:
                if mark.window_s:
                    pipe.set(mark.key, mark.value, ex=mark.window_s)
            await pipe.execute()
        except (redis.RedisError, OSError):
            pass  # a prompt not marked may be judged again; that costs time, loses nothing

    async def mark_sampled(self, sampled: Sequence[Sampled]) -> None:
        """Each prompt sampled: seen at the group's version, and its run of signal-less groups
        one longer (every answer scored alike) or over (they differed)."""
        await self.mark_seen([s.seen._replace(value=b"v%d" % s.group.version) for s in sampled])
        try:
            pipe = self.redis.pipeline(transaction=False)
            for seen, digest, group in sampled:
                if not seen.window_s:
                    continue
                key = flat_key(group.alias, digest)
                if group.rewards and max(group.rewards) == min(group.rewards):
                    pipe.incr(key)
                    pipe.expire(key, seen.window_s)
                else:
                    pipe.delete(key)
            await pipe.execute()
        except (redis.RedisError, OSError):
            pass  # a prompt's run not counted is sampled again; that costs time, loses nothing

"""The judge's marks in Redis: which traffic records are judged, which prompts were seen lately,
and which keep giving groups without signal.

Every mark only saves work: without Redis a record or prompt may be judged twice, and nothing is
lost, so each read falls back to "not marked" and each write to "not written".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import redis
import redis.asyncio as aioredis

from judge import seen_sets
from ratchet.records import HeldoutPrompt, Record, ScoredGroup

log = logging.getLogger(__name__)


def done_key(request_id: str) -> str:
    """String: set (with judge.done_ttl_s) once the record's outputs are acknowledged by Kafka,
    deleted once the batch's offsets are committed (then nobody reads the record again)."""
    return f"ratchet:judge:done:{request_id}"


def flat_key(alias: str, prompt_digest: str) -> str:
    """String, for ``learning.dedup_window_s``: how many of the prompt's groups in a row, the
    last one included, had answers that all scored alike (no GRPO signal)."""
    return f"ratchet:judge:flat:{alias}:{prompt_digest}"


def repeat_reason(seen_at_version: bool, flat: bytes | None, skip_after: int) -> str | None:
    """Why a training prompt is not sampled from the version a group would come from now: a
    group of it was sampled from that version within the window (``recent_duplicate``), or its
    last ``skip_after`` groups carried no signal (``no_signal``; 0: never). None: sample it."""
    if seen_at_version:
        return "recent_duplicate"
    if skip_after and flat is not None and flat.isdigit() and int(flat) >= skip_after:
        return "no_signal"
    return None


class SeenMark(NamedTuple):
    """A prompt judged: held out (``version`` None), or sampled from ``version``; kept in the
    seen sets (judge/seen_sets.py) for ``window_s`` (0: not kept)."""

    alias: str
    digest: str
    window_s: int
    version: int | None = None


class Sampled(NamedTuple):
    """A prompt a group was sampled for: its seen mark and the group."""

    seen: SeenMark
    group: ScoredGroup


class JudgeMarks:
    def __init__(
        self, client: aioredis.Redis, done_ttl_s: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.redis = client
        self.done_ttl_s = done_ttl_s
        self.clock = clock
        self.unsettled: set[str] = set()  # marked done, their batch not committed yet

    async def _any_member(self, mark: SeenMark, version: int | None) -> bool:
        keys = list(seen_sets.read_keys(mark.alias, mark.digest, mark.window_s, self.clock()))
        wanted = str(seen_sets.member(mark.digest, version))
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.sismember(key, wanted)
        return any(await pipe.execute())

    async def prompt_marks(self, mark: SeenMark) -> tuple[bool, bytes | None]:
        """Whether the prompt was seen at all within the window, and its flat mark
        (:func:`repeat_reason` reads it)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            keys = seen_sets.read_keys(mark.alias, mark.digest, mark.window_s, self.clock())
            for key in keys:
                pipe.sismember(key, str(seen_sets.member(mark.digest, None)))
            pipe.get(flat_key(mark.alias, mark.digest))
            *seen, flat = await pipe.execute()
        except (redis.RedisError, OSError):
            return False, None
        return any(seen), flat.encode() if isinstance(flat, str) else flat

    async def seen(self, mark: SeenMark, version: int | None = None) -> bool:
        """Whether the prompt was seen within the window: at all (``version`` None), or sampled
        from ``version``."""
        try:
            return await self._any_member(mark, version)
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
            self.unsettled |= ids
        except (redis.RedisError, OSError) as exc:
            log.warning("could not mark %d records judged (%s)", len(ids), exc)

    async def settle(self, committed: bool) -> None:
        """The batch's offsets are committed (its done marks are deleted: no judge reads its
        records again, so they would only hold memory), or were refused by a rebalance (the
        marks stay, for the judge that re-reads the batch, until ``judge.done_ttl_s``)."""
        ids, self.unsettled = self.unsettled, set()
        if not committed or not ids:
            return
        # Not deleted: they expire after judge.done_ttl_s; a mark left only holds memory.
        with contextlib.suppress(redis.RedisError, OSError):
            await self.redis.delete(*(done_key(request_id) for request_id in ids))

    async def mark_seen(self, marks: Sequence[SeenMark]) -> None:
        """Each prompt into the seen set of the current bucket: seen at all, and for a sampled
        one, sampled from its version."""
        now = self.clock()
        try:
            pipe = self.redis.pipeline(transaction=False)
            for mark in marks:
                if not mark.window_s:
                    continue
                key, ttl = seen_sets.write_key(mark.alias, mark.digest, mark.window_s, now)
                members = {seen_sets.member(mark.digest, None)}
                if mark.version is not None:
                    members.add(seen_sets.member(mark.digest, mark.version))
                pipe.sadd(key, *members)
                pipe.expire(key, ttl)
            await pipe.execute()
        except (redis.RedisError, OSError):
            pass  # a prompt not marked may be judged again; that costs time, loses nothing

    async def mark_sampled(self, sampled: Sequence[Sampled]) -> None:
        """Each prompt sampled: seen at the group's version, and its run of signal-less groups
        one longer (every answer scored alike) or over (they differed)."""
        await self.mark_seen([s.seen._replace(version=s.group.version) for s in sampled])
        try:
            pipe = self.redis.pipeline(transaction=False)
            for seen, group in sampled:
                if not seen.window_s:
                    continue
                key = flat_key(group.alias, seen.digest)
                if group.rewards and max(group.rewards) == min(group.rewards):
                    pipe.incr(key)
                    pipe.expire(key, seen.window_s)
                else:
                    pipe.delete(key)
            await pipe.execute()
        except (redis.RedisError, OSError):
            pass  # a prompt's run not counted is sampled again; that costs time, loses nothing

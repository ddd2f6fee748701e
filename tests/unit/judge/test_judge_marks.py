"""The judge's marks against a real Redis: a seen mark is found for at least its window and at
most a bucket longer, per version; one is a member of an integer set (8 bytes, not a key); done
marks are deleted once their batch is committed and kept when the commit was refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from judge import seen_sets
from judge.marks import JudgeMarks, SeenMark, done_key
from ratchet.records import HeldoutPrompt, prompt_hash

WINDOW_S = 600
START = 1_700_000_400.0  # a bucket's start: 600 s windows have 150 s buckets


def with_marks(redis_url: str, use: Callable[[JudgeMarks, list[float]], Awaitable[Any]]) -> Any:
    now = [START]

    async def run() -> Any:
        marks = JudgeMarks(aioredis.Redis.from_url(redis_url), 3600, clock=lambda: now[0])
        try:
            return await use(marks, now)
        finally:
            await marks.redis.aclose()

    return asyncio.run(run())


def test_a_seen_mark_lasts_its_window_and_at_most_a_bucket_more(redis_url: str) -> None:
    digest = prompt_hash([{"role": "user", "content": "hello"}])
    mark = SeenMark("support", digest, WINDOW_S)

    async def use(marks: JudgeMarks, now: list[float]) -> list[tuple[bool, bool, bool]]:
        await marks.mark_seen([mark._replace(version=3)])
        found = []
        for later in (0, WINDOW_S - 1, WINDOW_S + seen_sets.bucket_s(WINDOW_S) + 1):
            now[0] = START + 100 + later  # marked 100 s into its bucket
            found.append(
                (await marks.seen(mark), await marks.seen(mark, 3), await marks.seen(mark, 4))
            )
        return found

    assert with_marks(redis_url, use) == [(True, True, False)] * 2 + [(False, False, False)]
    [key] = redis.Redis.from_url(redis_url).keys("ratchet:judge:seen-sets:*")
    client = redis.Redis.from_url(redis_url)
    assert client.object("encoding", key) == b"intset"  # 8 bytes a member, not a key a mark
    # The set outlives the last mark its bucket can hold by the window, not longer.
    assert 0 < client.ttl(key) <= seen_sets.bucket_s(WINDOW_S) + WINDOW_S


def test_done_marks_are_deleted_once_committed_and_kept_when_refused(redis_url: str) -> None:
    def held(request_id: str) -> HeldoutPrompt:
        return HeldoutPrompt(
            prompt_hash="0" * 64, alias="support", prompt_messages=[], traffic_request_id=request_id
        )

    async def use(marks: JudgeMarks, now: list[float]) -> list[bool]:
        await marks.mark_done([held("committed")])
        await marks.settle(True)
        await marks.mark_done([held("refused")])
        await marks.settle(False)  # the group rebalanced: the next owner re-reads and skips it
        return [await marks.done("committed"), await marks.done("refused")]

    assert with_marks(redis_url, use) == [False, True]
    assert redis.Redis.from_url(redis_url).ttl(done_key("refused")) > 0


def test_members_are_63_bit_integers_one_per_version() -> None:
    digest = "f" * 64
    members = {seen_sets.member(digest, v) for v in (None, 0, 1, 65535)}
    assert len(members) == 3  # 65,535 releases apart share a tag: no window spans them
    assert all(0 <= m < 2**63 for m in members)

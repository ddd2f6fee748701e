"""The rate limiter's Redis client: replies in pieces, pipelining, auth and database, reconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import uvloop

from proxy import resp
from proxy.resp import RedisClient, RedisReplyError, _Connection, pack, parse

REPLIES = b"+OK\r\n:42\r\n$5\r\nhe\r\nl\r\n$-1\r\n*3\r\n:1\r\n*1\r\n$0\r\n\r\n*-1\r\n-ERR no\r\n"
EXPECTED: list[Any] = ["OK", 42, b"he\r\nl", None, [1, [b""], None]]


class _Transport(asyncio.Transport):
    def write(self, _: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_replies_split_anywhere_reach_their_callers_in_order() -> None:
    for cut in range(1, len(REPLIES)):
        connection = _Connection()
        connection.connection_made(_Transport())
        waiters = [connection.send(b"") for _ in range(len(EXPECTED) + 1)]
        connection.data_received(REPLIES[:cut])
        connection.data_received(REPLIES[cut:])
        assert [w.result() for w in waiters[:-1]] == EXPECTED, cut
        with pytest.raises(RedisReplyError, match="ERR no"):
            waiters[-1].result()


def test_pack_is_resp() -> None:
    assert pack("GET", b"k", 3) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$1\r\n3\r\n"
    assert parse(b":1\r\n", 0) == (1, 4)
    assert parse(b"$3\r\nab", 0) is None


async def test_concurrent_calls_share_one_connection(redis_url: str) -> None:
    client = RedisClient(redis_url, timeout_s=5)
    try:
        replies = await asyncio.gather(*(client.call(pack("INCR", "n")) for _ in range(200)))
        assert sorted(replies) == list(range(1, 201))
        # Other tests share this Redis: ask which connection served each call, not how many
        # connections the server has.
        ids = await asyncio.gather(*(client.call(pack("CLIENT", "ID")) for _ in range(50)))
        assert len(set(ids)) == 1, ids
    finally:
        await client.close()


async def test_password_and_database_come_from_the_url(redis_url: str) -> None:
    server = redis.Redis.from_url(redis_url)
    server.config_set("requirepass", "s3cret")
    try:
        authed = redis_url.replace("redis://", "redis://:s3cret@").removesuffix("/0") + "/3"
        client = RedisClient(authed, timeout_s=5)
        assert await client.call(pack("SET", "where", "db3")) == "OK"
        await client.close()
        assert redis.Redis.from_url(authed).get("where") == b"db3"
        wrong = RedisClient(redis_url.replace("redis://", "redis://:wrong@"), timeout_s=5)
        with pytest.raises(RedisReplyError, match=r"WRONGPASS|invalid password"):
            await wrong.call(pack("PING"))
        await wrong.close()
    finally:
        redis.Redis.from_url(redis_url, password="s3cret").config_set("requirepass", "")


async def test_a_dropped_connection_is_opened_again(redis_url: str) -> None:
    client = RedisClient(redis_url, timeout_s=5)
    try:
        assert await client.call(pack("PING")) == "PONG"
        redis.Redis.from_url(redis_url).client_kill_filter(_type="normal", skipme=True)
        deadline = asyncio.get_running_loop().time() + 5
        while True:  # the first call may still find the old connection, then fail
            try:
                assert await client.call(pack("PING")) == "PONG"
                break
            except ConnectionError:
                assert asyncio.get_running_loop().time() < deadline
    finally:
        await client.close()


def test_it_runs_on_uvloop_as_the_proxy_does(redis_url: str) -> None:
    async def ping_twice() -> list[Any]:
        client = RedisClient(redis_url, timeout_s=5)
        try:
            return [await client.call(pack("PING")) for _ in range(2)]
        finally:
            await client.close()

    assert uvloop.run(ping_twice()) == ["PONG", "PONG"]


async def test_a_late_reply_fails_its_caller_alone_and_keeps_the_connection(
    redis_url: str,
) -> None:
    client = RedisClient(redis_url, timeout_s=0.05)
    try:
        before = await client.call(pack("CLIENT", "ID"))
        with pytest.raises(TimeoutError):  # Redis answers it only after 0.3 s
            await client.call(pack("BLPOP", "nothing", "0.3"))
        deadline = asyncio.get_running_loop().time() + 5
        while True:  # the calls queued behind it may be late too
            try:
                after = await client.call(pack("CLIENT", "ID"))
                break
            except TimeoutError:
                assert asyncio.get_running_loop().time() < deadline
        assert after == before  # the late reply was skipped, the connection kept
        assert await client.call(pack("ECHO", "paired")) == b"paired"
    finally:
        await client.close()


async def test_a_connection_that_stops_answering_is_dropped(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp, "STALLED_S", 0.2)
    client = RedisClient(redis_url, timeout_s=0.05)
    try:
        await client.call(pack("PING"))
        hung = client.send(pack("BLPOP", "nothing", "0"))  # blocks the connection for good
        assert hung is not None
        deadline = asyncio.get_running_loop().time() + 5
        while not hung.done():  # each late call asks whether it has answered nothing too long
            with pytest.raises(TimeoutError):
                await client.call(pack("PING"))
            assert asyncio.get_running_loop().time() < deadline, "never dropped"
        with pytest.raises(ConnectionError):
            hung.result()
        assert await client.call(pack("PING")) == "PONG"  # a new connection
    finally:
        await client.close()

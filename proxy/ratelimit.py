"""Per-key rate limits and token budgets, enforced alike by every proxy replica through Redis.

Redis holds each key's buckets (proxy/buckets.py). A request whose key this replica knows little
about, or knows to be near a limit, waits for one EVALSHA (one round trip) that checks every
limit and takes from all of them or none; it is sent as soon as the caller is known and read
after the body is parsed, so Redis works while the proxy does. Near a limit every request waits
for Redis, so the limit is exact there.

A request with token budgets reserves what it may use (proxy/buckets.py) and is settled after
its answer: :meth:`RateLimiter.charge` sends the difference, a refund or a further charge.

Far from its limits a key does not wait: when this replica last heard from Redis (under FRESH_S
ago) that every limit of the key was at least FAST_FILL full, less what this replica added
since (and, for a budget, less the request's reservation), the request is let through and its
take is sent later with others, in one EVALSHA every SEND_AFTER_S or after enough of them,
together with the settlements of answers. Its reply is the next view. At most ``fast_max``
requests of a key per replica (1% of the burst, at least one) wait for Redis's word so; so when
other replicas drain a key from half full within that time, each replica serves at most that
many requests past a limit, counted in ``ratchet_proxy_ratelimit_overshoot_total``.

A key Redis found empty is refused here until it has refilled (nothing refills a bucket sooner),
so a key that keeps knocking costs Redis nothing.

The limits never fail open. A request whose answer from Redis is late (past ``timeout_s``) is
checked by this replica alone (:class:`~proxy.buckets.LocalBuckets`, from Redis's last word on
the key), or, with ``budgets_without_redis: closed`` and token budgets on, refused with 503. One
late reply costs only the requests that waited on it. When Redis fails outright (refused, hung,
full: an error reply) every request is checked so for UNAVAILABLE_BACKOFF_S without asking it;
what this replica took meanwhile is sent once Redis answers again, and what it sent without
learning the outcome is counted in ``ratchet_proxy_ratelimit_unavailable_total{call="charge"}``.

The bucket is the caller's key hash when the proxy requires keys: a limit is what the key's holder
may spend, so a vouching key's users (``proxy.user_vouching_keys``) share it, or a client could
name itself a fresh user per request. Without auth any key is accepted, so a client could invent
one per request: every caller then shares one bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from proxy.buckets import (
    ADD_SCRIPT,
    ADD_SHA,
    ADMIT_SCRIPT,
    ADMIT_SHA,
    LocalBuckets,
    bucket_key,
    budgets_unavailable,
    configured_limits,
    refusal,
)
from proxy.metrics import ProxyMetrics
from proxy.resp import RedisClient, RedisReplyError, bulk, pack
from ratchet.settings import RateLimitSettings

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
# After Redis failed, requests are checked here alone this long before it is tried again, so an
# outage costs each request nothing rather than a timeout.
UNAVAILABLE_BACKOFF_S = 1.0
# Takes and tokens wait at most this long to go to Redis together; other replicas see them late
# by as much.
SEND_AFTER_S = 0.05
# A request does not wait for Redis while this replica's view of its key is this fresh and every
# limit at least this full (see the module's docstring).
FRESH_S = 1.0
FAST_FILL = 0.5
_ERRORS = (RedisReplyError, OSError, TimeoutError)  # ConnectionError is an OSError
# Failures after which Redis surely did not apply a command: an error reply, or no connection.
_NOT_APPLIED = (RedisReplyError, ConnectionRefusedError)


@dataclass(slots=True)
class Admission:
    """A request's question to Redis, asked by :meth:`RateLimiter.ask`."""

    bucket: str
    asked_at: float  # monotonic
    waiter: asyncio.Future[Any] | None  # the answer to come; None: not connected yet
    added: list[float] | None  # ms added to each limit before the check (takes, tokens)
    takes: int  # requests let through earlier whose takes go with it
    units: list[int] | None  # units taken from each limit; None: a request's take, no tokens
    take_ms: list[float]  # the same in ms of refill


@dataclass(slots=True)
class View:
    """What this replica knows of a key's buckets: each limit's fill (1.0 = full)."""

    fills: list[float]
    seen_at: float  # monotonic, when Redis was asked
    unconfirmed: int = 0  # requests let through whose take Redis has not answered yet


class RateLimiter:
    """The proxy's rate limits: :meth:`ask` and :meth:`settle` before a request (or
    :meth:`admit`, both at once), :meth:`charge` after it."""

    def __init__(
        self, settings: RateLimitSettings, redis_url: str, metrics: ProxyMetrics, per_key: bool
    ) -> None:
        self.limits = configured_limits(settings)
        self.enabled = bool(self.limits)
        self.token_limits = [limit for limit in self.limits if limit.kind == "tokens"]
        self.per_key = per_key
        requests = [limit.capacity for limit in self.limits if limit.kind == "requests"]
        self.fast_max = max(1, requests[0] // 100) if requests else 1
        self._send_at = max(1, self.fast_max // 2)  # takes waiting that are sent at once
        self._take_ms = [limit.take * limit.unit_ms for limit in self.limits]
        self._take_tail = b"".join(bulk(limit.take) for limit in self.limits)
        self.budgets_closed = bool(self.token_limits) and settings.budgets_without_redis == "closed"
        self._local = LocalBuckets(self.limits)
        self._nothing_added = [0.0] * len(self.limits)
        self._token_indexes = [i for i, limit in enumerate(self.limits) if limit.kind == "tokens"]
        self._admit_args = [arg for limit in self.limits for arg in limit.args]
        load = (pack("SCRIPT", "LOAD", ADMIT_SCRIPT), pack("SCRIPT", "LOAD", ADD_SCRIPT))
        self._redis = RedisClient(redis_url, settings.timeout_s, setup=load)
        self._refused_count = {
            limit.name: metrics.ratelimit_refused.labels(limit.name) for limit in self.limits
        }
        self._overshoot = {
            limit.name: metrics.ratelimit_overshoot.labels(limit.name) for limit in self.limits
        }
        self._unavailable = {
            call: metrics.ratelimit_unavailable.labels(call) for call in ("admit", "charge")
        }
        # Per bucket; each bounded by the number of buckets: the configured keys (or one).
        self._keys: dict[str, list[str]] = {}
        self._admit_heads: dict[str, bytes] = {}  # the admission, packed but for what is added
        self._views: dict[str, View] = {}
        # bucket -> (monotonic end, the limit's index): no room for one unit until then
        self._refused: dict[str, tuple[float, int]] = {}
        self._added: dict[str, list[float]] = {}  # bucket -> ms to add to each limit, not sent
        self._takes: dict[str, int] = {}  # bucket -> requests let through among those
        self._unavailable_until = 0.0
        self._down = False  # Redis failed last time: say so once, and again when it is back
        self._send_timer: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None

    def bucket(self, key_hash: str | None) -> str:
        return key_hash if self.per_key and key_hash else ANONYMOUS

    # ---- admission ---------------------------------------------------------------------------
    async def admit(self, key_hash: str | None, reserve: int = 0) -> None:
        """Take one request, and ``reserve`` tokens, from the caller's bucket; 429 when a limit
        is reached."""
        admission = self.ask(key_hash, reserve)
        if admission is not None:
            await self.settle(admission)

    def ask(self, key_hash: str | None, reserve: int = 0) -> Admission | None:
        """429 at once for a key refused earlier whose wait is not over; None when the request
        need not wait for Redis (or was checked here: Redis failing); else the question, sent
        now, whose answer :meth:`settle` reads. ``reserve``: tokens the request may use."""
        bucket = self.bucket(key_hash)
        now = time.monotonic()
        units, take_ms = None, self._take_ms
        if reserve:
            units = [limit.taken(reserve) for limit in self.limits]
            take_ms = [n * limit.unit_ms for n, limit in zip(units, self.limits, strict=True)]
        refused = self._refused.get(bucket)
        if refused is not None:
            if now < refused[0]:
                end, index = refused
                limit = self.limits[index]
                if units is not None:  # it needs room for its reservation, not for one token
                    end += (units[index] - 1) * limit.unit_ms / 1000
                self._refused_count[limit.name].inc()
                raise refusal(limit, end - now, self.per_key)
            del self._refused[bucket]
        if now < self._unavailable_until:
            self._check_here(bucket, take_ms, now, redis_missed=True)
            return None
        view = self._views.get(bucket)
        if (
            view is not None
            and view.unconfirmed < self.fast_max
            and now - view.seen_at < FRESH_S
            and min(view.fills) >= FAST_FILL
            and (units is None or self._room_after(view, take_ms))
        ):
            view.unconfirmed += 1
            self._add(bucket, take_ms, view, takes=1)
            return None
        added, takes = self._added.pop(bucket, None), self._takes.pop(bucket, 0)
        try:
            waiter = self._redis.send(self._admit_command(bucket, units, added))
        except ConnectionError as exc:  # too many commands waiting: none of it was sent
            self._failed("admit", exc, count=0)
            self._later(bucket, added, takes)
            self._check_here(bucket, take_ms, now, redis_missed=True)
            return None
        return Admission(bucket, now, waiter, added, takes, units, take_ms)

    async def settle(self, admission: Admission) -> None:
        """Redis's answer to :meth:`ask`: return when admitted (here, when Redis failed), else
        429 (503: budgets closed while Redis failed)."""
        try:
            answer = await self._answer(admission)
        except _ERRORS as exc:
            self._confirm(admission.bucket, admission.takes)
            refused = isinstance(exc, _NOT_APPLIED)
            if refused:
                self._later(admission.bucket, admission.added, 0)
            else:
                self._charge_lost(admission.added)
            # A late reply on a live connection costs only its request; anything else is Redis
            # failing, left alone for a while.
            if not (isinstance(exc, TimeoutError) and admission.waiter is not None):
                self._failed("admit", exc, count=0)
            self._check_here(admission.bucket, admission.take_ms, time.monotonic(), refused)
            return
        self._observe(admission.bucket, admission.asked_at, answer[2:], admission.takes)
        if answer[0]:
            limit = self.limits[answer[0] - 1]
            self._refused_count[limit.name].inc()
            raise refusal(limit, answer[1] / 1000, self.per_key)

    async def _answer(self, admission: Admission) -> Any:
        try:
            if admission.waiter is not None:
                return await self._redis.reply(admission.waiter)
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        command = self._admit_command(admission.bucket, admission.units, admission.added)
        return await self._evalsha(ADMIT_SCRIPT, command)

    def _room_after(self, view: View, take_ms: list[float]) -> bool:
        """Whether every budget stays at least FAST_FILL full after this reservation."""
        return all(
            view.fills[i] - take_ms[i] / self.limits[i].room_ms >= FAST_FILL
            for i in self._token_indexes
        )

    def _check_here(
        self, bucket: str, take_ms: list[float], now: float, redis_missed: bool
    ) -> None:
        """Check a request Redis could not: 503 when budgets fail closed, else this replica's
        own buckets, 429 as Redis would. ``redis_missed``: Redis surely has not taken it, so
        its take goes to Redis once Redis answers again."""
        self._unavailable["admit"].inc()
        if self.budgets_closed:
            raise budgets_unavailable()
        view = self._views.get(bucket)
        seed = (view.fills, view.seen_at * 1000) if view else ([1.0] * len(self.limits), 0.0)
        refused = self._local.admit(bucket, take_ms, now * 1000, seed)
        if refused is not None:
            limit, wait_ms = refused
            self._refused_count[limit.name].inc()
            raise refusal(limit, wait_ms / 1000, self.per_key)
        if redis_missed:
            self._add(bucket, take_ms, view)

    def _observe(self, bucket: str, asked_at: float, untils: list[int], takes: int) -> None:
        """Redis's word on a bucket (ms until each limit is full): the next view, less what was
        added here since; a refusal remembered while a limit has no room; takes confirmed."""
        view = self._views.get(bucket)
        unconfirmed = max(0, view.unconfirmed - takes) if view is not None else 0
        added = self._added.get(bucket)
        fills, wait, empty = [], 0.0, -1
        for index, limit in enumerate(self.limits):
            if limit.take and untils[index] > limit.room_ms + limit.unit_ms / 2:
                self._overshoot[limit.name].inc()  # taken past the limit: let through here
            until = untils[index] + (added[index] if added else 0.0)
            fills.append(1.0 - until / limit.room_ms)
            short = until + limit.unit_ms - limit.room_ms
            if short > wait:
                wait, empty = short, index
        if empty >= 0:
            self._refused[bucket] = (asked_at + wait / 1000, empty)
        self._views[bucket] = View(fills, asked_at, unconfirmed)
        self._local.forget(bucket)  # Redis's word is newer than what this replica counted
        if self._down:
            self._down = False
            log.warning("rate limits checked in Redis again: Redis answers")

    def _confirm(self, bucket: str, takes: int) -> None:
        view = self._views.get(bucket)
        if takes and view is not None:
            view.unconfirmed = max(0, view.unconfirmed - takes)

    def _admit_command(
        self, bucket: str, units: list[int] | None, added: list[float] | None
    ) -> bytes:
        """The bucket's admission, taking ``units`` of each limit (None: one request's take)
        after adding ``added`` ms to each. Its head is packed once per bucket: the takes and
        what is added come last."""
        head = self._admit_heads.get(bucket)
        if head is None:
            keys = self._bucket_keys(bucket)
            zeros = [b"0"] * 2 * len(keys)
            command = pack("EVALSHA", ADMIT_SHA, len(keys), *keys, *self._admit_args, *zeros)
            head = self._admit_heads[bucket] = command[: -len(bulk(b"0")) * len(zeros)]
        takes = self._take_tail if units is None else b"".join(bulk(n) for n in units)
        added = added or self._nothing_added
        return head + takes + b"".join(bulk(repr(ms) if ms else b"0") for ms in added)

    def _bucket_keys(self, bucket: str) -> list[str]:
        keys = self._keys.get(bucket)
        if keys is None:
            keys = self._keys[bucket] = [bucket_key(bucket, limit) for limit in self.limits]
        return keys

    async def _evalsha(self, script: str, command: bytes) -> Any:
        """Run a script by its hash, connecting if need be; loaded again where Redis lost it
        (each new connection loads both, so only a SCRIPT FLUSH gets here)."""
        try:
            return await self._redis.call(command)
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self._redis.call(pack("SCRIPT", "LOAD", script))
        return await self._redis.call(command)

    # ---- takes and tokens sent later ---------------------------------------------------------
    def charge(self, key_hash: str | None, reserved: int, used: int) -> None:
        """Settle a request that reserved ``reserved`` tokens and used ``used``: the difference
        (a refund when negative) goes with the key's next question to Redis, or within
        SEND_AFTER_S; never on this request's path."""
        if not self.token_limits:
            return
        ms = [
            (used - limit.taken(reserved)) * limit.unit_ms if limit.kind == "tokens" else 0.0
            for limit in self.limits
        ]
        if any(ms):
            bucket = self.bucket(key_hash)
            self._add(bucket, ms, self._views.get(bucket))
            self._local.add(bucket, ms, time.monotonic() * 1000)

    def _add(self, bucket: str, ms: list[float], view: View | None, takes: int = 0) -> None:
        """Add to what goes to Redis next, and to this replica's view of the bucket."""
        added = self._added.get(bucket)
        if added is None:
            self._added[bucket] = list(ms)
        else:
            for index, value in enumerate(ms):
                added[index] += value
        if view is not None:
            for index, limit in enumerate(self.limits):
                view.fills[index] = min(1.0, view.fills[index] - ms[index] / limit.room_ms)
        if takes:
            self._takes[bucket] = taken = self._takes.get(bucket, 0) + takes
            if taken >= self._send_at:
                self.send_added()
                return
        if self._send_timer is None:
            loop = asyncio.get_running_loop()
            self._send_timer = loop.call_later(SEND_AFTER_S, self.send_added)

    def send_added(self) -> None:
        """Send what waits to be added, now, in one EVALSHA; its answer updates the views."""
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if not self._added or self._sender is not None:
            return  # a sender under way takes it next
        asked_at = time.monotonic()
        if asked_at < self._unavailable_until:  # Redis is left alone: sent once it is tried
            loop = asyncio.get_running_loop()
            self._send_timer = loop.call_later(self._unavailable_until - asked_at, self.send_added)
            return
        added, takes, command = self._take_added()
        try:
            waiter = self._redis.send(command)
        except ConnectionError as exc:  # too many commands waiting: not sent
            self._failed("admit", exc, count=0)
            self._put_back(added, takes)
            return
        if waiter is None:  # not connected: a task connects and sends
            self._sender = asyncio.get_running_loop().create_task(
                self._send_connecting(added, takes, command, asked_at)
            )
            return
        waiter.add_done_callback(lambda done: self._sent(added, takes, asked_at, done))

    def _take_added(self) -> tuple[dict[str, list[float]], dict[str, int], bytes]:
        added, takes = self._added, self._takes
        self._added, self._takes = {}, {}
        keys = [key for bucket in added for key in self._bucket_keys(bucket)]
        values = [repr(ms) for bucket_ms in added.values() for ms in bucket_ms]
        return added, takes, pack("EVALSHA", ADD_SHA, len(keys), *keys, *values)

    async def _send_connecting(
        self, added: dict[str, list[float]], takes: dict[str, int], command: bytes, at: float
    ) -> None:
        try:
            untils = await self._evalsha(ADD_SCRIPT, command)
        except _ERRORS as exc:
            self._lost(added, takes, exc)
        else:
            self._apply(added, takes, at, untils)
        finally:
            self._sender = None
        if self._added:
            self.send_added()

    def _sent(
        self, added: dict[str, list[float]], takes: dict[str, int], at: float, waiter: Any
    ) -> None:
        error = TimeoutError() if waiter.cancelled() else waiter.exception()
        if error is not None:
            self._lost(added, takes, error)
        else:
            self._apply(added, takes, at, waiter.result())

    def _apply(
        self, added: dict[str, list[float]], takes: dict[str, int], at: float, untils: list[int]
    ) -> None:
        width = len(self.limits)
        for position, bucket in enumerate(added):
            self._observe(bucket, at, untils[position * width :][:width], takes.get(bucket, 0))

    def _lost(self, added: dict[str, list[float]], takes: dict[str, int], exc: Any) -> None:
        """Takes and charges sent to a Redis that failed: those it surely did not apply (an
        error reply, a refused connection) wait to be sent again; the others, perhaps applied,
        are counted and no longer waited for."""
        self._failed("admit", exc, count=0)
        if isinstance(exc, _NOT_APPLIED):
            self._put_back(added, takes)
            return
        for bucket, count in takes.items():
            self._confirm(bucket, count)
        for bucket_added in added.values():
            self._charge_lost(bucket_added)

    def _put_back(self, added: dict[str, list[float]], takes: dict[str, int]) -> None:
        for bucket, bucket_added in added.items():
            self._later(bucket, bucket_added, takes.get(bucket, 0))

    def _later(self, bucket: str, added: list[float] | None, takes: int) -> None:
        """What was not sent to Redis waits for the next sending (takes already counted in the
        view stay unconfirmed until then)."""
        if added:
            self._add(bucket, added, None)
            if takes:
                self._takes[bucket] = self._takes.get(bucket, 0) + takes

    def _charge_lost(self, added: list[float] | None) -> None:
        if added and any(added):  # takes or settlements Redis may not have applied
            self._unavailable["charge"].inc()

    def _failed(self, call: str, exc: BaseException, count: int = 1) -> None:
        """Count what Redis did not check, then leave Redis be for a while."""
        if not self._down:
            self._down = True
            how = "token budgets refused" if self.budgets_closed else "limits checked per replica"
            log.warning("rate limits: Redis failed (%r); %s until it answers", exc, how)
        self._unavailable_until = time.monotonic() + UNAVAILABLE_BACKOFF_S
        if count:
            self._unavailable[call].inc(count)

    async def drain(self) -> None:
        """Send what waits to be added and wait for Redis's answer (tests, shutdown)."""
        self.send_added()
        while self._sender is not None:
            await asyncio.shield(self._sender)
        if time.monotonic() >= self._unavailable_until:
            # Replies come in order: once this one is here, every one before it was read.
            await self._redis.call(pack("PING"))

    async def close(self) -> None:
        with contextlib.suppress(*_ERRORS):  # counted already, or Redis gone at shutdown
            await self.drain()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        await self._redis.close()

"""Per-key rate limits and token budgets, enforced alike by every proxy replica through Redis.

Redis holds each key's buckets (proxy/buckets.py). A request whose key this replica knows little
about, or knows to be near a limit, waits for one EVALSHA (one round trip) that checks every
limit and takes from all of them or none; it is sent as soon as the caller is known and read
after the body is parsed, so Redis works while the proxy does. Near a limit every request waits
for Redis, so the limit is exact there.

Far from its limits a key does not wait: when this replica last heard from Redis (under FRESH_S
ago) that every limit of the key was at least FAST_FILL full, less what this replica added
since, the request is let through and its take is sent later with others, in one EVALSHA every
SEND_AFTER_S or after enough of them, together with the tokens of the answers (charged after
each answer). Its reply is the next view. At most ``fast_max`` requests of a key per replica
(1% of the burst, at least one) wait for Redis's word so; so when other replicas drain a key
from half full within that time, each replica serves at most that many requests past a limit,
counted in ``ratchet_proxy_ratelimit_overshoot_total``.

A key Redis found empty is refused here until it has refilled (nothing refills a bucket sooner),
so a key that keeps knocking costs Redis nothing. When Redis does not answer within
``timeout_s`` the request is served unchecked (fail open), counted, and Redis is left alone for
UNAVAILABLE_BACKOFF_S.

The bucket is the caller's key hash when the proxy requires keys. Without auth any key is
accepted, so a client could invent one per request: every caller then shares one bucket.
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
    Limit,
    bucket_key,
    configured_limits,
    refusal,
    total_tokens,
)
from proxy.metrics import ProxyMetrics
from proxy.resp import RedisClient, RedisReplyError, bulk, pack
from ratchet.settings import RateLimitSettings

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
# After Redis failed to answer, requests are served unchecked this long before trying again, so
# an outage costs each request nothing rather than a timeout.
UNAVAILABLE_BACKOFF_S = 1.0
# Takes and tokens wait at most this long to go to Redis together; other replicas see them late
# by as much.
SEND_AFTER_S = 0.05
# A request does not wait for Redis while this replica's view of its key is this fresh and every
# limit at least this full (see the module's docstring).
FRESH_S = 1.0
FAST_FILL = 0.5
_ERRORS = (RedisReplyError, OSError, TimeoutError)  # ConnectionError is an OSError


@dataclass(slots=True)
class Admission:
    """A request's question to Redis, asked by :meth:`RateLimiter.ask`."""

    bucket: str
    asked_at: float  # monotonic
    waiter: asyncio.Future[Any] | None  # the answer to come; None: not connected yet
    added: list[float] | None  # ms added to each limit before the check (takes, tokens)
    takes: int  # requests let through earlier whose takes go with it


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
        self._refused: dict[str, tuple[float, Limit]] = {}  # bucket -> (monotonic end, limit)
        self._added: dict[str, list[float]] = {}  # bucket -> ms to add to each limit, not sent
        self._takes: dict[str, int] = {}  # bucket -> requests let through among those
        self._unavailable_until = 0.0
        self._down = False  # Redis failed last time: say so once, and again when it is back
        self._send_timer: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None

    def bucket(self, key_hash: str | None) -> str:
        return key_hash if self.per_key and key_hash else ANONYMOUS

    # ---- admission ---------------------------------------------------------------------------
    async def admit(self, key_hash: str | None) -> None:
        """Take one request from the caller's bucket; 429 when a limit is reached."""
        admission = self.ask(key_hash)
        if admission is not None:
            await self.settle(admission)

    def ask(self, key_hash: str | None) -> Admission | None:
        """429 at once for a key refused earlier whose wait is not over; None when the request
        need not wait for Redis (or goes unchecked: Redis failing); else the question, sent
        now, whose answer :meth:`settle` reads."""
        bucket = self.bucket(key_hash)
        now = time.monotonic()
        refused = self._refused.get(bucket)
        if refused is not None:
            if now < refused[0]:
                self._refused_count[refused[1].name].inc()
                raise refusal(refused[1], refused[0] - now, self.per_key)
            del self._refused[bucket]
        if now < self._unavailable_until:
            self._unavailable["admit"].inc()
            return None
        view = self._views.get(bucket)
        if (
            view is not None
            and view.unconfirmed < self.fast_max
            and now - view.seen_at < FRESH_S
            and min(view.fills) >= FAST_FILL
        ):
            view.unconfirmed += 1
            self._add(bucket, self._take_ms, view, takes=1)
            return None
        added, takes = self._added.pop(bucket, None), self._takes.pop(bucket, 0)
        try:
            waiter = self._redis.send(self._admit_command(bucket, added))
        except ConnectionError as exc:  # too many commands waiting
            self._failed("admit", exc)
            self._charge_lost(added)
            return None
        return Admission(bucket, now, waiter, added, takes)

    async def settle(self, admission: Admission) -> None:
        """Redis's answer to :meth:`ask`: return when admitted (or unchecked), else 429."""
        try:
            answer = await self._answer(admission)
        except _ERRORS as exc:
            self._confirm(admission.bucket, admission.takes)
            self._failed("admit", exc)
            self._charge_lost(admission.added)
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
        command = self._admit_command(admission.bucket, admission.added)
        return await self._evalsha(ADMIT_SCRIPT, command)

    def _observe(self, bucket: str, asked_at: float, untils: list[int], takes: int) -> None:
        """Redis's word on a bucket (ms until each limit is full): the next view, less what was
        added here since; a refusal remembered while a limit has no room; takes confirmed."""
        view = self._views.get(bucket)
        unconfirmed = max(0, view.unconfirmed - takes) if view is not None else 0
        added = self._added.get(bucket)
        fills, wait, empty = [], 0.0, None
        for index, limit in enumerate(self.limits):
            if limit.take and untils[index] > limit.room_ms + limit.unit_ms / 2:
                self._overshoot[limit.name].inc()  # taken past the limit: let through here
            until = untils[index] + (added[index] if added else 0.0)
            fills.append(1.0 - until / limit.room_ms)
            short = until + limit.unit_ms - limit.room_ms
            if short > wait:
                wait, empty = short, limit
        if empty is not None:
            self._refused[bucket] = (asked_at + wait / 1000, empty)
        self._views[bucket] = View(fills, asked_at, unconfirmed)
        if self._down:
            self._down = False
            log.warning("rate limits checked again: Redis answers")

    def _confirm(self, bucket: str, takes: int) -> None:
        view = self._views.get(bucket)
        if takes and view is not None:
            view.unconfirmed = max(0, view.unconfirmed - takes)

    def _admit_command(self, bucket: str, added: list[float] | None) -> bytes:
        """The bucket's admission, adding ``added`` ms to each limit first. Its head is packed
        once per bucket: what is added comes last."""
        head = self._admit_heads.get(bucket)
        if head is None:
            keys = self._bucket_keys(bucket)
            zeros = [b"0"] * len(keys)
            command = pack("EVALSHA", ADMIT_SHA, len(keys), *keys, *self._admit_args, *zeros)
            head = self._admit_heads[bucket] = command[: -len(bulk(b"0")) * len(zeros)]
        added = added or self._nothing_added
        return head + b"".join(bulk(repr(ms) if ms else b"0") for ms in added)

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
    def charge(self, key_hash: str | None, answer: bytes) -> None:
        """Charge an answer's tokens to the caller's budgets: with its next question to Redis,
        or within SEND_AFTER_S; never on this request's path."""
        if not self.token_limits:
            return
        tokens = total_tokens(answer)
        if tokens > 0:
            bucket = self.bucket(key_hash)
            ms = [
                tokens * limit.unit_ms if limit.kind == "tokens" else 0.0 for limit in self.limits
            ]
            self._add(bucket, ms, self._views.get(bucket))

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
                view.fills[index] -= ms[index] / limit.room_ms
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
        added, takes, command = self._take_added()
        asked_at = time.monotonic()
        if asked_at < self._unavailable_until:
            self._lost(added, takes, None)
            return
        try:
            waiter = self._redis.send(command)
        except ConnectionError as exc:
            self._lost(added, takes, exc)
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
        """Takes and charges Redis never got (``exc``: why; None: Redis is being left alone):
        counted, and no longer waited for. Other replicas never see those requests."""
        requests = sum(takes.values())
        for bucket, count in takes.items():
            self._confirm(bucket, count)
        if exc is not None:
            self._failed("admit", exc, count=requests)
        else:
            self._unavailable["admit"].inc(requests)
        for bucket_added in added.values():
            self._charge_lost(bucket_added)

    def _charge_lost(self, added: list[float] | None) -> None:
        if added and any(added[i] for i in self._token_indexes):
            self._unavailable["charge"].inc()

    def _failed(self, call: str, exc: BaseException, count: int = 1) -> None:
        """Count what went unchecked, then leave Redis be for a while."""
        if not self._down:
            self._down = True
            log.warning("rate limits unchecked: Redis did not answer (%r); failing open", exc)
        self._unavailable_until = time.monotonic() + UNAVAILABLE_BACKOFF_S
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
        await self._redis.close()

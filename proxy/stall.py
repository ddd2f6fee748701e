"""Whether a replica's engine has stalled, asked for the requests that cannot tell by themselves.

A stream shows a stall itself: vLLM answers its headers at once, then nothing comes
(proxy/upstream.py waits for the body's first byte). A request that is not streamed gets its
headers only with the whole answer, so a long answer and a hung engine look the same from it.
So when such a request has waited ``deadline_s`` for its headers, the replica is asked: a
one-token streamed completion of the same served name (a *probe*), which must send its first
byte within ``deadline_s`` as any stream must. If it does, the engine is working and the request
waits on (asked again each ``deadline_s``); if not, every request waiting on that replica ends
as stalled. One probe at a time per replica, whatever the number of requests waiting.

The watch costs a request one timer (no task) unless it passes the deadline; the waiting
request is ended by cancelling its task, which :meth:`StallWatch.wait` turns into
:class:`Stalled`. That cancel is made one loop turn after the probe's verdict, and only if the
request still waits then: an answer that arrived in the same turn as the verdict has its task's
wake-up queued first, so it is returned, not thrown away as a stall (a cancel thrown into an
awaited coroutine that already holds its answer would lose it: the coroutine's own clean-up,
such as proxy/http1.py's pool closing the connection, must then be relied on).

A body can stall too, after its first byte: vLLM sends two events of a stream, then nothing
(:class:`GapWatch`). There the cost is per chunk, so no timer is set for it: a sweep every
quarter of the deadline looks at each followed body's pending wait for more (the reader's, with
nothing left to read); the same wait still pending ``deadline_s`` after a sweep first saw it
means vLLM sent nothing for that long while the proxy was reading. A reader that is not waiting
(busy writing to a client who stopped reading: back-pressure) has no pending wait and is never
counted. The overdue replica is probed as above, and only a failed probe ends its silent bodies
with :class:`Stalled`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
# (replica URL, served name) -> whether its engine sent a first byte in time
Probe = Callable[[str, str], Awaitable[bool]]


async def engine_answers(probe: Probe, url: str, key: str) -> bool:
    """The probe's verdict on the engine at ``url``: a probe that fails (our error, not the
    engine's silence) says nothing of it, so it counts as an answer."""
    try:
        return await probe(url, key)
    except Exception:
        log.exception("probing vLLM at %s failed", url)
        return True


class Timer(Protocol):
    def cancel(self) -> None: ...


# (delay in seconds, callback) -> its timer: the running loop's call_later unless a test's clock
Schedule = Callable[[float, Callable[[], None]], Timer]


class Stalled(Exception):
    """The replica's engine sent nothing within a deadline (the first byte's, or a gap in a
    body's), nor did a probe of it."""


class StallWatch:
    def __init__(self, deadline_s: float, probe: Probe, schedule: Schedule | None = None) -> None:
        self.deadline_s = deadline_s
        self.probe = probe
        self.schedule = schedule
        self.probes = 0  # sent, in all (for tests and logs)
        self._timers: dict[asyncio.Task[object], Timer] = {}
        self._waiting: dict[str, dict[asyncio.Task[object], str]] = {}  # url -> task -> key
        self._probing: dict[str, asyncio.Task[None]] = {}
        self._stalled: set[asyncio.Task[object]] = set()

    async def wait(self, url: str, key: str, answer: Awaitable[T]) -> T:
        """``answer`` (a request's headers from replica ``url``, for served name ``key``);
        Stalled if the replica is found stalled while it waits."""
        task: asyncio.Task[object] | None = asyncio.current_task()
        if task is None or not key:
            return await answer
        self._arm(task, url, key)
        try:
            return await answer
        except asyncio.CancelledError:
            if task in self._stalled:
                self._stalled.discard(task)
                task.uncancel()
                raise Stalled from None
            raise
        finally:
            timer = self._timers.pop(task, None)
            if timer is not None:
                timer.cancel()
            self._waiting.get(url, {}).pop(task, None)

    def waiting(self, url: str) -> int:
        """Requests past the deadline on ``url``, waiting on its probe."""
        return len(self._waiting.get(url, {}))

    def _arm(self, task: asyncio.Task[object], url: str, key: str) -> None:
        overdue = functools.partial(self._overdue, task, url, key)
        schedule = self.schedule or asyncio.get_running_loop().call_later
        self._timers[task] = schedule(self.deadline_s, overdue)

    def _overdue(self, task: asyncio.Task[object], url: str, key: str) -> None:
        if task not in self._timers:  # it finished as the timer fired
            return
        self._waiting.setdefault(url, {})[task] = key
        if url not in self._probing:
            self.probes += 1
            self._probing[url] = asyncio.get_running_loop().create_task(self._ask(url, key))

    async def _ask(self, url: str, key: str) -> None:
        try:
            alive = await engine_answers(self.probe, url, key)
        finally:
            self._probing.pop(url, None)
        waiting = self._waiting.pop(url, {})
        for task, task_key in waiting.items():
            if task not in self._timers:
                continue  # answered meanwhile
            if alive:
                self._arm(task, url, task_key)
            else:
                asyncio.get_running_loop().call_soon(self._end, task)
        if not alive and waiting:
            log.warning("vLLM at %s is stalled: a probe sent nothing in %s s", url, self.deadline_s)

    def _end(self, task: asyncio.Task[object]) -> None:
        """End a request found stalled, unless its answer came meanwhile."""
        if task in self._timers:
            self._stalled.add(task)
            task.cancel()

    def close(self) -> None:
        for probing in self._probing.values():
            probing.cancel()


# How often per deadline a GapWatch sweeps: a silent body is found at most a quarter late.
SWEEPS_PER_DEADLINE = 4


class Followed(Protocol):
    """What a GapWatch reads of a body (proxy/http1.py's UpstreamResponse)."""

    @property
    def awaited(self) -> object | None: ...

    def abort(self, error: BaseException) -> None: ...


class GapWatch:
    """Bodies (a stream's events, past its first byte) that go silent mid-way: the replica's
    engine is probed once one has sent nothing for ``deadline_s`` while its reader waited, and
    if the probe sends nothing within ``deadline_s`` either, every body silent that long on
    that replica is aborted with :class:`Stalled` (``on_stall`` told each replica's count).
    A replica that answers the probe is slow, not stalled: its bodies wait on, probed again
    after another ``deadline_s``. One probe at a time per replica."""

    def __init__(
        self,
        deadline_s: float,
        probe: Probe,
        on_stall: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s = deadline_s
        self.probe = probe
        self.on_stall = on_stall
        self.clock = clock
        self.probes = 0  # sent, in all
        self._followed: dict[Followed, tuple[str, str]] = {}  # body -> (replica URL, served name)
        self._silent: dict[Followed, tuple[object, float]] = {}  # body -> (its wait, seen since)
        self._probing: dict[str, asyncio.Task[None]] = {}

    def follow(self, body: Followed, url: str, key: str) -> None:
        if key:  # no served name, no probe to ask
            self._followed[body] = (url, key)

    def unfollow(self, body: Followed) -> None:
        if self._followed.pop(body, None) is not None:
            self._silent.pop(body, None)

    @property
    def followed(self) -> int:
        return len(self._followed)

    def sweep(self) -> None:
        """Note each followed body's pending wait; probe the replicas of those whose same wait
        has been pending ``deadline_s`` since a sweep first saw it."""
        now = self.clock()
        overdue: dict[str, str] = {}
        for body, (url, key) in self._followed.items():
            wait = body.awaited
            if wait is None:  # reading, or writing to its client: not vLLM's silence
                self._silent.pop(body, None)
                continue
            seen = self._silent.get(body)
            if seen is None or seen[0] is not wait:  # bytes came since the last sweep
                self._silent[body] = (wait, now)
            elif now - seen[1] >= self.deadline_s:
                overdue.setdefault(url, key)
        for url, key in overdue.items():
            if url not in self._probing:
                self.probes += 1
                self._probing[url] = asyncio.get_running_loop().create_task(self._ask(url, key))

    async def run(self) -> None:
        """Sweep until cancelled."""
        while True:
            await asyncio.sleep(self.deadline_s / SWEEPS_PER_DEADLINE)
            self.sweep()

    async def _ask(self, url: str, key: str) -> None:
        try:
            alive = await engine_answers(self.probe, url, key)
        finally:
            self._probing.pop(url, None)
        now = self.clock()
        ended = 0
        for body, (body_url, _key) in list(self._followed.items()):
            seen = self._silent.get(body)
            if body_url != url or seen is None or seen[0] is not body.awaited:
                continue  # another replica's, or bytes came meanwhile
            if alive:
                self._silent[body] = (seen[0], now)  # waited on for another deadline
            elif now - seen[1] >= self.deadline_s:
                self.unfollow(body)
                body.abort(Stalled(f"the model server sent nothing for {self.deadline_s} s"))
                ended += 1
        if ended:
            log.warning(
                "vLLM at %s is stalled: %d answers sent nothing for %s s, nor did a probe",
                url,
                ended,
                self.deadline_s,
            )
            if self.on_stall is not None:
                self.on_stall(url, ended)

    async def close(self) -> None:
        """Cancel the probes out, and wait for them to end: none is left pending at shutdown."""
        probing = list(self._probing.values())
        for task in probing:
            task.cancel()
        await asyncio.gather(*probing, return_exceptions=True)

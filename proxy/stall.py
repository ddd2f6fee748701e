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
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
# (replica URL, served name) -> whether its engine sent a first byte in time
Probe = Callable[[str, str], Awaitable[bool]]


class Timer(Protocol):
    def cancel(self) -> None: ...


# (delay in seconds, callback) -> its timer: the running loop's call_later unless a test's clock
Schedule = Callable[[float, Callable[[], None]], Timer]


class Stalled(Exception):
    """The replica's engine sent nothing within the first-byte deadline."""


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
            alive = await self.probe(url, key)
        except Exception:  # a probe that fails says nothing of the engine
            log.exception("probing vLLM at %s failed", url)
            alive = True
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

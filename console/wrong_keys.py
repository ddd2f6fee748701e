"""The pace of answers to wrong admin keys: many guessers in parallel as slow as one.

console/sessions.py gives each wrong key its own delay (per address, doubling); alone, that slows
a guesser who waits for each answer but not one who sends many at once, since each answer waits
only its own delay. Here every wrong key's answer also waits its turn in one token bucket for the
whole console (GCRA: a theoretical arrival time moved on by :data:`INTERVAL_S` per wrong key,
:data:`BURST` allowed at once), so wrong keys are answered at most one per :data:`INTERVAL_S`
whatever their number in parallel. The right key never reaches it (console/auth.py checks the key
first and leaves a delay only on a wrong one).

Waiting answers hold connections, and uvicorn refuses new ones past console/service.py's
``MAX_CONCURRENCY`` before any route runs, so at most :data:`QUEUE` wait at once, leaving the other
slots to the admins; a wrong key past that is answered 429 with ``Retry-After`` (its turn was not
taken). That answer still tells a client who ignores Retry-After that its key was wrong, as any
prompt answer must while the right key gets in at once: the bucket paces guessers who wait for
their answers; what stops one who floods is the key's length (docs/security.md, "The console").
The bucket is per console process; the per-address counts are in Redis.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

INTERVAL_S = 2.0  # one wrong key answered per 2 s overall, past the burst
BURST = 10  # wrong keys answered without waiting their turn (an admin's typos)
QUEUE = 16  # a quarter of console/service.py's MAX_CONCURRENCY: the last waits QUEUE x 2 s


class WrongKeys:
    """The console's one bucket of wrong-key answers, and how many wait in it now."""

    def __init__(
        self,
        interval_s: float | None = None,
        burst: int | None = None,
        queue: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The module's values when the console starts (None), so a test can shorten them.
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        burst = BURST if burst is None else burst
        self.tolerance_s = (burst - 1) * self.interval_s  # how far ahead of now it may run
        self.queue = QUEUE if queue is None else queue
        self.clock = clock
        self.arrival = -math.inf  # GCRA's theoretical arrival time of the next wrong key
        self.waiting = 0

    def turn(self, delay_s: float) -> float | None:
        """Seconds a wrong key's answer waits: its own ``delay_s`` or its turn, whichever is
        later; None when :data:`QUEUE` already wait (its turn is not taken)."""
        if self.waiting >= self.queue:
            return None
        now = self.clock()
        start = max(self.arrival, now)
        self.arrival = start + self.interval_s
        return max(delay_s, start - self.tolerance_s - now, 0.0)

    def retry_after_s(self) -> int:
        """Whole seconds until the next wrong key would be taken without waiting (at least 1)."""
        free_at = self.arrival - self.tolerance_s
        return max(1, math.ceil(free_at - self.clock()))

    async def wait(self, seconds: float) -> None:
        """Hold an answer ``seconds``, counted as waiting meanwhile."""
        if seconds <= 0:
            return
        self.waiting += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.waiting -= 1

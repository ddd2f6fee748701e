"""The proxy's side of traffic logging: hand each exchange to the log worker process, never wait.

:meth:`TrafficLog.submit_exchange` writes one frame into the worker's stdin pipe through an
asyncio transport, which buffers instead of blocking; nothing else happens on the request path.
The worker (proxy/log/worker.py) builds the records, produces them to Kafka or spools them to
disk, and reports its counters back a few times a second; they are what ``/metrics`` and
``/readyz`` show.

If the worker dies, frames wait here (up to ``queue_size``) while a new one starts. Each frame
written to a worker is kept here until the worker reports it received, which it does only once
the frame's records are durable in its journal (proxy/log/journal.py); the frames a dead worker
never confirmed go to its replacement first, and the replacement spools what the journal holds.
A frame two workers in a row died holding is dropped and counted: it may be what kills them.

A worker can also hang without dying. A watchdog kills one that holds frames and has confirmed
none for ``stuck_after_s`` (proxy.log_worker_stuck_s); the frame it had in hand (the first it had
not reported handled) is dropped and counted as ``stuck``, the rest go to the next worker.

What waits on this side (the batch, the backlog and the pipe transport's write buffer) is bounded
in bytes too, by ``max_bytes`` (proxy.log_queue_bytes): frames carry whole requests and answers,
so a count alone would not bound the proxy's memory while the worker is slow or restarting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from proxy.log.worker import CONFIG, EXCHANGE, RECORD, WorkerConfig, encode_frame
from ratchet.records import Record

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0
# The worker's counters that carry on across restarts (a new worker counts from zero).
WORKER_TOTALS = (
    "sent",
    "spooled",
    "replayed",
    "dead_lettered",
    "spool_full",
    "recovered",
    "redact_over_budget",
)
# Handed to this many workers at most: a frame that every one of them died holding is dropped.
MAX_FRAME_ATTEMPTS = 2
# Frames are written to the pipe this long after the first of them, together: the write (and
# the worker it wakes up) then never sits between vLLM's answer and the client, and the worker
# wakes once per batch instead of once per request.
FLUSH_AFTER_S = 0.005
DEFAULT_MAX_BYTES = 128 * 1024 * 1024


class TrafficLog:
    """Counters mirror the worker's RecordProducer (``sent``, ``spooled``, ``replayed``,
    ``dead_lettered``, ``dropped``, ``spool_pending``, ``connected``), plus what this side
    dropped itself."""

    def __init__(
        self,
        config: WorkerConfig,
        on_tokens: Callable[[str, str, str, str, int], None] | None = None,
        on_state: Callable[[bool], None] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.config = config
        self.queue_size = config.queue_size
        self.max_bytes = max_bytes
        self.on_tokens = on_tokens
        self.on_state = on_state
        self.sent = self.spooled = self.replayed = self.dead_lettered = self.spool_pending = 0
        self.recovered = 0  # records a killed worker journaled, spooled by the next
        self.resent = 0  # frames a killed worker never confirmed, handed to the next
        self.spool_full = 0  # of the dropped: records the worker's spool had no room for
        # Records logged with their strings replaced whole, past the redaction budget.
        self.redact_over_budget = 0
        self.stuck = 0  # of the dropped: frames a worker was stuck on when it was replaced
        self.stuck_after_s = config.stuck_after_s
        self.connected = False
        self.restarts = 0
        self._dropped_here = 0
        self._worker_dropped = 0  # by every worker so far, the running one included
        self._dropped_by_dead = 0  # what earlier workers dropped
        self._written = 0  # frames written to the running worker
        self._received = 0  # of those, read by it (as of its last report)
        self._read = 0  # of those, handled by it, durable or not (as of its last report)
        # When the running worker last confirmed a frame, or was handed one while it held none.
        self._progress_at = 0.0
        self._killed_stuck = False  # the running worker was killed by the watchdog
        self._worker_depth = 0
        self._worker_totals = dict.fromkeys(WORKER_TOTALS, 0)
        # Frames waiting for a worker, with how many workers each was handed to before.
        self._backlog: deque[tuple[bytes, int]] = deque()
        # Frames written to the running worker and not yet reported received, oldest first,
        # with how many workers each was handed to.
        self._unconfirmed: deque[tuple[bytes, int]] = deque()
        self._unconfirmed_bytes = 0
        self._batch: list[bytes] = []  # frames waiting for the next flush
        self._waiting_bytes = 0  # in _batch and _backlog
        self._flush_at: asyncio.TimerHandle | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False

    # ---- request path ------------------------------------------------------------------------
    def submit_exchange(self, meta: bytes, request: bytes, answer: bytes) -> bool:
        """Queue one exchange (meta: a proxy.log.worker.ExchangeMeta as JSON); never blocks."""
        return self._submit(encode_frame(EXCHANGE, meta, request, answer))

    def submit(self, record: Record, key: str | None) -> bool:
        """Queue a finished record (feedback); False, and a counted drop, when full."""
        meta = orjson.dumps({"topic": record.TOPIC, "key": key})
        return self._submit(encode_frame(RECORD, meta, b"", record.to_json()))

    def _submit(self, frame: bytes) -> bool:
        if (
            self._closing
            or self.depth >= self.queue_size
            or self.buffered_bytes + len(frame) > self.max_bytes
        ):
            self._dropped_here += 1
            return False
        self._batch.append(frame)
        self._waiting_bytes += len(frame)
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self._flush)
        return True

    def _flush(self) -> None:
        self._flush_at = None
        frames, self._batch = self._batch, []
        process = self._process
        if process is None or process.stdin is None or process.stdin.is_closing():
            self._backlog.extend((frame, 0) for frame in frames)
            return
        self._waiting_bytes -= sum(map(len, frames))
        process.stdin.write(b"".join(frames))  # the transport buffers what the pipe can't take
        for frame in frames:
            self._handed(frame, 1)

    # ---- counters ----------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Records accepted and not yet sent or spooled: in the pipe, here, or in the worker."""
        waiting_here = len(self._batch) + len(self._backlog)
        return waiting_here + (self._written - self._received) + self._worker_depth

    def _handed(self, frame: bytes, attempt: int) -> None:
        """``frame`` was written to the running worker; keep it until confirmed."""
        if not self._unconfirmed:  # it held nothing: its time to confirm starts now
            self._progress_at = time.monotonic()
        self._unconfirmed.append((frame, attempt))
        self._unconfirmed_bytes += len(frame)
        self._written += 1

    def _confirm(self, received: int) -> None:
        if received > self._received:
            self._progress_at = time.monotonic()
        for _ in range(min(received - self._received, len(self._unconfirmed))):
            frame, _ = self._unconfirmed.popleft()
            self._unconfirmed_bytes -= len(frame)
        self._received = received

    @property
    def buffered_bytes(self) -> int:
        """Bytes of frames held in this process: not yet flushed, waiting for a worker, or
        written to it and not yet confirmed (which covers the pipe transport's buffer)."""
        process = self._process
        stdin = process.stdin if process is not None else None
        in_pipe = stdin.transport.get_write_buffer_size() if stdin is not None else 0
        return self._waiting_bytes + max(in_pipe, self._unconfirmed_bytes)

    @property
    def dropped(self) -> int:
        return self._dropped_here + self._dropped_by_dead + self._worker_dropped

    # ---- worker lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self._spawn()
        self._watcher = asyncio.create_task(self._watch(), name="log-worker")
        self._watchdog = asyncio.create_task(self._guard(), name="log-worker-watchdog")

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking frames; the worker sends or spools all it holds, then exits."""
        self._closing = True
        if self._watchdog is not None:  # from here on, close's own timeout applies
            self._watchdog.cancel()
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._flush()
        if self._watcher is None:
            return
        process = self._process
        if process is not None and process.stdin is not None:
            process.stdin.close()
            with contextlib.suppress(Exception):
                await process.stdin.wait_closed()
        try:
            await asyncio.wait_for(asyncio.shield(self._watcher), timeout_s)
        except TimeoutError:
            log.error("log worker did not finish in %.0fs; killing it", timeout_s)
            if process is not None and process.returncode is None:
                process.kill()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._backlog:  # no worker ever took these
            self._dropped_here += len(self._backlog)
            log.error("%d records never reached a log worker; dropped", len(self._backlog))
            self._backlog.clear()
            self._waiting_bytes = 0

    async def _spawn(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.log.worker",
            str(os.getpid()),  # it dies with this process (proxy/log/worker.py die_with_parent)
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # stops when we say so, not on a signal to our group
        )
        self._written = self._received = self._read = self._worker_depth = 0
        self._worker_totals = dict.fromkeys(WORKER_TOTALS, 0)
        self._progress_at = time.monotonic()  # starting counts as holding what it is handed
        self._killed_stuck = False
        assert self._process.stdin is not None
        self._process.stdin.write(encode_frame(CONFIG, b"", b"", pickle.dumps(self.config)))
        while self._backlog:
            frame, attempts = self._backlog.popleft()
            self._waiting_bytes -= len(frame)
            self._process.stdin.write(frame)
            self._handed(frame, attempts + 1)

    async def _guard(self) -> None:
        """The watchdog: kill a worker that is alive but stuck (see :meth:`stalled`); the watcher
        then replaces it like one that died."""
        while True:
            await asyncio.sleep(min(1.0, self.stuck_after_s / 4))
            process = self._process
            if process is None or process.returncode is not None or not self.stalled():
                continue
            log.error(
                "log worker %d confirmed none of the %d frames it holds in %.0fs; replacing it",
                process.pid,
                len(self._unconfirmed),
                time.monotonic() - self._progress_at,
            )
            self._killed_stuck = True
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(Exception):
                await process.wait()

    def stalled(self) -> bool:
        """The running worker holds frames and has confirmed none for ``stuck_after_s``."""
        return (
            not self._closing
            and not self._killed_stuck
            and bool(self._unconfirmed)
            and time.monotonic() - self._progress_at > self.stuck_after_s
        )

    def _drop_stuck_frame(self) -> None:
        """Drop the frame a stuck worker had in hand, the first it had not reported handled, so
        that it cannot stop the next worker too. Those before it are in its journal (and resent);
        those after it it never read: they go to the next worker as if never handed."""
        if not self._unconfirmed:
            return
        index = min(max(self._read - self._received, 0), len(self._unconfirmed) - 1)
        frame, _ = self._unconfirmed[index]
        del self._unconfirmed[index]
        self._unconfirmed_bytes -= len(frame)
        for later in range(index, len(self._unconfirmed)):  # unread: no attempt charged
            after, attempt = self._unconfirmed[later]
            self._unconfirmed[later] = (after, attempt - 1)
        self.stuck += 1
        self._dropped_by_dead += 1
        log.error("dropped the frame (%d bytes) the stuck log worker was handling", len(frame))

    def _take_back_unconfirmed(self) -> int:
        """The dead worker's unconfirmed frames go first to the next one; return how many were
        dropped instead, for having been handed to MAX_FRAME_ATTEMPTS workers already."""
        dropped = 0
        for frame, attempt in reversed(self._unconfirmed):
            if attempt >= MAX_FRAME_ATTEMPTS:
                dropped += 1
                continue
            self._backlog.appendleft((frame, attempt))
            self._waiting_bytes += len(frame)
            self.resent += 1
        self._unconfirmed.clear()
        self._unconfirmed_bytes = 0
        return dropped

    async def _watch(self) -> None:
        """Read the worker's reports; when it dies uninvited, count its loss and start another."""
        while True:
            process = self._process
            assert process is not None and process.stdout is not None
            while line := await process.stdout.readline():
                self._apply(orjson.loads(line))
            code = await process.wait()
            self._process = None  # frames wait in the backlog from here on
            self._dropped_by_dead += self._worker_dropped
            self._worker_dropped = 0
            # What it held is unconfirmed here (taken back below) or in its journal.
            self._written = self._received = self._worker_depth = 0
            if self._closing and code == 0:
                return
            if self._closing:
                # No worker comes after it now; what it journaled is spooled at the next start.
                lost = len(self._unconfirmed)
                self._dropped_by_dead += lost
                self._unconfirmed.clear()
                self._unconfirmed_bytes = 0
                log.error("log worker exited with %s while stopping; %d frames lost", code, lost)
                return
            if self._killed_stuck:
                self._drop_stuck_frame()
            unconfirmed = len(self._unconfirmed)
            lost = self._take_back_unconfirmed()
            self._dropped_by_dead += lost
            log.error(
                "log worker exited with %s; %d frames it had not made durable go to the next one "
                "(%d dropped after two deaths); restarting",
                code,
                unconfirmed - lost,
                lost,
            )
            self._set_state(False)
            self.restarts += 1
            await asyncio.sleep(RESTART_DELAY_S)
            await self._spawn()
            if self._closing:  # close() came while no worker ran: this one takes what waited
                assert self._process is not None and self._process.stdin is not None
                self._process.stdin.close()

    def _apply(self, report: dict[str, Any]) -> None:
        self._confirm(report["received"])
        self._read = report["read"]
        self._worker_depth = report["depth"]
        # A restarted worker counts from zero; these totals carry on across workers.
        for name, before in self._worker_totals.items():
            setattr(self, name, getattr(self, name) + report[name] - before)
            self._worker_totals[name] = report[name]
        self._worker_dropped = report["dropped"]
        self.spool_pending = report["spool_pending"]
        self._set_state(bool(report["connected"]))
        if self.on_tokens:
            for alias, version, arm, direction, n in report["tokens"]:
                self.on_tokens(alias, version, arm, direction, n)

    def _set_state(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            if self.on_state:
                self.on_state(connected)

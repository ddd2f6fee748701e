"""The log worker's write-ahead log: what it accepted survives a SIGKILL or an OOM kill.

Every record the worker makes is appended here before it is queued for Kafka. The worker fsyncs
the journal in batches (each report), and only then reports the frames it came from as received:
the proxy keeps each frame until then and hands the frames a dead worker never confirmed to its
replacement. A record leaves the journal when it is settled: acknowledged by Kafka,
dead-lettered, written to the spool, or counted as dropped. A segment is deleted once every
record in it is settled and the journal writes elsewhere; the one being written is emptied
whenever everything in it is settled, so a worker killed while idle leaves nothing to resend.

A worker that starts moves what an earlier one left here into the spool, which the producer
replays before anything new. A record settled just before a kill may be delivered twice;
consumers de-duplicate by key, as for every other at-least-once path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from proxy.log.spool import OutgoingRecord, encode_line, read_segment
from ratchet.durable import fsync_dir, open_private_append, private_dir

log = logging.getLogger(__name__)

PREFIX = "journal-"


class Journal:
    """Append, :meth:`sync`, :meth:`settle`; :meth:`take_leftovers` once at start.

    Thread-safe: the worker appends and syncs, the producer thread settles.
    """

    def __init__(self, directory: Path, segment_bytes: int = 1024 * 1024) -> None:
        self.directory = directory
        private_dir(self.directory)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._file: Any = None
        self._number = -1  # the segment being written
        self._size = 0
        self._dirty = False
        # Per segment number: records appended and not yet settled.
        self._unsettled: dict[int, int] = {}

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob(f"{PREFIX}*.jsonl"))

    def take_leftovers(self) -> list[tuple[Path, list[OutgoingRecord]]]:
        """What an earlier worker journaled and never settled, oldest first. Call before the
        first append; delete each with :meth:`discard` once it is safe elsewhere."""
        return [(path, read_segment(path)) for path in self.segments()]

    def discard(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        fsync_dir(self.directory)

    def append(self, record: OutgoingRecord) -> None:
        """Write ``record`` (not yet durable: see :meth:`sync`) and tag it with its segment."""
        line = encode_line(record)
        with self._lock:
            if self._file is None or self._size >= self.segment_bytes:
                self._roll()
            self._file.write(line)
            self._size += len(line)
            self._dirty = True
            record.segment = self._number
            self._unsettled[self._number] = self._unsettled.get(self._number, 0) + 1

    def sync(self) -> None:
        """Make every record appended so far durable."""
        with self._lock:
            if self._file is not None and self._dirty:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._dirty = False

    def settle(self, records: list[OutgoingRecord]) -> None:
        """These records are safe elsewhere (or counted lost): forget them. Settling a record
        twice (a stuck send that lands after close() spooled its batch) changes nothing."""
        with self._lock:
            for record in records:
                if record.segment in self._unsettled:
                    self._unsettled[record.segment] -= 1
                record.segment = None
            for number in [n for n, left in self._unsettled.items() if left <= 0]:
                if number != self._number:
                    self._delete(number)
                elif self._size:
                    # Emptied without an fsync: if a crash undoes it, records are sent twice.
                    self._file.flush()
                    self._file.truncate(0)
                    self._size = 0
                    self._dirty = False

    @property
    def unsettled(self) -> int:
        with self._lock:
            return sum(self._unsettled.values())

    def close(self) -> None:
        """At a clean stop everything is settled: nothing is left for the next worker."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            for number in [n for n, left in self._unsettled.items() if left <= 0]:
                self._delete(number)
            if any(left > 0 for left in self._unsettled.values()):
                log.error("%d journaled records unsettled at stop", sum(self._unsettled.values()))

    def _path(self, number: int) -> Path:
        return self.directory / f"{PREFIX}{number:09d}.jsonl"

    def _roll(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self._unsettled.get(self._number, 0) <= 0:
                self._delete(self._number)
        existing = self.segments()
        last = int(existing[-1].stem.removeprefix(PREFIX)) if existing else -1
        self._number = max(last, self._number) + 1
        self._file = open_private_append(self._path(self._number))
        self._size = 0
        self._unsettled[self._number] = 0
        fsync_dir(self.directory)  # the segment's name survives a crash with its records

    def _delete(self, number: int) -> None:
        self._unsettled.pop(number, None)
        self._path(number).unlink(missing_ok=True)

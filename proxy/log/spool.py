"""An append-only, line-per-record spool on disk for records waiting for the broker."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ratchet.durable import fsync_dir, open_private_append, private_dir

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OutgoingRecord:
    topic: str
    key: bytes | None
    value: bytes
    segment: int | None = None  # the journal segment holding it (proxy/log/journal.py)


def encode_line(record: OutgoingRecord) -> bytes:
    """One record as one line of a spool or journal segment."""
    line = orjson.dumps(
        {
            "topic": record.topic,
            "key": record.key.decode() if record.key is not None else None,
            "value": record.value.decode(),
        }
    )
    return line + b"\n"


def read_segment(path: Path) -> list[OutgoingRecord]:
    """A segment's records, in order. Only a crash mid-write leaves a torn last line; it was
    never durable, so nobody was told it was accepted, and skipping it loses nothing."""
    records = []
    with path.open("rb") as fh:
        for line in fh:
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.warning("skipping a torn line in %s", path.name)
                continue
            key = item["key"].encode() if item["key"] is not None else None
            records.append(OutgoingRecord(item["topic"], key, item["value"].encode()))
    return records


class Spool:
    """An append-only, line-per-record file of records waiting for the broker.

    Segments are numbered files; the writer appends to the newest, replay reads the oldest first
    and deletes a segment only after every record in it was acknowledged. At most ``max_bytes``
    are kept: past it, :meth:`append` writes no more and the newest records are the caller's to
    count as dropped, so a long outage keeps the oldest records and never fills the volume.
    """

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = 16 * 1024 * 1024,
        max_bytes: int | None = None,
    ) -> None:
        self.directory = directory
        private_dir(self.directory)
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.bytes = sum(path.stat().st_size for path in self.segments())
        self._file: Any = None
        self._file_path: Path | None = None
        # Records on disk not yet replayed (a gauge for dashboards); counted once at start.
        self.pending = len(self)

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob("spool-*.jsonl"))

    def __len__(self) -> int:
        count = 0
        for path in self.segments():
            with path.open("rb") as fh:
                count += sum(1 for _ in fh)
        return count

    def is_empty(self) -> bool:
        # A counter, not a directory scan: this is asked for every batch the producer sends.
        return self.pending == 0

    def append(self, records: list[OutgoingRecord]) -> int:
        """Write records in order, durably, until ``max_bytes`` would be passed; return how many
        were written (the rest, the newest, were not)."""
        if self._file is None or self._file.tell() >= self.segment_bytes:
            self._roll()
        written = 0
        for record in records:
            line = encode_line(record)
            if self.max_bytes is not None and self.bytes + len(line) > self.max_bytes:
                break
            self._file.write(line)
            self.bytes += len(line)
            written += 1
        self._file.flush()
        os.fsync(self._file.fileno())
        self.pending += written
        return written

    def remove(self, path: Path, records: int) -> None:
        """A replayed segment, acknowledged by Kafka: gone from disk and from the counts."""
        size = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)
        fsync_dir(self.directory)
        self.bytes = max(0, self.bytes - size)
        self.pending = max(0, self.pending - records)

    def _roll(self) -> None:
        self.close()
        existing = self.segments()
        number = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self._file_path = self.directory / f"spool-{number:09d}.jsonl"
        self._file = open_private_append(self._file_path)
        fsync_dir(self.directory)  # the new segment's name survives a crash with its records

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def drain(self) -> Iterator[tuple[Path, list[OutgoingRecord]]]:
        """Yield each segment's records, oldest first. The writer moves to a new segment first."""
        self.close()
        for path in self.segments():
            yield path, read_segment(path)
        if not self.segments():
            self.pending = 0  # torn lines were counted at start but never replayed

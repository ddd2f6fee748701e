"""An append-only, line-per-record spool on disk for records waiting for the broker."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OutgoingRecord:
    topic: str
    key: bytes | None
    value: bytes


class Spool:
    """An append-only, line-per-record file of records waiting for the broker.

    Segments are numbered files; the writer appends to the newest, replay reads the oldest first
    and deletes a segment only after every record in it was acknowledged.
    """

    def __init__(self, directory: Path, segment_bytes: int = 16 * 1024 * 1024) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
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

    def append(self, records: list[OutgoingRecord]) -> None:
        if self._file is None or self._file.tell() >= self.segment_bytes:
            self._roll()
        for record in records:
            line = orjson.dumps(
                {
                    "topic": record.topic,
                    "key": record.key.decode() if record.key is not None else None,
                    "value": record.value.decode(),
                }
            )
            self._file.write(line + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.pending += len(records)

    def _roll(self) -> None:
        self.close()
        existing = self.segments()
        number = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self._file_path = self.directory / f"spool-{number:09d}.jsonl"
        self._file = self._file_path.open("ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def drain(self) -> Iterator[tuple[Path, list[OutgoingRecord]]]:
        """Yield each segment's records, oldest first. The writer moves to a new segment first."""
        self.close()
        for path in self.segments():
            records = []
            with path.open("rb") as fh:
                for line in fh:
                    try:
                        item = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        # Only a crash mid-write leaves a torn last line; it was never accepted
                        # as durable, so skipping it loses nothing that was acknowledged.
                        log.warning("skipping a torn line in %s", path.name)
                        continue
                    key = item["key"].encode() if item["key"] is not None else None
                    records.append(OutgoingRecord(item["topic"], key, item["value"].encode()))
            yield path, records
        if not self.segments():
            self.pending = 0  # torn lines were counted at start but never replayed

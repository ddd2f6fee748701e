"""The log worker's write-ahead journal, on its own: what is appended and synced survives until
it is settled, a finished segment is deleted, and a new worker finds what an old one left."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from proxy.log.journal import Journal
from proxy.log.spool import OutgoingRecord, Spool


def record(i: int) -> OutgoingRecord:
    return OutgoingRecord("ratchet.traffic", f"k{i}".encode(), b'{"i":%d}' % i)


def test_unsettled_records_are_left_for_the_next_worker_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=64)  # a few records per segment
    records = [record(i) for i in range(10)]
    for r in records:
        journal.append(r)
    journal.sync()
    journal.settle(records[:3])
    assert journal.unsettled == 7
    # Killed here: no close(). The next worker reads what is left, oldest first.
    left = Journal(tmp_path).take_leftovers()
    keys = [r.key for _, segment in left for r in segment]
    assert keys[-7:] == [f"k{i}".encode() for i in range(3, 10)]
    assert set(keys) <= {f"k{i}".encode() for i in range(10)}


def test_a_settled_segment_is_deleted_and_the_current_one_emptied(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=150)  # three records of ~60 bytes
    first = [record(i) for i in range(3)]
    for r in first:
        journal.append(r)
    fourth = record(3)
    journal.append(fourth)  # the first segment is full: a second one begins
    assert len(journal.segments()) == 2
    journal.settle(first)
    [current] = journal.segments()
    assert current.name == "journal-000000001.jsonl"
    journal.settle([fourth])
    journal.sync()
    assert current.stat().st_size == 0  # a worker killed now leaves nothing to send again


def test_settling_twice_changes_nothing_and_close_leaves_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=64)
    records = [record(i) for i in range(6)]
    for r in records:
        journal.append(r)
    journal.settle(records[:2])
    journal.settle(records[:2])  # a stuck send landing after close() spooled its batch
    assert journal.unsettled == 4
    journal.settle(records[2:])
    journal.close()
    assert journal.segments() == []


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(record(1))
    journal.sync()
    [path] = journal.segments()
    with path.open("ab") as fh:
        fh.write(b'{"topic": "ratchet.traffic", "key"')  # killed mid-write
    [(_, records)] = Journal(tmp_path).take_leftovers()
    assert [r.key for r in records] == [b"k1"]


def test_the_journal_and_the_spool_are_readable_by_their_user_alone(tmp_path: Path) -> None:
    """They hold users' prompts and answers waiting for Kafka: mode 0600 files in a 0700 folder
    whatever the umask (audit M-7)."""
    old = os.umask(0o022)
    try:
        journal = Journal(tmp_path / "journal")
        journal.append(record(0))
        journal.sync()
        spool = Spool(tmp_path / "spool")
        spool.append([record(1)])
        spool.close()
    finally:
        os.umask(old)
    for folder in ("journal", "spool"):
        assert stat.S_IMODE((tmp_path / folder).stat().st_mode) == 0o700, folder
        files = list((tmp_path / folder).iterdir())
        assert files and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}, folder

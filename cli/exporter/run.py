"""An export streamed out of Kafka (or, for gate pairs, Redis) into shards, resumably.

The first run fixes what the export holds: every partition's end offset at that moment (later
records are not in it) and the ``--since`` bound. Rows are written in shards of ``shard_rows``,
each to a temporary name renamed into place; after each shard the state file
(``ratchet-export.json``) records the next offset of every partition. A run that stops, however
it stops, is continued by the same command: it starts from the recorded offsets and rewrites any
shard written after them, so no row is lost or written twice. Kafka is read with assigned
partitions and no consumer group: an export commits nothing and moves no service's offsets.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import redis

from cli.exporter.rows import (
    KINDS,
    SCHEMAS,
    Kind,
    dataset_card,
    group_row,
    pair_row,
    rating_rows,
    traffic_row,
)
from ratchet.bus import make_consumer
from ratchet.gate_pairs import read_gate_pairs
from ratchet.records import (
    FEEDBACK_TOPIC,
    GROUPS_TOPIC,
    TRAFFIC_TOPIC,
    FeedbackRecord,
    ScoredGroup,
    TrafficRecord,
    decode,
)
from ratchet.secrets import redis_connection_url
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore

STATE_FILE = "ratchet-export.json"
FORMATS = ("parquet", "jsonl")
_AGO = re.compile(r"^(?P<n>\d{1,6})(?P<unit>[smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
READ_TIMEOUT_S = 30
POLL_RECORDS = 500
# How far out of order records' timestamps may be (each service stamps its records as it sends
# them; several may write one partition): --since seeks this much earlier, and the scan drops
# what is older than the since-time.
SINCE_SKEW_MS = 60_000
# Progress: (records scanned, records to scan).
Progress = Callable[[int, int], None]


class ExportError(ValueError):
    """The export cannot run as asked; the message says why."""


def since_ms(text: str | None, now: float | None = None) -> int | None:
    """``30m``, ``24h``, ``7d`` ago, or an ISO 8601 time (UTC unless it says), in epoch ms."""
    if text is None:
        return None
    match = _AGO.match(text)
    if match:
        seconds = int(match["n"]) * _UNIT_S[match["unit"]]
        return int(((now if now is not None else time.time()) - seconds) * 1000)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ExportError(
            f"--since {text!r}: give a duration (30m, 24h, 7d) or an ISO time (2026-11-27T10:00)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


@dataclass
class ExportState:
    alias: str
    kind: str
    fmt: str
    since: str | None
    since_ms: int | None
    ends: dict[str, int]  # "<topic>:<partition>" -> the end offset when the export began
    positions: dict[str, int]  # "<topic>:<partition>" -> the next offset not yet in a shard
    # "<topic>:<partition>" -> where its scan starts: the first record at or after `since`
    starts: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    rows: int = 0
    done: bool = False
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @classmethod
    def load(cls, out: Path) -> ExportState | None:
        path = out / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.is_file() else None

    def save(self, out: Path) -> None:
        _write_atomic(out / STATE_FILE, json.dumps(asdict(self), indent=2).encode())


# An export holds users' prompts, answers and comments: readable by its owner only, whatever the
# umask (audit N-12: files were written world-readable under the usual 022).
FILE_MODE = 0o600
FOLDER_MODE = 0o700


def _private(path: Path) -> BinaryIO:
    """``path`` opened for writing, created (or truncated) with mode 0600 from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # a file left by an earlier, interrupted run keeps its mode
    return os.fdopen(fd, "wb")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with _private(tmp) as fh:
        fh.write(data)
    os.replace(tmp, path)


def write_shard(out: Path, kind: Kind, fmt: str, index: int, rows: list[dict[str, Any]]) -> Path:
    """One shard, atomically and readable by its owner only: ``data/part-<index>.<fmt>``."""
    data = out / "data"
    data.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    path = data / f"part-{index:05d}.{fmt}"
    tmp = data / f".part-{index:05d}.{fmt}.tmp"
    with _private(tmp) as fh:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS[kind]), fh)
        else:
            fh.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    os.replace(tmp, path)
    return path


class Shards:
    """Rows buffered into shards; each shard written records the positions it covers."""

    def __init__(self, out: Path, state: ExportState, shard_rows: int) -> None:
        self.out, self.state, self.shard_rows = out, state, shard_rows
        self.rows: list[dict[str, Any]] = []

    def add(self, rows: list[dict[str, Any]], positions: dict[str, int]) -> None:
        """The rows of one record (a shard never splits them: ``positions`` is past it)."""
        self.rows += rows
        if len(self.rows) >= self.shard_rows:
            self.flush(positions)

    def flush(self, positions: dict[str, int]) -> None:
        if self.rows:
            kind = kind_of(self.state.kind)
            write_shard(self.out, kind, self.state.fmt, self.state.shards, self.rows)
            self.state.shards += 1
            self.state.rows += len(self.rows)
            self.rows = []
        self.state.positions = dict(positions)
        self.state.save(self.out)


def _partitions(consumer: Any, topic: str) -> list[Any]:
    from kafka.structs import TopicPartition

    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]


def end_offsets(settings: RatchetSettings, topics: list[str]) -> dict[str, int]:
    """Every partition's end offset now, as ``"<topic>:<partition>"``: one past its last
    record, read from that record itself. A broker may report the end as the last *batch's*
    first offset + 1 (the embedded Tansu does), which would end an export, or its resumption,
    inside that batch."""
    consumer = make_consumer(settings.kafka_bootstrap_servers, settings.kafka, [], None)
    try:
        tps = [tp for topic in topics for tp in _partitions(consumer, topic)]
        if not tps:
            raise ExportError(f"Kafka has no partitions of {topics}: is this the right cluster?")
        reported = consumer.end_offsets(tps)
        return {
            f"{tp.topic}:{tp.partition}": _last_offset(consumer, tp, end) + 1 if end else 0
            for tp, end in reported.items()
        }
    finally:
        consumer.close()


def start_offsets(settings: RatchetSettings, ends: dict[str, int], since: int) -> dict[str, int]:
    """Each partition's first offset whose record is at or after ``since`` (epoch ms), or its end
    when it has none, so that a scan seeks past older records instead of reading them."""
    from kafka.structs import TopicPartition

    target = since - SINCE_SKEW_MS
    tps = {key: TopicPartition(*_topic_partition(key)) for key in ends}
    consumer = make_consumer(settings.kafka_bootstrap_servers, settings.kafka, [], None)
    try:
        answered = consumer.offsets_for_times({tp: target for k, tp in tps.items() if ends[k]})
        # Where each log starts now: retention may have deleted a partition's older records,
        # or all of them.
        begins = consumer.beginning_offsets(list(tps.values())) if tps else {}
        starts = {}
        for key, tp in tps.items():
            guess = answered.get(tp)
            begin = begins.get(tp, 0)
            starts[key] = _first_at(consumer, tp, target, ends[key], guess and guess.offset, begin)
        return starts
    finally:
        consumer.close()


def _first_at(
    consumer: Any, tp: Any, target: int, end: int, guess: int | None, begin: int = 0
) -> int:
    """The first offset in [``begin``, ``end``) whose record is at or after ``target``, else
    ``end``: the broker's answer from its time index (``guess``) when it checks out, as a Kafka
    broker's does; else a binary search on the records' own timestamps, a few records read in
    all. The embedded Tansu answers 0 whatever the time. ``begin`` is where the log starts now
    (retention deletes the oldest records): nothing below it can be read."""
    if end <= begin:
        return end  # empty, or emptied by retention: nothing to read
    consumer.assign([tp])

    def first_record(offset: int) -> tuple[int, int]:
        """The offset and timestamp of the first record at or after ``offset``."""
        consumer.seek(tp, offset)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while time.monotonic() < deadline:
            for message in consumer.poll(timeout_ms=1000, max_records=1).get(tp, []):
                return message.offset, message.timestamp
        raise ExportError(f"could not read {tp.topic}:{tp.partition} at {offset}: is Kafka up?")

    guess = min(max(guess if guess is not None else end, begin), end)
    if (guess == end or first_record(guess)[1] >= target) and (
        guess == begin or first_record(guess - 1)[1] < target
    ):
        return guess
    low, high = begin, end
    while low < high:
        middle = (low + high) // 2
        offset, timestamp = first_record(middle)
        if timestamp >= target:
            high = middle
        else:
            low = offset + 1
    return low


def _topic_partition(key: str) -> tuple[str, int]:
    topic, partition = key.rsplit(":", 1)
    return topic, int(partition)


def _last_offset(consumer: Any, tp: Any, reported_end: int) -> int:
    """The offset of the partition's last record: fetched from the record before
    ``reported_end``, the fetch returns the whole batch holding it, up to its last record."""
    consumer.assign([tp])
    consumer.seek(tp, reported_end - 1)
    deadline = time.monotonic() + READ_TIMEOUT_S
    last: int | None = None
    while time.monotonic() < deadline:
        messages = consumer.poll(timeout_ms=1000, max_records=POLL_RECORDS).get(tp, [])
        if messages:
            last = messages[-1].offset
        if last is not None and len(messages) < POLL_RECORDS:
            return last
    raise ExportError(f"could not read the end of {tp.topic}:{tp.partition}: is Kafka up?")


def scan(
    settings: RatchetSettings,
    topic: str,
    state: ExportState,
    positions: dict[str, int],
    progress: Progress,
) -> Iterator[Any]:
    """Each message of ``topic`` from ``positions`` (updated as it goes; else from where
    ``since`` starts each partition) to the export's ends, no earlier than its ``since``."""
    from kafka.structs import TopicPartition

    wanted = {k: v for k, v in state.ends.items() if k.startswith(f"{topic}:")}
    consumer = make_consumer(settings.kafka_bootstrap_servers, settings.kafka, [], None)
    try:
        tps = {key: TopicPartition(*_topic_partition(key)) for key in wanted}
        consumer.assign(list(tps.values()))
        starts = {key: state.starts.get(key, 0) for key in wanted}
        for key in wanted:
            positions.setdefault(key, starts[key])
        for key, tp in tps.items():
            consumer.seek(tp, positions[key])
        total = sum(end - starts[k] for k, end in wanted.items())
        scanned = sum(max(0, min(positions[k], end) - starts[k]) for k, end in wanted.items())
        progress(scanned, total)
        last_read = time.monotonic()
        while any(positions[k] < end for k, end in wanted.items()):
            batch = consumer.poll(timeout_ms=1000, max_records=POLL_RECORDS)
            if batch:
                last_read = time.monotonic()
            elif time.monotonic() - last_read > READ_TIMEOUT_S:
                raise ExportError(
                    f"no records from {topic} for {READ_TIMEOUT_S} s: is Kafka up? The same "
                    "command continues the export"
                )
            for tp, messages in batch.items():
                key = f"{tp.topic}:{tp.partition}"
                for message in messages:
                    # A record appended since the export began comes in the fetch that holds
                    # the end: taken too, as the end only says where to stop.
                    positions[key] = message.offset + 1
                    scanned += 1
                    if state.since_ms is None or message.timestamp >= state.since_ms:
                        yield message
                if positions[key] >= wanted[key]:
                    consumer.pause(tp)
            progress(scanned, max(total, scanned))
    finally:
        consumer.close()


def kind_of(text: str) -> Kind:
    for kind in KINDS:
        if text == kind:
            return kind
    raise ExportError(f"--what {text!r}: one of {', '.join(KINDS)}")


def _topics(kind: Kind) -> list[str]:
    return {
        "groups": [GROUPS_TOPIC],
        "traffic": [TRAFFIC_TOPIC],
        "ratings": [FEEDBACK_TOPIC, TRAFFIC_TOPIC],
        "pairs": [],
    }[kind]


def begin(
    settings: RatchetSettings, out: Path, alias: str, kind: str, fmt: str, since: str | None
) -> ExportState:
    """The export's state: the one in ``out`` when it is the same export, else a new one."""
    checked = kind_of(kind)
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    existing = ExportState.load(out)
    if existing is not None:
        if (existing.alias, existing.kind, existing.fmt, existing.since) != (
            alias,
            kind,
            fmt,
            since,
        ):
            raise ExportError(
                f"{out} holds another export ({existing.alias}, {existing.kind}, {existing.fmt}, "
                f"since {existing.since}): choose another --out"
            )
        return existing
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} is not empty and holds no export: choose another --out")
    out.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    topics = _topics(checked)
    ends = end_offsets(settings, topics) if topics else {}
    since_at = since_ms(since)
    starts = start_offsets(settings, ends, since_at) if ends and since_at is not None else {}
    state = ExportState(alias, kind, fmt, since, since_at, ends, {}, starts)
    state.save(out)
    return state


def export(
    settings: RatchetSettings, out: Path, state: ExportState, shard_rows: int, progress: Progress
) -> ExportState:
    """Write the export's rows from where ``state`` stopped; the dataset card once complete."""
    if state.done:
        return state
    shards = Shards(out, state, shard_rows)
    positions = dict(state.positions)  # advanced by the scan as it reads
    for rows in _rows(settings, state, positions, progress):
        shards.add(rows, positions)
    shards.flush(positions)
    state.done = True
    state.save(out)
    card = dataset_card(
        state.alias, kind_of(state.kind), state.fmt, state.rows, state.since, state.started_at
    )
    _write_atomic(out / "README.md", card.encode())
    return state


def _rows(
    settings: RatchetSettings, state: ExportState, positions: dict[str, int], progress: Progress
) -> Iterator[list[dict[str, Any]]]:
    """The rows of each record read, record by record."""
    kind, alias = kind_of(state.kind), state.alias
    if kind == "pairs":
        rows = _pair_rows(settings, alias)
        progress(len(rows), len(rows))
        yield from ([row] for row in rows)
    elif kind == "ratings":
        ratings = _ratings(settings, state, progress)
        for message in scan(settings, TRAFFIC_TOPIC, state, positions, progress):
            record = decode(TRAFFIC_TOPIC, message.value)
            if isinstance(record, TrafficRecord) and record.alias == alias:
                yield rating_rows(record, ratings.get(record.response_id or "", ()))
    elif kind == "groups":
        for message in scan(settings, GROUPS_TOPIC, state, positions, progress):
            group = decode(GROUPS_TOPIC, message.value)
            if isinstance(group, ScoredGroup) and group.alias == alias:
                yield [group_row(group)]
    else:
        for message in scan(settings, TRAFFIC_TOPIC, state, positions, progress):
            record = decode(TRAFFIC_TOPIC, message.value)
            if isinstance(record, TrafficRecord) and record.alias == alias:
                yield [traffic_row(record)]


def _ratings(
    settings: RatchetSettings, state: ExportState, progress: Progress
) -> dict[str, list[FeedbackRecord]]:
    """Every rating up to the export's end, by completion id (read whole on each run: a rating
    is a few hundred bytes, and it may come long after its answer)."""
    by_completion: dict[str, list[FeedbackRecord]] = {}
    unbounded = ExportState(**{**asdict(state), "since_ms": None})
    for message in scan(settings, FEEDBACK_TOPIC, unbounded, {}, progress):
        record = decode(FEEDBACK_TOPIC, message.value)
        if isinstance(record, FeedbackRecord):
            by_completion.setdefault(record.completion_id, []).append(record)
    return by_completion


def _pair_rows(settings: RatchetSettings, alias: str) -> list[dict[str, Any]]:
    """The gate pairs the learner kept (Redis, the first 16 of each version's gate, 30 days)."""
    assert settings.store_dir is not None
    client = redis.Redis.from_url(redis_connection_url(settings))
    try:
        return [
            pair_row(alias, version, pair)
            for version in AdapterStore(settings.store_dir).versions(alias)
            for pair in read_gate_pairs(client, alias, version)
        ]
    finally:
        client.close()

"""The proxy's traffic logger, in a child process of its own (``python -m proxy.log.worker``).

Why a process and not a thread: turning an exchange into a TrafficRecord (parsing the answer,
assembling streams, redaction, pydantic, JSON) and kafka-python's sender are pure Python. On a
thread of the proxy they hold the GIL for milliseconds at a time, and the event loop waits up to
the interpreter's 5 ms switch interval to get it back: that was the proxy's p99 in
bench/proxy_overhead.py. Here they run under the child's own GIL; the request path only writes
one length-prefixed frame into a pipe (proxy/log/pipe.py), which never blocks.

Parent -> child, on the child's stdin: frames ``<u32 size><u8 kind><u32 meta><u32 a>`` followed by
``meta`` bytes of JSON and two blobs, ``a`` and the rest. The first frame is CONFIG (a pickled
:class:`WorkerConfig`, from the parent and trusted as such); then EXCHANGE frames (meta: the
exchange's fields, a: the request body as the client sent it, b: the answer's bytes as vLLM sent
them) and RECORD frames (meta: topic and key, b: the record's JSON).

Every record is journaled (proxy/log/journal.py) before it is queued, and a frame counts as
received only once its records are fsynced there, so a killed worker loses nothing: the proxy
resends the frames it never confirmed, and the next worker spools what the journal holds.

Child -> parent, on its stdout: one JSON status line every ``report_s`` and a last one at exit:
frames received (durably) and handled (durable or not: the proxy's watchdog reads which frame a
stuck worker was on), the producer's counters, and the tokens counted since the previous line
(the proxy adds those to its token metric). End of stdin means the proxy is gone or
stopping: the child sends or spools everything it holds, reports, and exits. It runs in its own
session so a Ctrl-C aimed at the proxy's process group cannot cut that short. A worker stuck or
busy never reads that end, so on Linux it also dies with the proxy (:func:`die_with_parent`):
what it journaled is spooled by the next worker, so nothing it made durable is lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import struct
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from proxy.answer_ids import redacted_answer_id
from proxy.log.spool import OutgoingRecord
from ratchet.records import FEEDBACK_TOPIC
from ratchet.settings import KafkaSettings, ProxySettings

CONFIG, EXCHANGE, RECORD = 0, 1, 2
# The fields of a finished record (a RECORD frame) that a client wrote, by topic: redacted here.
# A traffic record is built and redacted here whole (proxy/log/exchange.py).
REDACTED_FIELDS: dict[str, tuple[str, ...]] = {FEEDBACK_TOPIC: ("completion_id", "comment")}
_HEADER = struct.Struct("<IBII")  # size of what follows the u32, kind, meta length, a length
_FIRST = struct.Struct("<I")

log = logging.getLogger("proxy.log.worker")


@dataclass(frozen=True)
class WorkerConfig:
    bootstrap: str
    kafka: KafkaSettings
    spool_dir: Path
    topics: list[str]
    queue_size: int
    max_record_bytes: int = 900 * 1024
    spool_max_bytes: int | None = None
    redact_patterns: list[str] = field(default_factory=list)
    redact_budget_s: float = ProxySettings.model_fields["redact_budget_s"].default
    report_s: float = 0.2
    # The proxy replaces a worker that holds frames and confirms none for this long.
    stuck_after_s: float = ProxySettings.model_fields["log_worker_stuck_s"].default


def encode_frame(kind: int, meta: bytes, a: bytes = b"", b: bytes = b"") -> bytes:
    """One frame; ``meta`` is already JSON (orjson) so the hot path encodes once."""
    return _HEADER.pack(9 + len(meta) + len(a) + len(b), kind, len(meta), len(a)) + meta + a + b


def read_frame(stream: BinaryIO) -> tuple[int, bytes, bytes, bytes] | None:
    """The next frame's (kind, meta, a, b), or None at the end of the stream."""
    head = stream.read(_FIRST.size)
    if len(head) < _FIRST.size:
        return None
    (size,) = _FIRST.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None  # the parent died mid-frame: that frame was never whole
    kind, meta_len, a_len = struct.unpack_from("<BII", body)
    start = 9
    meta = body[start : start + meta_len]
    a = body[start + meta_len : start + meta_len + a_len]
    return kind, meta, a, body[start + meta_len + a_len :]


@dataclass(slots=True)
class ExchangeMeta:
    """The JSON meta of an EXCHANGE frame (orjson writes a dataclass as an object): everything
    but the request and answer bytes. Its fields are :class:`proxy.log.exchange.Exchange`'s, plus
    ``started_at``, the wall clock when the request arrived."""

    request_id: str
    endpoint: str
    alias: str
    served_name: str
    version: int
    canary_arm: str
    stream: bool
    api_key_hash: str | None
    logged: bool  # False when the alias's log_rate leaves it out of ratchet.traffic
    started_at: float
    status: int = 0
    error: dict[str, Any] | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    client_request_id: str | None = None  # the client's x-request-id, for correlation only
    source: str | None = None  # the client for the per-client caps (ProxyState.source)
    client_api: str | None = None  # "responses", "messages": the API the client called


class Worker:
    """Frames in, records out through a RecordProducer; counts tokens for the parent."""

    def __init__(self, config: WorkerConfig, report: BinaryIO) -> None:
        from proxy.log.exchange import Redactor
        from proxy.log.journal import Journal
        from proxy.log.producer import RecordProducer

        self.config = config
        self.redactor = Redactor(config.redact_patterns, config.redact_budget_s)
        # Records with strings replaced whole: past the redaction budget, or too many matches.
        self.redact_over_budget = 0
        self.journal = Journal(config.spool_dir / "journal")
        self.producer = RecordProducer(
            config.bootstrap,
            config.kafka,
            config.spool_dir,
            topics=config.topics,
            queue_size=config.queue_size,
            max_record_bytes=config.max_record_bytes,
            spool_max_bytes=config.spool_max_bytes,
            on_settled=self.journal.settle,
        )
        self.read = 0  # frames read from the pipe
        self.received = 0  # of those, the ones whose records are durable in the journal
        self._journal_failing = False
        self._tokens: Counter[tuple[str, str, str, str]] = Counter()
        self._lock = threading.Lock()
        self._report = report
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="report", daemon=True)

    def run(self, frames: BinaryIO) -> None:
        self.recover()
        self.producer.start()
        self._reporter.start()
        try:
            while (frame := read_frame(frames)) is not None:
                try:
                    self.handle(*frame)
                except Exception:
                    # One frame that cannot be read must not stop the worker for all the others.
                    self.producer.dropped += 1
                    log.exception("could not turn a frame into a record; dropped")
                self.read += 1
        finally:
            self.producer.close()
            self._stop.set()
            self._reporter.join(5)
            self.report()
            self.journal.close()

    def recover(self) -> None:
        """Spool what a killed worker journaled and never settled, ahead of anything new."""
        for path, records in self.journal.take_leftovers():
            if records:
                self.producer.adopt(records)
                log.warning("recovered %d records a stopped worker left in %s", len(records), path)
            self.journal.discard(path)

    def accept(self, record: OutgoingRecord) -> None:
        """Journal the record, then queue it for Kafka."""
        try:
            self.journal.append(record)
        except OSError as exc:
            # Still sent, just not crash-proof: a full or failing disk must not stop logging.
            if not self._journal_failing:
                log.error("cannot write the journal (%s); records are not crash-safe", exc)
            self._journal_failing = True
        else:
            self._journal_failing = False
        self.producer.submit(record)

    def handle(self, kind: int, meta: bytes, a: bytes, b: bytes) -> None:
        if kind == RECORD:
            fields = orjson.loads(meta)
            key: str | None = fields.get("key")
            if fields["topic"] in REDACTED_FIELDS:
                key, b = self.redact_record(fields["topic"], key, b)
            encoded = key.encode() if key is not None else None
            self.accept(OutgoingRecord(fields["topic"], encoded, b))
        elif kind == EXCHANGE:
            self.handle_exchange(orjson.loads(meta), a, b)
        else:
            raise ValueError(f"unknown frame kind {kind}")

    def redact_record(self, topic: str, key: str | None, value: bytes) -> tuple[str | None, bytes]:
        """A finished record's client-written fields (:data:`REDACTED_FIELDS`) and its key,
        redacted as the traffic is (a rating's ``completion_id`` is the rated answer's id,
        redacted alike in its traffic record, so the two still join)."""
        if self.redactor.pattern is None:
            return key, value
        redact = self.redactor.begin()
        record = orjson.loads(value)
        for name in REDACTED_FIELDS[topic]:
            if name == "completion_id" and isinstance(record.get(name), str):
                record[name] = redacted_answer_id(record[name], redact.string)
            elif isinstance(record.get(name), str):
                record[name] = redact.part(name, record[name])
        if redact.failed:
            self.redact_over_budget += 1
            log.warning("redaction of a %s record replaced %s whole", topic, redact.failed)
        # The key is the completion id: redacted as the field is, and as the traffic's id.
        redacted_key = redacted_answer_id(key, redact.string) if key is not None else None
        return redacted_key, orjson.dumps(record)

    def handle_exchange(self, fields: dict[str, Any], request: bytes, answer: bytes) -> None:
        from proxy.log.exchange import Exchange, bounded
        from ratchet.records import TRAFFIC_TOPIC

        started_at = fields.pop("started_at")
        exchange = Exchange(
            **fields,
            request=orjson.loads(request),
            redactor=self.redactor,
            response_body=b"" if fields["stream"] else answer,
            response_chunks=[answer] if fields["stream"] and answer else [],
        )
        labels = (exchange.alias, str(exchange.version), exchange.canary_arm)
        if exchange.logged:
            record = exchange.to_record()
            if record.truncated:  # only redaction has cut anything yet
                self.redact_over_budget += 1
                log.warning(
                    "redaction of %s ran past its budget or a string's matches; replaced whole",
                    exchange.request_id,
                )
            record.ts = _iso(started_at)  # when the request arrived, not when it was logged
            self.count_tokens(labels, record.input_tokens, record.output_tokens)
            value = bounded(record, self.config.max_record_bytes)
            self.accept(OutgoingRecord(TRAFFIC_TOPIC, exchange.request_id.encode(), value))
        else:  # sampled out by log_rate: counted, never parsed in full
            self.count_tokens(labels, *exchange.usage())

    def count_tokens(
        self, labels: tuple[str, str, str], input_tokens: int | None, output_tokens: int | None
    ) -> None:
        with self._lock:
            if input_tokens:
                self._tokens[(*labels, "input")] += input_tokens
            if output_tokens:
                self._tokens[(*labels, "output")] += output_tokens

    def report(self) -> None:
        self.sync()
        with self._lock:
            tokens, self._tokens = self._tokens, Counter()
        p = self.producer
        line = orjson.dumps(
            {
                "received": self.received,
                # Frames handled, durable or not: the one after them is the one in hand.
                "read": self.read,
                "redact_over_budget": self.redact_over_budget,
                "recovered": p.recovered,
                "sent": p.sent,
                "spooled": p.spooled,
                "replayed": p.replayed,
                "dropped": p.dropped,
                "dead_lettered": p.dead_lettered,
                "spool_full": p.spool_full,
                "depth": p.depth,
                "spool_pending": p.spool.pending,
                "connected": p.connected,
                "tokens": [[*labels, n] for labels, n in tokens.items()],
            }
        )
        with contextlib.suppress(OSError, ValueError):  # the parent is gone: nobody to tell
            self._report.write(line + b"\n")
            self._report.flush()

    def sync(self) -> None:
        """fsync the journal; every frame read before it is then received."""
        read = self.read  # each of these frames was journaled before it was counted read
        try:
            self.journal.sync()
        except OSError as exc:
            if not self._journal_failing:
                log.error("cannot fsync the journal (%s); records are not crash-safe", exc)
            self._journal_failing = True
        self.received = read

    def _report_loop(self) -> None:
        while not self._stop.wait(self.config.report_s):
            self.report()


def _iso(epoch_s: float) -> str:
    moment = datetime.fromtimestamp(epoch_s, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (the proxy) dies, even killed hard,
    so a stuck or busy worker is never left orphaned, holding a CPU; exit now if it already has."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))
    # The proxy may have died before the prctl: then the signal never comes.
    if os.getppid() != parent:
        sys.exit("proxy.log.worker: the proxy that started this worker is gone")


def main() -> None:
    # Reports own the real stdout; anything else that prints (a library) lands on stderr.
    report = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    die_with_parent(int(sys.argv[1]))  # the proxy's pid, from proxy/log/pipe.py
    frames = sys.stdin.buffer
    first = read_frame(frames)
    if first is None or first[0] != CONFIG:
        sys.exit("proxy.log.worker: expected a CONFIG frame first")
    config: WorkerConfig = pickle.loads(first[3])
    Worker(config, report).run(frames)


if __name__ == "__main__":
    main()

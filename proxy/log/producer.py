"""The log worker's Kafka producer: never blocks its caller, spools while the broker is away.

:class:`RecordProducer` is what the log worker produces through. ``submit()`` only puts the record
on an in-memory queue (or counts it as dropped when the queue is full); one background thread sends
batches with ``acks=all`` and waits for them. When the broker is unreachable, records go to an
append-only spool on disk, in order, and are replayed in that order once the broker answers again.
While anything is spooled, new records are spooled behind it, so order is kept across an outage.
Delivery is at least once: a batch that timed out may have landed and is then sent again, so
consumers de-duplicate by key.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    CorruptRecordError,
    InvalidRecordError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)

from proxy.log.spool import OutgoingRecord, Spool
from ratchet.bus import ensure_topics
from ratchet.records import DEADLETTER_TOPIC, DeadLetter
from ratchet.settings import KafkaSettings

log = logging.getLogger(__name__)

# None wakes the producer thread to stop.
QueueItem = OutgoingRecord | None

# What the broker (or the client, before sending) refuses for the record itself: sending it
# again can only fail again, so it goes to ratchet.deadletter instead of back to the spool.
REFUSED_RECORD = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    InvalidRecordError,
    CorruptRecordError,
)
DEAD_LETTER_CONSUMER = "proxy.log"  # who gave up on a record, in its dead letter
# kafka-python's own limit on one request, above the largest record the worker writes
# (proxy.max_record_bytes) by room for the batch's framing.
REQUEST_HEADROOM_BYTES = 64 * 1024


class RecordProducer:
    """Produce records off the caller's thread; spool when the broker is away.

    The counters (``sent``, ``spooled``, ``dropped``, ``replayed``), ``depth`` and ``connected``
    go into the log worker's reports. ``on_state`` is told ``True``/``False`` as the broker comes
    and goes.
    """

    def __init__(
        self,
        bootstrap: str,
        kafka: KafkaSettings,
        spool_dir: Path,
        topics: list[str],
        queue_size: int = 10_000,
        max_record_bytes: int = 1024 * 1024 - REQUEST_HEADROOM_BYTES,
        spool_max_bytes: int | None = None,
        batch_size: int = 500,
        linger_s: float = 0.05,
        on_state: Callable[[bool], None] | None = None,
        on_settled: Callable[[list[OutgoingRecord]], None] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.kafka = kafka
        self.topics = topics
        self.queue: queue.Queue[QueueItem] = queue.Queue(maxsize=queue_size)
        self.max_record_bytes = max_record_bytes
        self.batch_size = batch_size
        # Gather records for this long before a send: one flush per record costs ~1 ms of
        # kafka-python CPU, which the request path then feels through the GIL.
        self.linger_s = linger_s
        self.spool = Spool(spool_dir, max_bytes=spool_max_bytes)
        self.on_state = on_state
        # Told of records that reached their end here: acknowledged, dead-lettered, spooled or
        # counted dropped (the worker's journal forgets them then).
        self.on_settled = on_settled
        self.sent = 0
        self.spooled = 0
        self.replayed = 0
        self.dropped = 0
        self.dead_lettered = 0  # refused by the broker for what they are; on ratchet.deadletter
        self.spool_full = 0  # of ``dropped``: records the spool had no room for
        self.recovered = 0  # left by a killed worker in its journal, spooled by this one
        self.connected = False
        self._producer: KafkaProducer | None = None
        self._stop = threading.Event()
        # Guards the spool once close() gives up on a stuck thread and takes over writing it.
        self._lock = threading.Lock()
        self._abandoned = False
        self._inflight: list[OutgoingRecord] = []
        # A connection attempt with nothing in flight can take bootstrap_timeout_ms with the
        # broker away; close() does not wait for it: it takes the queue over (under _lock,
        # while _connecting) and the thread, once the attempt ends, stops without touching it.
        self._connecting = False
        self._handed_over = False
        self._next_connect_at = 0.0
        self._thread = threading.Thread(target=self._run, name="ratchet-producer", daemon=True)

    # ---- caller side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, record: OutgoingRecord) -> bool:
        """Queue a record; never blocks. False (and a counted drop) when the queue is full."""
        if not self._stop.is_set():  # closed: nothing would send it, so refuse and count it
            try:
                self.queue.put_nowait(record)
                return True
            except queue.Full:
                pass
        self.dropped += 1
        self._settled([record])
        return False

    def adopt(self, records: list[OutgoingRecord]) -> None:
        """Records an earlier worker accepted and never settled: into the spool, which is
        replayed before anything new. Call before :meth:`start`."""
        with self._lock:
            spooled = self.spooled
            self._append_to_spool(records)
            self.recovered += self.spooled - spooled

    def close(self, timeout_s: float = 10.0) -> None:
        """Send or spool everything still queued, then stop. Nothing accepted is left behind."""
        self._stop.set()
        if self._thread.ident is not None:
            # Wake the thread; if the queue is full it wakes on its own within 0.5 s.
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(None)
            self._join_thread(timeout_s)
        stuck = self._thread.is_alive() and not self._handed_over
        if stuck:
            log.error("producer thread did not stop in %.0fs; spooling the rest", timeout_s)
        with self._lock:
            # From here only this method writes the spool. The batch a stuck thread is sending
            # goes first, so order holds; if that send still lands, it is delivered twice.
            self._abandoned = True
            rest = list(self._inflight) if stuck else []
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    rest.append(item)
            if rest:
                self._append_to_spool(rest)
                self._settled(rest)
            self.spool.close()
        if self._producer is not None:
            with contextlib.suppress(KafkaError):
                self._producer.close(timeout=2)

    def _join_thread(self, timeout_s: float) -> None:
        """Wait for the thread to send or spool what it holds, or take over from a connection
        attempt that holds nothing."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            with self._lock:
                if self._connecting and not self._inflight:
                    self._handed_over = True
                    return
            self._thread.join(0.02)

    @property
    def depth(self) -> int:
        return self.queue.qsize()

    # ---- producer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._handed_over:
            batch = self._take_batch()
            stopping = self._stop.is_set()
            if batch:
                self._deliver(batch)
            elif not self.spool.is_empty():
                self._try_replay()
            elif self._producer is None:
                self._connect()  # connect early, so readiness and metrics tell the truth
            if stopping and self.queue.empty():
                return

    def _take_batch(self) -> list[OutgoingRecord]:
        try:
            first = self.queue.get(timeout=0.5)
        except queue.Empty:
            return []
        batch = []
        item: QueueItem = first
        deadline = time.monotonic() + self.linger_s
        while True:
            if item is None:  # close() woke us: send what we have now
                deadline = 0.0
            if item is not None:
                batch.append(item)
            if len(batch) >= self.batch_size:
                break
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
                )
            except queue.Empty:
                break
        return batch

    def _deliver(self, batch: list[OutgoingRecord]) -> None:
        # Keep order: while older records wait on disk, newer ones queue up behind them.
        if not self.spool.is_empty():
            if self._spool(batch):
                self._settled(batch)
            self._try_replay()
            return
        self._inflight = batch
        if self._send(batch) or self._spool(batch):
            self._settled(batch)
        self._inflight = []

    def _spool(self, batch: list[OutgoingRecord]) -> bool:
        """Append to the spool; False once close() has taken it over (and this batch with it)."""
        with self._lock:
            if self._abandoned:
                return False
            self._append_to_spool(batch)
            return True

    def _settled(self, records: list[OutgoingRecord]) -> None:
        if self.on_settled is not None:
            self.on_settled(records)

    def _append_to_spool(self, batch: list[OutgoingRecord]) -> None:
        try:
            written = self.spool.append(batch)
        except OSError as exc:
            self.dropped += len(batch)
            log.error("cannot write %d records to the spool (%s); dropped", len(batch), exc)
            return
        self.spooled += written
        if written < len(batch):
            if not self.spool_full:
                log.error(
                    "the spool holds proxy.spool_max_bytes (%d bytes): newer records are dropped "
                    "until Kafka takes the backlog",
                    self.spool.max_bytes,
                )
            self.spool_full += len(batch) - written
            self.dropped += len(batch) - written

    def _try_replay(self) -> None:
        # Only read the spool back once the broker answers, and not while shutting down:
        # what is on disk stays there for the next start.
        if self._stop.is_set() or not self._connect() or self._handed_over:
            return
        for path, records in self.spool.drain():
            if records and not self._send(records):
                return
            self.replayed += len(records)
            self.spool.remove(path, len(records))
        log.info("spool replayed; back to producing directly")

    def _connect(self) -> bool:
        if self._producer is not None:
            return True
        now = time.monotonic()
        if now < self._next_connect_at:
            return False
        self._next_connect_at = now + 1.0
        with self._lock:
            self._connecting = True
        try:
            ensure_topics(self.bootstrap, self.kafka, self.topics)
            self._producer = self._make_producer()
        except (KafkaError, OSError, ValueError) as exc:
            log.debug("broker unreachable: %s", exc)
            self._set_state(False)
            return False
        finally:
            with self._lock:
                self._connecting = False
        self._set_state(True)
        return True

    def _make_producer(self) -> KafkaProducer:
        compression = None if self.kafka.compression == "none" else self.kafka.compression
        options: dict[str, Any] = dict(
            bootstrap_servers=self.bootstrap,
            acks="all",
            compression_type=compression,
            linger_ms=5,
            max_request_size=self.max_record_bytes + REQUEST_HEADROOM_BYTES,
            max_block_ms=2000,
            request_timeout_ms=5000,
            delivery_timeout_ms=8000,
            bootstrap_timeout_ms=2000,
            retries=3,
            **self.kafka.client_options(),
        )
        if self.kafka.idempotence == "off":
            return KafkaProducer(enable_idempotence=False, **options)
        try:
            return KafkaProducer(enable_idempotence=True, **options)
        except KafkaError:
            if self.kafka.idempotence == "on":
                raise
            log.info("broker does not support idempotent producing; using acks=all without it")
            return KafkaProducer(enable_idempotence=False, **options)

    def _send(self, batch: list[OutgoingRecord]) -> bool:
        """Send a batch and wait for every ack. False if any failed (the whole batch is redone)."""
        if self._producer is None and self._stop.is_set():
            return False  # shutting down with no broker: spool now instead of trying again
        if not self._connect():
            return False
        try:
            refused = self._produce(batch)
            letters = [_dead_letter(record, exc) for record, exc in refused]
            lost = self._produce(letters) if letters else []
        except (KafkaError, OSError, AssertionError) as exc:
            log.warning("kafka send failed (%s); spooling until the broker is back", exc)
            self._reset()
            return False
        for record, why in refused:
            log.error(
                "kafka refused a %d-byte record on %s (%s)", len(record.value), record.topic, why
            )
        for _, why in lost:
            log.error("kafka refused a dead letter too (%s); dropped", why)
        self.sent += len(batch) - len(refused)
        self.dead_lettered += len(letters) - len(lost)
        self.dropped += len(lost)
        return True

    def _produce(self, batch: list[OutgoingRecord]) -> list[tuple[OutgoingRecord, KafkaError]]:
        """Send and wait for every ack. Records refused for what they are come back; any other
        failure raises, and the caller spools the whole batch."""
        assert self._producer is not None
        refused: list[tuple[OutgoingRecord, KafkaError]] = []
        futures = []
        for record in batch:
            try:
                futures.append(
                    (record, self._producer.send(record.topic, key=record.key, value=record.value))
                )
            except REFUSED_RECORD as too_large:  # kafka-python checks the size before sending
                refused.append((record, too_large))
        self._producer.flush(timeout=10)
        for record, future in futures:
            try:
                future.get(timeout=0)
            except REFUSED_RECORD as refusal:
                refused.append((record, refusal))
        return refused

    def _reset(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(KafkaError, OSError):
                self._producer.close(timeout=0)
        self._producer = None
        self._set_state(False)

    def _set_state(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            if self.on_state:
                self.on_state(connected)


def _dead_letter(record: OutgoingRecord, exc: KafkaError) -> OutgoingRecord:
    error = f"{type(exc).__name__}: {exc}"
    letter = DeadLetter.of(record.topic, record.value, DEAD_LETTER_CONSUMER, "refused", error)
    return OutgoingRecord(DEADLETTER_TOPIC, letter.key(), letter.to_json())

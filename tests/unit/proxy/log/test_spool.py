"""The log path's disk spool, and the producer against a broker that is not there."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka.errors import KafkaTimeoutError

from embedded.processes import free_port as closed_port
from embedded.processes import wait_until
from proxy.log import producer as producer_module
from proxy.log.producer import RecordProducer
from proxy.log.spool import OutgoingRecord, Spool
from ratchet import bus
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, Record
from ratchet.settings import KafkaSettings


def rec(i: int, topic: str = TRAFFIC_TOPIC) -> OutgoingRecord:
    return OutgoingRecord(topic, f"k{i}".encode(), orjson.dumps({"i": i, "pad": "x" * 40}))


def drained(spool: Spool) -> list[OutgoingRecord]:
    return [r for _, records in spool.drain() for r in records]


def numbers(records: list[OutgoingRecord]) -> list[int]:
    return [orjson.loads(r.value)["i"] for r in records]


# ---- Spool --------------------------------------------------------------------------------------


def test_spool_append_and_drain_in_order_across_segment_rolls(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", segment_bytes=200)
    assert spool.is_empty() and len(spool) == 0
    expected: list[int] = []
    i = 0
    for size in (1, 3, 1, 5, 2, 1, 4):
        batch = [rec(i + j) for j in range(size)]
        expected += [i + j for j in range(size)]
        i += size
        spool.append(batch)
    assert len(spool.segments()) > 3, "tiny segments must roll"
    assert not spool.is_empty()
    assert len(spool) == len(expected)
    out = drained(spool)
    assert numbers(out) == expected
    assert out[0] == rec(0)  # topic, key and value survive byte for byte


def test_spool_keeps_none_keys_and_unicode(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    records = [
        OutgoingRecord(FEEDBACK_TOPIC, None, '{"c":"héllo ✓"}'.encode()),
        OutgoingRecord(TRAFFIC_TOPIC, "ключ".encode(), b'{"a":"line\\nbreak"}'),
    ]
    spool.append(records)
    assert drained(spool) == records


def test_spool_append_after_drain_goes_to_a_newer_segment(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=1 << 20)
    spool.append([rec(0), rec(1)])
    segments = list(spool.drain())
    assert len(segments) == 1
    spool.append([rec(2)])
    # Replay deletes a segment only after it is sent; what it read must not be reopened.
    assert [numbers(r) for _, r in spool.drain()] == [[0, 1], [2]]
    segments[0][0].unlink()
    assert numbers(drained(spool)) == [2]


def test_spool_survives_reopen(tmp_path: Path) -> None:
    first = Spool(tmp_path, segment_bytes=100)
    first.append([rec(0), rec(1)])
    first.append([rec(2)])
    first.close()
    second = Spool(tmp_path, segment_bytes=100)
    second.append([rec(3)])
    assert numbers(drained(second)) == [0, 1, 2, 3]


def test_spool_torn_last_line_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=150)
    spool.append([rec(0), rec(1), rec(2)])
    spool.append([rec(3)])
    spool.close()
    last = spool.segments()[-1]
    good = last.read_bytes()
    # A crash mid-write: half a line, no newline.
    last.write_bytes(good + b'{"topic":"ratchet.traffic","key":"k4","val')
    reopened = Spool(tmp_path, segment_bytes=150)
    assert numbers(drained(reopened)) == [0, 1, 2, 3]
    # Records appended after the crash come after the survivors, not glued to the torn line.
    reopened.append([rec(5)])
    assert numbers(drained(reopened)) == [0, 1, 2, 3, 5]


def test_spool_empty_segments_count_as_empty(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([])
    assert spool.segments()
    assert spool.is_empty()
    assert drained(spool) == []


# ---- RecordProducer with no broker --------------------------------------------------------------


def feedback(i: int) -> FeedbackRecord:
    return FeedbackRecord(completion_id=f"c{i}", score=(i % 10) / 10)


def outgoing(record: Record, key: str) -> OutgoingRecord:
    return OutgoingRecord(record.TOPIC, key.encode(), record.to_json())


def producer(tmp_path: Path, **kwargs) -> RecordProducer:
    return RecordProducer(
        f"127.0.0.1:{closed_port()}",
        KafkaSettings(),
        tmp_path / "spool",
        topics=[TRAFFIC_TOPIC, FEEDBACK_TOPIC],
        **kwargs,
    )


class Refusal:
    """Stands in for ensure_topics against a broker that is not there."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.attempts = 0
        self.hang: threading.Event | None = None  # when set: hang until it is set
        self.hanging = threading.Event()
        self.hang_timed_out = False

    def __call__(self, bootstrap: str, kafka: KafkaSettings, topics: list[str]) -> list[str]:
        self.attempts += 1
        if self.hang is not None:
            self.hanging.set()
            self.hang_timed_out = not self.hang.wait(10)
        if self.delay:
            time.sleep(self.delay)
        raise KafkaTimeoutError(f"Unable to bootstrap from {bootstrap}")


@pytest.fixture
def fast_refusal(monkeypatch: pytest.MonkeyPatch) -> Refusal:
    """Make the unreachable broker fail at once instead of after kafka-python's 2 s bootstrap.

    Only the slow part is replaced: the producer sees the exception that a real bootstrap
    against a closed port raises (test_unreachable_broker_spools_everything_in_order does it
    for real). ``delay`` simulates a broker that hangs.
    """
    refusal = Refusal()
    monkeypatch.setattr(producer_module, "ensure_topics", refusal)
    return refusal


def on_disk(tmp_path: Path) -> list[OutgoingRecord]:
    return drained(Spool(tmp_path / "spool"))


def test_unreachable_broker_spools_everything_in_order(tmp_path: Path) -> None:
    """The real thing: a closed port, kafka-python's own bootstrap failure (about 2 s)."""
    states: list[bool] = []
    p = producer(tmp_path, queue_size=1000, on_state=states.append)
    for i in range(30):
        assert p.submit(outgoing(feedback(i), f"c{i}"))
    p.submit(OutgoingRecord(TRAFFIC_TOPIC, b"t30", b'{"i": 30}'))
    p.submit(OutgoingRecord(TRAFFIC_TOPIC, b"t31", b'{"i": 31}'))
    for i in range(32, 100):
        p.submit(outgoing(feedback(i), f"c{i}"))
    p.start()
    p.close()
    assert p.depth == 0, "close() must leave nothing in the queue"
    assert p.queue.empty()
    out = on_disk(tmp_path)
    assert len(out) == 100
    keys = [r.key.decode() for r in out]
    assert keys[:30] == [f"c{i}" for i in range(30)]
    assert keys[30:32] == ["t30", "t31"]
    assert keys[32:] == [f"c{i}" for i in range(32, 100)]
    assert orjson.loads(out[5].value)["completion_id"] == "c5"
    assert {r.topic for r in out[:30]} == {FEEDBACK_TOPIC}
    assert p.spooled == 100
    assert p.sent == 0 and p.dropped == 0
    assert p.connected is False
    assert not any(states), "the producer never reported the broker as connected"


def test_outage_keeps_order_across_many_batches(tmp_path: Path, fast_refusal: Refusal) -> None:
    """Records arriving while older ones wait on disk queue up behind them, never ahead."""
    p = producer(tmp_path, queue_size=1000, batch_size=7)
    p.start()
    for i in range(200):
        p.submit(outgoing(feedback(i), f"c{i}"))
        if i % 50 == 0:
            # Everything so far on disk before more arrive, so the later records do arrive
            # while older ones wait there.
            deadline = time.monotonic() + 10
            while p.spooled < i + 1:
                assert time.monotonic() < deadline, f"{p.spooled} of {i + 1} records spooled"
                time.sleep(0.005)
    p.close()
    assert p.depth == 0
    assert [r.key for r in on_disk(tmp_path)] == [f"c{i}".encode() for i in range(200)]
    assert p.spooled == 200 and p.sent == 0
    assert fast_refusal.attempts >= 1, "the producer should have tried the broker"


def test_submit_never_blocks_and_full_queue_counts_drops(
    tmp_path: Path, fast_refusal: Refusal
) -> None:
    p = producer(tmp_path, queue_size=10)
    record = feedback(1)
    started = time.perf_counter()
    accepted = [p.submit(outgoing(record, f"c{i}")) for i in range(1000)]
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, f"1000 submits took {elapsed:.3f}s"
    assert accepted.count(True) == 10
    assert accepted[:10] == [True] * 10
    assert p.dropped == 990
    assert p.depth == 10
    assert p.submit(OutgoingRecord(TRAFFIC_TOPIC, None, b"{}")) is False
    assert p.submit(OutgoingRecord(TRAFFIC_TOPIC, b"t", b"{}")) is False
    assert p.dropped == 992
    # The accepted ones still reach the disk, in order.
    p.start()
    p.close()
    assert [r.key for r in on_disk(tmp_path)] == [f"c{i}".encode() for i in range(10)]


def test_submit_does_not_block_while_the_thread_is_stuck(
    tmp_path: Path, fast_refusal: Refusal
) -> None:
    """Every submit returns while the send thread hangs on the broker: the hang is only lifted
    after the last one, so a submit that waited for the thread would never return (a timed
    assertion instead failed on a loaded CI host)."""
    fast_refusal.hang = threading.Event()
    p = producer(tmp_path, queue_size=100_000)
    p.start()
    try:
        assert fast_refusal.hanging.wait(10), "the send thread never reached the broker"
        for i in range(1000):
            p.submit(outgoing(feedback(i), f"c{i}"))
        # Still hanging: a submit that had waited for the thread would have outlasted the hang.
        assert not fast_refusal.hang_timed_out
    finally:
        fast_refusal.hang.set()
        p.close()
    assert len(on_disk(tmp_path)) == 1000


def test_close_on_timeout_still_spools_everything_in_order(
    tmp_path: Path, fast_refusal: Refusal
) -> None:
    """close() promises that nothing accepted is left behind, even when the send thread is stuck.

    Here the thread is stuck on the broker (0.6 s) with the first batch in hand when close() stops
    waiting for it after 0.2 s. Every record must be on disk, in order, when close() returns.
    """
    fast_refusal.delay = 0.6
    p = producer(tmp_path, queue_size=100)
    for i in range(5):
        p.submit(outgoing(feedback(i), f"c{i}"))
    p.start()
    deadline = time.monotonic() + 2
    while p.depth and time.monotonic() < deadline:  # the thread took the first batch
        time.sleep(0.01)
    for i in range(5, 10):
        p.submit(outgoing(feedback(i), f"c{i}"))
    try:
        p.close(timeout_s=0.2)
        after_close = [r.key.decode() for r in on_disk(tmp_path)]
    finally:
        p._thread.join(5)  # let the stuck thread finish before tmp_path goes away
    assert after_close == [f"c{i}" for i in range(10)]


def test_close_does_not_wait_out_a_connection_attempt_that_holds_nothing(
    tmp_path: Path, fast_refusal: Refusal
) -> None:
    """With the broker away, the thread spends seconds in each connection attempt. close() takes
    the queue over instead of waiting, and the thread, when its attempt ends, leaves it alone."""
    fast_refusal.delay = 1.5
    p = producer(tmp_path, queue_size=100)
    p.start()
    wait_until(lambda: fast_refusal.attempts > 0, 2, "the first connection attempt", 0.01)
    for i in range(10):
        p.submit(outgoing(feedback(i), f"c{i}"))
    started = time.monotonic()
    try:
        p.close(timeout_s=10)
        took = time.monotonic() - started
        after_close = [r.key.decode() for r in on_disk(tmp_path)]
    finally:
        p._thread.join(5)
    assert took < 1.0, f"close() waited {took:.2f}s for a connection attempt"
    assert after_close == [f"c{i}" for i in range(10)]
    assert [r.key.decode() for r in on_disk(tmp_path)] == after_close, "the thread wrote after"
    assert p.spooled == 10 and p.dropped == 0


def test_submit_after_close_is_not_silently_lost(tmp_path: Path, fast_refusal: Refusal) -> None:
    """A record submitted after close() is either refused (and counted) or still written."""
    p = producer(tmp_path)
    p.start()
    p.close()
    accepted = p.submit(outgoing(feedback(1), "late"))
    if accepted:
        assert [r.key for r in on_disk(tmp_path)] == [b"late"], "accepted, then lost"
    else:
        assert p.dropped == 1


def test_close_without_start_spools_the_queue(tmp_path: Path) -> None:
    """A service that fails between building and starting its producer still closes it."""
    p = producer(tmp_path)
    p.submit(outgoing(feedback(0), "a"))
    errors: list[BaseException] = []
    done = threading.Event()

    def close() -> None:
        try:
            p.close(timeout_s=1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=close, daemon=True).start()
    assert done.wait(5), "close() hung"
    assert errors == []
    assert [r.key for r in on_disk(tmp_path)] == [b"a"]


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_kafka_client_options_plaintext(compression: str) -> None:
    opts = KafkaSettings(compression=compression).client_options()
    assert opts == {"security_protocol": "PLAINTEXT"}


def test_make_consumer_lets_a_caller_override_its_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ratchet.settings import KafkaSettings

    seen: dict[str, Any] = {}
    monkeypatch.setattr(bus, "KafkaConsumer", lambda *topics, **options: seen.update(options))
    bus.make_consumer("b:9092", KafkaSettings(), ["t"], "g", auto_offset_reset="latest")
    assert seen["auto_offset_reset"] == "latest"  # was a TypeError: given twice
    assert seen["enable_auto_commit"] is False and seen["group_id"] == "g"


def test_consumers_take_the_session_timeout_and_heartbeat_at_a_third_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ratchet.settings import KafkaSettings

    seen: dict[str, Any] = {}
    monkeypatch.setattr(bus, "KafkaConsumer", lambda *topics, **options: seen.update(options))
    bus.make_consumer("b:9092", KafkaSettings(session_timeout_ms=9000), ["t"], "g")
    assert (seen["session_timeout_ms"], seen["heartbeat_interval_ms"]) == (9000, 3000)


def test_a_full_spool_keeps_the_oldest_and_refuses_the_rest(tmp_path: Path) -> None:
    one_line = (
        len(orjson.dumps({"topic": TRAFFIC_TOPIC, "key": "k0", "value": rec(0).value.decode()})) + 1
    )
    spool = Spool(tmp_path / "spool", max_bytes=10 * one_line)
    assert spool.append([rec(i) for i in range(4)]) == 4
    assert spool.append([rec(i) for i in range(4, 20)]) == 6  # in order, until it is full
    assert spool.bytes == 10 * one_line and spool.pending == 10
    spool.close()
    again = Spool(tmp_path / "spool", max_bytes=10 * one_line)  # a restart counts what is there
    assert again.bytes == 10 * one_line and again.append([rec(99)]) == 0
    segments = list(again.drain())
    assert numbers([r for _, records in segments for r in records]) == list(range(10))
    for path, records in segments:
        again.remove(path, len(records))
    assert again.bytes == 0 and again.pending == 0 and not again.segments()
    assert again.append([rec(99)]) == 1


def test_the_producer_counts_what_a_full_spool_drops(tmp_path: Path, fast_refusal: Refusal) -> None:
    p = producer(tmp_path, queue_size=1000, spool_max_bytes=4096)
    for i in range(100):
        p.submit(outgoing(feedback(i), f"c{i}"))
    p.start()
    p.close()
    kept = [r.key.decode() for r in on_disk(tmp_path)]
    assert 0 < len(kept) < 100 and kept == [f"c{i}" for i in range(len(kept))]  # the oldest
    assert p.spooled == len(kept) and p.spool_full == p.dropped == 100 - len(kept)

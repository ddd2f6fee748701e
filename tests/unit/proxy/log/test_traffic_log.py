"""The proxy's traffic log: frames down a pipe to a real log worker process, which makes the
records and, with the broker's port closed here, spools them to disk. Delivery to a real broker
is covered by tests/integration (test_proxy, test_faults)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from embedded.processes import free_port as closed_port
from embedded.processes import wait_until, wait_until_async
from proxy.log.exchange import REDACTED
from proxy.log.pipe import WORKER_TOTALS, TrafficLog
from proxy.log.spool import Spool
from proxy.log.worker import (
    EXCHANGE,
    RECORD,
    ExchangeMeta,
    WorkerConfig,
    encode_frame,
    read_frame,
)
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord
from ratchet.settings import KafkaSettings

CHAT = {"model": "support", "messages": [{"role": "user", "content": "my card is 4111-1111"}]}
ANSWER = {
    "id": "chatcmpl-1",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2},
}


def config(tmp_path: Path) -> WorkerConfig:
    return WorkerConfig(
        bootstrap=f"127.0.0.1:{closed_port()}",
        kafka=KafkaSettings(),
        spool_dir=tmp_path / "spool",
        topics=[TRAFFIC_TOPIC, FEEDBACK_TOPIC],
        queue_size=1000,
        redact_patterns=[r"\d{4}-\d{4}"],
        report_s=0.05,
    )


def meta(request_id: str, *, stream: bool = False, started_at: float = 1_700_000_000.0) -> bytes:
    fields = ExchangeMeta(
        request_id=request_id,
        endpoint="chat.completions",
        alias="support",
        served_name="support@v3",
        version=3,
        canary_arm="canary",
        stream=stream,
        api_key_hash="h" * 64,
        logged=True,
        status=200,
        error=None,
        latency_ms=12.5,
        ttft_ms=3.0 if stream else None,
        started_at=started_at,
    )
    return orjson.dumps(fields)


def spooled(tmp_path: Path) -> list[tuple[str, bytes | None, dict[str, object]]]:
    return [
        (r.topic, r.key, orjson.loads(r.value))
        for _, records in Spool(tmp_path / "spool").drain()
        for r in records
    ]


def test_frames_read_back_as_written_and_a_torn_frame_is_the_end() -> None:
    frames = encode_frame(EXCHANGE, b'{"a":1}', b"request", b"answer") + encode_frame(
        RECORD, b"{}", b"", b"value"
    )
    stream = io.BytesIO(frames + encode_frame(RECORD, b"{}", b"", b"torn")[:-2])
    assert read_frame(stream) == (EXCHANGE, b'{"a":1}', b"request", b"answer")
    assert read_frame(stream) == (RECORD, b"{}", b"", b"value")
    assert read_frame(stream) is None


async def test_exchanges_and_feedback_become_records_with_tokens_reported(tmp_path: Path) -> None:
    tokens: list[tuple[str, str, str, str, int]] = []
    log = TrafficLog(config(tmp_path), on_tokens=lambda *t: tokens.append(t))  # type: ignore[arg-type]
    await log.start()
    body = orjson.dumps(CHAT)
    assert log.submit_exchange(meta("r1"), body, orjson.dumps(ANSWER))
    stream = (
        b'data: {"id":"c2","choices":[{"index":0,"delta":{"role":"assistant","content":"He"}}]}\n\n'
        b'data: {"id":"c2","choices":[{"index":0,"delta":{"content":"llo"},'
        b'"finish_reason":"stop"}]}\n\n'
        b'data: {"id":"c2","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert log.submit_exchange(meta("r2", stream=True), body, stream)
    assert log.submit(FeedbackRecord(completion_id="c2", score=0.5), key="c2")
    await wait_until_async(lambda: log.spooled == 3, 30, "log.spooled == 3")
    await log.close()
    assert log.depth == 0 and log.dropped == 0

    records = {key: (topic, value) for topic, key, value in spooled(tmp_path)}
    topic, first = records[b"r1"]
    assert topic == TRAFFIC_TOPIC
    assert first["ts"] == "2023-11-14T22:13:20.000Z"  # when the request arrived
    assert first["request"]["messages"][0]["content"] == "my card is [REDACTED]"
    assert first["choices"][0]["message"]["content"] == "ok"
    assert first["gen_ai.response.model"] == "support@v3" and first["canary_arm"] == "canary"
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (7, 2)
    _, second = records[b"r2"]
    assert second["choices"][0]["message"]["content"] == "Hello" and second["stream"] is True
    assert records[b"c2"] == (FEEDBACK_TOPIC, records[b"c2"][1])
    assert records[b"c2"][1]["score"] == 0.5
    by_direction: dict[str, int] = {}
    for alias, version, arm, direction, n in tokens:
        assert (alias, version, arm) == ("support", "3", "canary")
        by_direction[direction] = by_direction.get(direction, 0) + n
    assert by_direction == {"input": 12, "output": 5}


async def test_a_ratings_comment_and_id_are_redacted_in_its_record_and_key(tmp_path: Path) -> None:
    """Audit N-5: the feedback ``comment`` (4096 characters of free text) and the rated id (the
    client's own ``request_id`` in it) reached ratchet.feedback as sent. The worker redacts
    them, and the record's key, as it redacts traffic; the score and the rest stay."""
    log = TrafficLog(config(tmp_path))
    await log.start()
    rating = FeedbackRecord(
        completion_id="chatcmpl-1234-5678", score=1.0, comment="call 4111-1111 again"
    )
    assert log.submit(rating, key="chatcmpl-1234-5678")
    await wait_until_async(lambda: log.spooled == 1, 30, "log.spooled == 1")
    await log.close()
    [(topic, key, record)] = spooled(tmp_path)
    assert topic == FEEDBACK_TOPIC and key == b"chatcmpl-[REDACTED]"
    assert record["completion_id"] == "chatcmpl-[REDACTED]"
    assert record["comment"] == "call [REDACTED] again" and record["score"] == 1.0
    assert log.redact_over_budget == 0


async def test_a_record_past_its_redaction_budget_is_logged_replaced_and_counted(
    tmp_path: Path,
) -> None:
    """Fail closed: the record still goes out, with no text as sent, marked cut (the judge
    skips a cut request) and counted for the proxy's metric."""
    log = TrafficLog(dataclasses.replace(config(tmp_path), redact_budget_s=-1.0))  # spent at once
    await log.start()
    log.submit_exchange(meta("r1"), orjson.dumps(CHAT), orjson.dumps(ANSWER))
    await wait_until_async(lambda: log.spooled == 1, 30, "log.spooled == 1")
    await log.close()
    assert log.redact_over_budget == 1 and log.dropped == 0
    [(_, _, record)] = spooled(tmp_path)
    assert b"4111" not in orjson.dumps(record) and b"ok" not in orjson.dumps(record["choices"])
    assert record["request"] == {REDACTED: [{REDACTED: REDACTED}]}  # keys replaced too
    assert record["truncated"] == ["request", "answer"]


async def test_a_killed_worker_is_replaced_and_its_loss_counted(tmp_path: Path) -> None:
    log = TrafficLog(config(tmp_path))
    await log.start()
    body, answer = orjson.dumps(CHAT), orjson.dumps(ANSWER)
    for i in range(5):
        log.submit_exchange(meta(f"before-{i}"), body, answer)
    await wait_until_async(lambda: log.spooled == 5, 30, "log.spooled == 5")
    process = log._process
    assert process is not None
    os.kill(process.pid, signal.SIGKILL)
    await wait_until_async(lambda: log.restarts == 1, 30, "log.restarts == 1")
    for i in range(5):  # taken while the new worker starts, then handed to it
        log.submit_exchange(meta(f"after-{i}"), body, answer)
    await wait_until_async(lambda: log.spooled == 10, 30, "log.spooled == 10")
    await log.close()
    keys = sorted(key for _, key, _ in spooled(tmp_path) if key is not None)
    assert keys == sorted(f"{when}-{i}".encode() for when in ("before", "after") for i in range(5))
    assert log.dropped == 0  # it died holding nothing


async def test_nothing_is_taken_once_closing_and_a_full_queue_refuses(tmp_path: Path) -> None:
    log = TrafficLog(config(tmp_path))
    log.queue_size = 3
    for i in range(3):  # no worker yet: they wait here
        assert log.submit(FeedbackRecord(completion_id=f"c{i}", score=1.0), key=f"c{i}")
    assert not log.submit(FeedbackRecord(completion_id="c3", score=1.0), key="c3")
    assert log.dropped == 1 and log.depth == 3
    await log.start()
    await wait_until_async(lambda: log.spooled == 3, 30, "log.spooled == 3")
    await log.close()
    assert not log.submit(FeedbackRecord(completion_id="late", score=1.0), key="late")
    assert log.dropped == 2
    assert sorted(key for _, key, _ in spooled(tmp_path)) == [b"c0", b"c1", b"c2"]


@pytest.mark.parametrize("kind", [EXCHANGE, 7])
async def test_a_frame_the_worker_cannot_read_is_dropped_and_counted(
    tmp_path: Path, kind: int
) -> None:
    log = TrafficLog(config(tmp_path))
    await log.start()
    process = log._process
    assert process is not None and process.stdin is not None
    frame = encode_frame(kind, b"{not json", b"", b"")
    process.stdin.write(frame)
    log._handed(frame, 1)
    log.submit(FeedbackRecord(completion_id="ok", score=1.0), key="ok")
    await wait_until_async(
        lambda: log.spooled == 1 and log.dropped == 1, 30, "log.spooled == 1 and log.dropped == 1"
    )
    await log.close()
    assert log.restarts == 0


@contextlib.contextmanager
def silent_broker() -> Iterator[str]:
    """A port that accepts connections and never answers: every connection attempt by the
    worker's producer takes its full 2 s bootstrap timeout, holding the records it was given."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


async def test_a_worker_killed_holding_records_loses_none_of_them(tmp_path: Path) -> None:
    with silent_broker() as bootstrap:
        log = TrafficLog(dataclasses.replace(config(tmp_path), bootstrap=bootstrap))
        await log.start()
        body, answer = orjson.dumps(CHAT), orjson.dumps(ANSWER)
        for i in range(20):
            log.submit_exchange(meta(f"held-{i}"), body, answer)
        # Durable (reported received) while the producer is still connecting: nothing is sent
        # or spooled yet, so without the journal all 20 die with the worker.
        await wait_until_async(lambda: log._received == 20, 10, "20 frames made durable")
        assert log.spooled == 0
        process = log._process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        await wait_until_async(lambda: log.restarts == 1, 30, "log.restarts == 1")
        await wait_until_async(lambda: log.recovered == 20, 30, "the journal spooled")
        # Frames it read but never made durable are handed to the next worker instead.
        for i in range(5):
            log.submit_exchange(meta(f"unread-{i}"), body, answer)
        log._flush()
        process = log._process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        await wait_until_async(lambda: log.restarts == 2, 30, "log.restarts == 2")
        await log.close()
    keys = [key for _, key, _ in spooled(tmp_path) if key is not None]
    expected = {f"held-{i}".encode() for i in range(20)}
    expected |= {f"unread-{i}".encode() for i in range(5)}
    assert set(keys) == expected  # duplicates allowed (at least once), losses not
    assert log.dropped == 0
    assert log.resent + log.recovered >= 25
    assert not list((tmp_path / "spool" / "journal").glob("journal-*"))  # all settled at stop


async def test_a_worker_alive_but_stuck_is_replaced_and_the_next_exchange_logged(
    tmp_path: Path,
) -> None:
    """Audit C-1: nothing replaced a worker that hung. This one is stopped (SIGSTOP: alive,
    handling nothing); the watchdog kills it, the frame it held is counted lost, and a new worker
    logs what comes next."""
    # Above a new worker's start on a loaded machine (about 1 s here), or the new one is killed too.
    log = TrafficLog(dataclasses.replace(config(tmp_path), stuck_after_s=5.0))
    await log.start()
    body, answer = orjson.dumps(CHAT), orjson.dumps(ANSWER)
    log.submit_exchange(meta("before"), body, answer)
    await wait_until_async(lambda: log.spooled == 1, 30, "log.spooled == 1")
    process = log._process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        log.submit_exchange(meta("held"), body, answer)
        await wait_until_async(lambda: log.restarts == 1, 60, "the stuck worker replaced")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    assert log.stuck == 1 and log.dropped == 1
    log.submit_exchange(meta("after"), body, answer)
    await wait_until_async(lambda: log.spooled == 2, 30, "log.spooled == 2")
    await log.close()
    assert sorted(key for _, key, _ in spooled(tmp_path)) == [b"after", b"before"]
    assert log.restarts == 1


# A proxy in a process of its own: starts its log worker, waits until the worker has journaled a
# record (so it is past its start), writes the worker's pid to argv[2], and waits to be killed.
PROXY_WITH_WORKER = """
import asyncio, sys, time
from pathlib import Path
from proxy.log.pipe import TrafficLog
from proxy.log.worker import RECORD, WorkerConfig, encode_frame
from ratchet.records import TRAFFIC_TOPIC
from ratchet.settings import KafkaSettings

async def main() -> None:
    spool = Path(sys.argv[2]).parent / "spool"
    config = WorkerConfig(sys.argv[1], KafkaSettings(), spool, [TRAFFIC_TOPIC], 10, report_s=0.05)
    log = TrafficLog(config)
    await log.start()
    meta = ('{"topic": "%s", "key": null}' % TRAFFIC_TOPIC).encode()
    log._submit(encode_frame(RECORD, meta, b"", b"{}"))
    deadline = time.monotonic() + 30
    while log._received < 1:  # the worker is past its start: it has handled a record
        if time.monotonic() > deadline:
            raise SystemExit("the log worker handled no record within 30 s")
        await asyncio.sleep(0.02)
    Path(sys.argv[2]).write_text(str(log._process.pid))
    await asyncio.Event().wait()

asyncio.run(main())
"""


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's reaper may be slow, or absent in a
    container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_stuck_when_its_proxy_is_killed_hard_dies_with_it(tmp_path: Path) -> None:
    """A worker that is stuck (here SIGSTOPped) never reads the end of its pipe; when its proxy was
    SIGKILLed it stayed, orphaned. It must die with the proxy."""
    pid_file = tmp_path / "worker.pid"
    bootstrap = f"127.0.0.1:{closed_port()}"
    proxy = subprocess.Popen([sys.executable, "-c", PROXY_WITH_WORKER, bootstrap, str(pid_file)])
    worker = 0
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 60, "the worker")
        worker = int(pid_file.read_text())
        os.kill(worker, signal.SIGSTOP)
        proxy.kill()
        proxy.wait(30)
        wait_until(lambda: not running(worker), 30, "the worker gone with its proxy")
    finally:
        proxy.kill()
        if worker and running(worker):
            os.kill(worker, signal.SIGKILL)


def test_the_frame_dropped_for_a_stuck_worker_is_the_one_it_was_handling(tmp_path: Path) -> None:
    """Frames it reported handled go on (to its journal's reader and the next worker); frames it
    never read go to the next worker as never handed; only the one in hand is dropped."""
    log = TrafficLog(config(tmp_path))
    frames = [encode_frame(RECORD, b"{}", b"", bytes([i])) for i in range(4)]
    for frame in frames:
        log._handed(frame, 1)
    log._apply(
        {
            "received": 1,
            "read": 2,
            "depth": 0,
            "dropped": 0,
            "spool_pending": 0,
            "connected": False,
            "tokens": [],
            **dict.fromkeys(WORKER_TOTALS, 0),
        }
    )
    log._drop_stuck_frame()
    assert list(log._unconfirmed) == [(frames[1], 1), (frames[3], 0)]
    assert log.stuck == 1 and log.dropped == 1
    assert log._unconfirmed_bytes == len(frames[1]) + len(frames[3])


async def test_an_idle_worker_or_one_confirming_is_not_stalled(tmp_path: Path) -> None:
    log = TrafficLog(dataclasses.replace(config(tmp_path), stuck_after_s=1.0))
    assert not log.stalled()  # holds nothing
    log._handed(b"frame", 1)
    log._progress_at -= 2.0
    assert log.stalled()
    log._confirm(1)  # it confirmed: progress
    assert not log.stalled() and not log._unconfirmed

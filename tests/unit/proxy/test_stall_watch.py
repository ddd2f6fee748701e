"""The stall watch (proxy/stall.py) without a network and without real timing: the deadline is
a clock the test fires, answers and probes are futures the test resolves. Requests whose answers
are slow share one probe per replica, wait on while it finds the engine working, and all end as
Stalled when it does not; an answer in time costs no probe, a client's cancel is not a stall,
and an answer that arrives in the same loop turn as a stalled verdict is returned, not lost.

The gap watch (a body silent mid-way) the same way on a test's clock, then through the proxy's
client on a stand-in vLLM that sends two events and hangs (a fault the real vLLM cannot be made
to have): the stream ends Stalled, a 504 upstream_stalled against its replica; a slow engine
that answers its probe, and a client that stops reading, are no stall."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from embedded.processes import wait_until_async
from proxy.stall import GapWatch, Stalled, StallWatch
from proxy.upstream import FaultPolicy, Upstream, stream_dropped
from ratchet.ejection import EjectionPolicy


class Clock:
    """The watch's timers, fired when the test says the deadline has passed."""

    class Timer:
        def __init__(self, callback: Callable[[], None]) -> None:
            self.callback, self.cancelled = callback, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.timers: list[Clock.Timer] = []

    def schedule(self, _delay_s: float, callback: Callable[[], None]) -> Clock.Timer:
        timer = Clock.Timer(callback)
        self.timers.append(timer)
        return timer

    @property
    def pending(self) -> int:
        return sum(not timer.cancelled for timer in self.timers)

    def pass_deadline(self) -> None:
        """Fire every timer set so far (those the firing sets wait for the next call)."""
        due, self.timers = self.timers, []
        for timer in due:
            if not timer.cancelled:
                timer.callback()


class Engines:
    """Probes answered as told, each once the test releases it: a replica in ``dead`` sends
    nothing."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.asked: list[str] = []
        self.held = asyncio.Event()

    async def probe(self, url: str, key: str) -> bool:
        assert key == "m"
        self.asked.append(url)
        await self.held.wait()
        return url not in self.dead


def watched(watch: StallWatch, url: str, answer: asyncio.Future[object]) -> asyncio.Task[object]:
    return asyncio.create_task(watch.wait(url, "m", answer))


def answer_later() -> asyncio.Future[object]:
    return asyncio.get_running_loop().create_future()


async def test_an_answer_in_time_costs_no_probe() -> None:
    engines, clock = Engines(), Clock()
    watch = StallWatch(1.0, engines.probe, clock.schedule)
    answer = answer_later()
    request = watched(watch, "http://a", answer)
    await wait_until_async(lambda: clock.pending == 1, 5, "the request's timer")
    answer.set_result("answer")
    assert await request == "answer"
    assert clock.pending == 0  # its timer was cancelled
    clock.pass_deadline()
    assert engines.asked == [] and watch.probes == 0


async def test_a_working_engine_is_waited_on_with_one_probe_per_deadline() -> None:
    engines, clock = Engines(), Clock()
    watch = StallWatch(1.0, engines.probe, clock.schedule)
    answers = [answer_later() for _ in range(3)]
    requests = [watched(watch, "http://a", answer) for answer in answers]
    await wait_until_async(lambda: clock.pending == 3, 5, "three timers")
    clock.pass_deadline()
    assert watch.waiting("http://a") == 3 and watch.probes == 1  # one probe for the three
    engines.held.set()
    await wait_until_async(lambda: clock.pending == 3, 5, "the three waiting on again")
    assert watch.waiting("http://a") == 0
    clock.pass_deadline()
    await wait_until_async(lambda: len(engines.asked) == 2, 5, "the second probe")
    assert watch.probes == 2 and engines.asked == ["http://a"] * 2
    for number, answer in enumerate(answers):
        answer.set_result(number)
    assert await asyncio.gather(*requests) == [0, 1, 2]
    assert watch.probes == 2


async def test_a_stalled_engine_ends_every_request_waiting_on_it_and_no_other() -> None:
    engines, clock = Engines(), Clock()
    engines.dead.add("http://a")
    watch = StallWatch(1.0, engines.probe, clock.schedule)
    hung = [watched(watch, "http://a", answer_later()) for _ in range(2)]
    b_answer = answer_later()
    other = watched(watch, "http://b", b_answer)
    await wait_until_async(lambda: clock.pending == 3, 5, "three timers")
    clock.pass_deadline()
    assert watch.waiting("http://a") == 2 and watch.waiting("http://b") == 1
    await wait_until_async(lambda: len(engines.asked) == 2, 5, "a probe per replica")
    assert sorted(engines.asked) == ["http://a", "http://b"]
    engines.held.set()
    for task in hung:
        with pytest.raises(Stalled):
            await task
    await wait_until_async(lambda: clock.pending == 1, 5, "b waiting on")  # b's engine works
    b_answer.set_result("b")
    assert await other == "b"


async def test_a_request_its_client_cancels_is_not_taken_for_a_stall() -> None:
    engines, clock = Engines(), Clock()
    engines.dead.add("http://a")
    watch = StallWatch(1.0, engines.probe, clock.schedule)
    waiting = watched(watch, "http://a", answer_later())
    await wait_until_async(lambda: clock.pending == 1, 5, "the request's timer")
    clock.pass_deadline()
    assert watch.waiting("http://a") == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert watch.waiting("http://a") == 0  # the probe, when it ends, has no one to end
    engines.held.set()
    await wait_until_async(lambda: "http://a" not in watch._probing, 5, "the probe to end")
    assert watch._stalled == set()


async def test_an_answer_in_the_same_turn_as_a_stalled_verdict_is_returned() -> None:
    """The probe finds no first byte, but the request's answer comes in that same loop turn
    (its wake-up is queued, it has not run): the answer is the request's, not a Stalled that
    would drop it (and, for a response, its connection)."""
    clock = Clock()
    answer = answer_later()

    async def late_probe(_url: str, _key: str) -> bool:
        answer.set_result("answer")  # arrives just as the probe gives up
        return False

    watch = StallWatch(1.0, late_probe, clock.schedule)
    request = watched(watch, "http://a", answer)
    await wait_until_async(lambda: clock.pending == 1, 5, "the request's timer")
    clock.pass_deadline()
    assert await request == "answer"
    assert watch._stalled == set() and watch.waiting("http://a") == 0


# ---- a body that goes silent mid-way (GapWatch) ------------------------------------------------


class Body:
    """A followed answer as the gap watch sees it: its reader's pending wait (a new object for
    each wait, None while the reader is not waiting), and how it was ended."""

    def __init__(self) -> None:
        self.awaited: object | None = None
        self.ended: BaseException | None = None

    def waits(self) -> None:
        """The reader drained what came and waits for more (a new wait)."""
        self.awaited = object()

    def abort(self, error: BaseException) -> None:
        self.ended = error


class Now:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gap_watch(engines: Engines, now: Now) -> tuple[GapWatch, list[tuple[str, int]]]:
    stalls: list[tuple[str, int]] = []
    watch = GapWatch(1.0, engines.probe, lambda url, n: stalls.append((url, n)), now)
    return watch, stalls


async def sweep_at(watch: GapWatch, engines: Engines, now: Now, t: float) -> None:
    now.t = t
    watch.sweep()
    # Every probe the sweeps started has taken its first step (asked its engine).
    await wait_until_async(lambda: len(engines.asked) == watch.probes, 5, "the probes asked")


async def test_bodies_silent_past_the_deadline_share_a_probe_and_end_stalled_if_it_fails() -> None:
    engines, now = Engines(), Now()
    engines.dead.add("http://a")
    watch, stalls = gap_watch(engines, now)
    silent = [Body(), Body()]
    other = Body()  # another replica's, silent as long: its engine answers the probe
    for body in silent:
        watch.follow(body, "http://a", "m")
        body.waits()
    watch.follow(other, "http://b", "m")
    other.waits()
    await sweep_at(watch, engines, now, 0.0)  # first seen waiting
    await sweep_at(watch, engines, now, 0.75)
    assert watch.probes == 0  # not yet a deadline since first seen
    await sweep_at(watch, engines, now, 1.0)
    assert sorted(engines.asked) == ["http://a", "http://b"]  # one probe per replica
    await sweep_at(watch, engines, now, 1.25)
    assert watch.probes == 2  # none more while they are out
    now.t = 1.5
    engines.held.set()
    await wait_until_async(lambda: not watch._probing, 5, "the probes' verdicts")
    for body in silent:
        assert isinstance(body.ended, Stalled)
    assert other.ended is None and stalls == [("http://a", 2)]
    assert watch.followed == 1  # the ended ones are no longer followed


async def test_a_reader_that_is_not_waiting_is_never_taken_for_vllms_silence() -> None:
    """Back-pressure: the proxy is writing to a client who stopped reading, so it has no wait
    pending on vLLM however long that lasts; bytes coming often (a new wait each sweep) are no
    silence either."""
    engines, now = Engines(), Now()
    watch, _ = gap_watch(engines, now)
    blocked, busy = Body(), Body()
    watch.follow(blocked, "http://a", "m")
    watch.follow(busy, "http://a", "m")
    for step in range(40):  # ten deadlines
        busy.waits()
        await sweep_at(watch, engines, now, step * 0.25)
    assert watch.probes == 0 and engines.asked == []
    watch.unfollow(busy)  # its answer ended
    blocked.waits()  # the client reads again and the proxy waits on vLLM: the clock starts now
    await sweep_at(watch, engines, now, 10.0)
    await sweep_at(watch, engines, now, 10.75)
    assert watch.probes == 0
    await sweep_at(watch, engines, now, 11.0)
    assert watch.probes == 1


async def test_a_silent_body_on_an_engine_that_answers_the_probe_waits_on() -> None:
    engines, now = Engines(), Now()
    engines.held.set()
    watch, stalls = gap_watch(engines, now)
    slow = Body()
    watch.follow(slow, "http://a", "m")
    slow.waits()
    await sweep_at(watch, engines, now, 0.0)
    await sweep_at(watch, engines, now, 1.0)
    await wait_until_async(lambda: not watch._probing, 5, "the probe's verdict")
    assert slow.ended is None and watch.probes == 1
    await sweep_at(watch, engines, now, 1.75)  # a deadline from the verdict, not the first sight
    assert watch.probes == 1
    await sweep_at(watch, engines, now, 2.0)
    assert watch.probes == 2
    await wait_until_async(lambda: not watch._probing, 5, "the second verdict")
    assert slow.ended is None and stalls == []


async def test_bytes_that_come_while_the_probe_is_out_keep_the_body() -> None:
    engines, now = Engines(), Now()
    engines.dead.add("http://a")
    watch, stalls = gap_watch(engines, now)
    body = Body()
    watch.follow(body, "http://a", "m")
    body.waits()
    await sweep_at(watch, engines, now, 0.0)
    await sweep_at(watch, engines, now, 1.0)
    assert watch.probes == 1
    body.waits()  # an event came, and the reader waits again
    engines.held.set()
    await wait_until_async(lambda: not watch._probing, 5, "the probe's verdict")
    assert body.ended is None and stalls == []
    watch.unfollow(body)  # released: no longer looked at
    await sweep_at(watch, engines, now, 5.0)
    assert watch.followed == 0 and watch.probes == 1


# ---- the same through the proxy's client, on a replica that sends two events, then nothing ----

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def event(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


EVENT = event(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
DONE = event(b"data: [DONE]\n\n") + b"0\r\n\r\n"


async def replica(answer: Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]) -> str:
    """A stand-in vLLM on a socket: each POST answered by ``answer`` (its request line and
    body), the probe (one token) included."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Cancelled when the test's loop closes: a hung answer ends only then.
        ending = (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError)
        with contextlib.suppress(*ending):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                body = await reader.readexactly(int(length.group(1)) if length else 0)
                await answer(body, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    SERVERS.append(server)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


SERVERS: list[asyncio.Server] = []


@pytest.fixture(autouse=True)
async def close_servers() -> AsyncIterator[None]:
    yield
    while SERVERS:
        SERVERS.pop().close()


def watched_upstream(url: str) -> Upstream:
    faults = FaultPolicy(EjectionPolicy(1), first_byte_timeout_s=5.0, stream_gap_timeout_s=0.2)
    upstream = Upstream([url], 1.0, 30.0, faults=faults)
    upstream.endpoints[url].healthy = True
    return upstream


async def test_a_stream_that_hangs_after_two_events_ends_stalled_against_its_replica() -> None:
    """The engine wedges mid-stream: two events, then nothing for the stream and nothing for a
    probe (its headers come, as vLLM's API server sends them, then no byte)."""

    async def wedges(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD)
        if b'"max_tokens":1' not in body:
            writer.write(EVENT + EVENT)
        await writer.drain()
        await asyncio.Event().wait()  # hung: the fault simulated

    url = await replica(wedges)
    upstream = watched_upstream(url)
    assert upstream.gap_watch is not None
    sweeping = asyncio.create_task(upstream.gap_watch.run())
    try:
        response = await upstream.post("chat.completions", b'{"stream":true}', key="m")
        got = b""
        with pytest.raises(Stalled) as caught:
            async for chunk in response.iter_any():
                got += chunk
        assert got.count(b"data: ") == 2  # both events were relayed before the stall
        error = stream_dropped(caught.value)
        assert (error.status, error.code) == (504, "upstream_stalled")
        response.release()
        replica_ = upstream.endpoints[url]
        assert replica_.stream_stalls == 1 and replica_.outstanding == 0
        assert upstream.outliers.record(url).consecutive == 1  # counted against it
        assert upstream.gap_watch.followed == 0
    finally:
        sweeping.cancel()
        await upstream.close()


async def test_a_slow_engine_mid_stream_and_a_client_not_reading_are_no_stall() -> None:
    """A pause of four deadlines between two events while the engine answers its probe at
    once; then a reader that stops reading for four deadlines while vLLM sends on."""

    async def pauses(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + EVENT)
        if b'"max_tokens":1' not in body:
            await writer.drain()
            await asyncio.sleep(0.8)  # a long step (preempted, say): the engine still works
            for _ in range(20):
                writer.write(EVENT)
                await writer.drain()
                await asyncio.sleep(0.05)
        writer.write(DONE)

    url = await replica(pauses)
    upstream = watched_upstream(url)
    assert upstream.gap_watch is not None
    sweeping = asyncio.create_task(upstream.gap_watch.run())
    try:
        response = await upstream.post("chat.completions", b'{"stream":true}', key="m")
        got = await upstream.read(response)
        assert got.count(b"data: ") == 22 and upstream.gap_watch.probes >= 1

        probes = upstream.gap_watch.probes
        response = await upstream.post("chat.completions", b'{"stream":true}', key="m")
        chunks = response.iter_any()
        await anext(chunks)
        started = time.monotonic()
        await asyncio.sleep(1.2)  # the client stopped reading; the proxy reads nothing
        async for _ in chunks:
            pass
        assert time.monotonic() - started >= 1.2
        response.release()
        assert upstream.endpoints[url].stream_stalls == 0
        assert not upstream.outliers.is_ejected(url, time.monotonic())
        assert upstream.gap_watch.probes == probes  # vLLM's pause fell while no one read
    finally:
        sweeping.cancel()
        await upstream.close()


# ---- through the proxy app: the client's error event, in its API's shape -----------------------


async def wedged_engine(request: web.Request) -> web.StreamResponse:
    """Two events of the answer, then nothing; the probe (one token) gets its headers only."""
    asked = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if asked.get("max_tokens") != 1:
        head = {"id": "c1", "object": "chat.completion.chunk", "model": asked["model"]}
        for text in ("Hel", "lo"):
            delta = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            await response.write(b"data: " + orjson.dumps(head | {"choices": [delta]}) + b"\n\n")
    await asyncio.Event().wait()  # hung: cancelled at the test's end
    return response


async def test_a_client_gets_an_error_event_in_its_apis_shape_and_a_504_is_counted(
    proxy_with: Any, upstream: dict[str, Any]
) -> None:
    upstream["handler"] = wedged_engine
    settings = {
        "upstream_timeout_s": 60,
        "upstream_first_byte_timeout_s": 5,
        "upstream_stream_gap_timeout_s": 0.2,
    }
    async with proxy_with(**settings) as (client, state):
        chat = {"model": "support", "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post("/v1/chat/completions", json=chat | {"stream": True})
        assert response.status_code == 200
        events = response.content.strip().split(b"\n\n")
        assert len(events) == 3  # the two events, then the error
        error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_stalled" and error["type"] == "server_error"

        messages = {"model": "support", "max_tokens": 16, "stream": True}
        response = await client.post("/v1/messages", json=messages | chat)
        assert response.status_code == 200
        last = response.content.strip().split(b"\n\n")[-1].split(b"\n")
        assert last[0] == b"event: error"
        assert orjson.loads(last[1].removeprefix(b"data: "))["error"]["type"] == "api_error"

        url = upstream["url"]
        assert state.upstream.endpoints[url].stream_stalls == 2
        assert state.upstream.outliers.record(url).consecutive == 2
        errors = state.metrics.errors.labels("upstream_stalled")._value.get()
        assert errors == 2


async def test_closing_the_gap_watch_ends_every_probe_out() -> None:
    """At shutdown a probe still out is cancelled and awaited: no task is left pending."""
    engines, now = Engines(), Now()
    watch, _ = gap_watch(engines, now)
    body = Body()
    watch.follow(body, "http://a", "m")
    body.waits()
    await sweep_at(watch, engines, now, 0.0)
    await sweep_at(watch, engines, now, 1.0)  # a probe out, held by the engine
    probing = list(watch._probing.values())
    assert len(probing) == 1 and not probing[0].done()
    await watch.close()
    assert all(task.done() for task in probing)

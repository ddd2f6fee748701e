"""The stall watch (proxy/stall.py) without a network and without real timing: the deadline is
a clock the test fires, answers and probes are futures the test resolves. Requests whose answers
are slow share one probe per replica, wait on while it finds the engine working, and all end as
Stalled when it does not; an answer in time costs no probe, a client's cancel is not a stall,
and an answer that arrives in the same loop turn as a stalled verdict is returned, not lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from embedded.processes import wait_until_async
from proxy.stall import Stalled, StallWatch


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

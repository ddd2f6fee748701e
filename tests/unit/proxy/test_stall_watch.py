"""The stall watch (proxy/stall.py) without a network: requests whose answers are slow share one
probe per replica, wait on while it finds the engine working, and all end as Stalled when it
does not; an answer in time costs no probe, and a client's cancel is not a stall."""

from __future__ import annotations

import asyncio

import pytest

from embedded.processes import wait_until_async
from proxy.stall import Stalled, StallWatch


class Engines:
    """Probes answered as told: a replica in ``dead`` sends nothing; each probe waits for
    ``held`` first."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.asked: list[str] = []
        self.held = asyncio.Event()
        self.held.set()

    async def probe(self, url: str, key: str) -> bool:
        assert key == "m"
        self.asked.append(url)
        await self.held.wait()
        return url not in self.dead


async def test_an_answer_in_time_costs_no_probe() -> None:
    engines = Engines()
    watch = StallWatch(0.2, engines.probe)
    assert await watch.wait("http://a", "m", asyncio.sleep(0.01, result="answer")) == "answer"
    assert engines.asked == [] and watch.probes == 0


async def test_a_working_engine_is_waited_on_with_one_probe_per_deadline() -> None:
    engines = Engines()
    watch = StallWatch(0.1, engines.probe)
    slow = [watch.wait("http://a", "m", asyncio.sleep(0.35, result=i)) for i in range(3)]
    assert await asyncio.gather(*slow) == [0, 1, 2]
    # Three requests, three deadlines passed: a probe at each, not one per request.
    assert 1 <= watch.probes <= 4 and set(engines.asked) == {"http://a"}  # 9: one each


async def test_a_stalled_engine_ends_every_request_waiting_on_it_and_no_other() -> None:
    engines = Engines()
    engines.dead.add("http://a")
    engines.held.clear()  # the probe is out until both of a's requests wait on it
    watch = StallWatch(0.05, engines.probe)
    hung = [asyncio.create_task(watch.wait("http://a", "m", asyncio.sleep(60))) for _ in range(2)]
    other = asyncio.create_task(watch.wait("http://b", "m", asyncio.sleep(0.3, result="b")))
    await wait_until_async(lambda: watch.waiting("http://a") == 2, 5, "both on a's probe")
    assert engines.asked.count("http://a") == 1
    engines.held.set()
    for task in hung:
        with pytest.raises(Stalled):
            await task
    assert await other == "b"  # b's probe found it working


async def test_a_request_its_client_cancels_is_not_taken_for_a_stall() -> None:
    engines = Engines()
    engines.dead.add("http://a")
    engines.held.clear()
    watch = StallWatch(0.05, engines.probe)
    waiting = asyncio.create_task(watch.wait("http://a", "m", asyncio.sleep(60)))
    await wait_until_async(lambda: watch.waiting("http://a") == 1, 5, "the request on a probe")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert watch.waiting("http://a") == 0  # the probe, when it ends, has no one to end
    engines.held.set()

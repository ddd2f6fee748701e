"""console/wrong_keys.py: wrong admin keys answered at the pace of one sequential guesser,
however many guess in parallel, while the right key gets in at once. The bucket alone on a
clock of the test's own; then against the console under uvicorn, as `ratchet console` runs it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import uvicorn

from console import sessions, wrong_keys
from console.app import create_app
from console.auth import COOKIE
from console.service import server_config
from console.sessions import FAILURES_KEY
from console.wrong_keys import WrongKeys
from embedded.processes import free_port, wait_until, wait_until_async
from ratchet.lifecycle import Lifecycle
from ratchet.settings import RatchetSettings
from tests.unit.console.conftest import KEY


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_past_the_burst_wrong_keys_take_turns_one_interval_apart() -> None:
    clock = Clock()
    bucket = WrongKeys(interval_s=2.0, burst=3, queue=100, clock=clock)
    waits = [bucket.turn(0.0) for _ in range(6)]
    assert waits == [0.0, 0.0, 0.0, 2.0, 4.0, 6.0]  # six at once: as if sent one by one
    assert bucket.turn(7.5) == 8.0  # its turn, later than its own delay
    clock.now += 60  # a quiet minute fills the bucket again
    assert [bucket.turn(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.turn(5.0) == 5.0  # its own delay, later than its turn


async def test_past_the_queue_a_wrong_key_is_told_when_to_come_back() -> None:
    clock = Clock()
    bucket = WrongKeys(interval_s=1.0, burst=1, queue=1, clock=clock)
    assert bucket.turn(0.0) == 0.0
    hold = bucket.turn(0.0)
    assert hold == 1.0
    waiting = bucket.wait(hold)
    task = asyncio.ensure_future(waiting)
    await wait_until_async(lambda: bucket.waiting == 1, 5, "the hold to begin")
    assert bucket.waiting == 1
    assert bucket.turn(0.0) is None  # the queue is full: no turn taken
    assert bucket.retry_after_s() == 2  # the turn after the two taken
    task.cancel()


BUCKET_INTERVAL_S = 0.1
BUCKET_BURST = 10
GUESSES = 100


@pytest.fixture
def paced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short interval, so that the test's 100 guesses take seconds; no per-address delay, so
    only the bucket paces them."""
    monkeypatch.setattr(wrong_keys, "INTERVAL_S", BUCKET_INTERVAL_S)
    monkeypatch.setattr(wrong_keys, "BURST", BUCKET_BURST)
    monkeypatch.setattr(sessions, "BACKOFF_MAX_S", 0.0)


@pytest.fixture
def served(paced: None, settings: RatchetSettings, lifecycle: Lifecycle) -> Iterator[int]:
    config = server_config(create_app(settings, start_readers=False), settings)
    config.port = free_port()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the console to listen")
    try:
        yield config.port
    finally:
        server.should_exit = True
        thread.join(30)


async def crowd(base: str, guesses: int, refusals: list[httpx.Response]) -> list[int]:
    """``guesses`` wrong logins at once, each from a guesser who honours Retry-After (429) and
    the console's connection bound (503); each one's final status. One thread of coroutines, so
    that the guessers do not starve the console of the interpreter (it runs in this process)."""

    async def guess(client: httpx.AsyncClient, i: int) -> int:
        while True:
            answer = await client.post("/login", data={"key": f"guess-{i}"})
            if answer.status_code not in (429, 503):
                return answer.status_code
            refusals.append(answer)
            await asyncio.sleep(float(answer.headers.get("retry-after", "0.1")))

    limits = httpx.Limits(max_connections=guesses)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        return list(await asyncio.gather(*(guess(client, i) for i in range(guesses))))


def test_a_hundred_parallel_guessers_take_the_buckets_time_and_the_admin_gets_in(
    served: int, settings: RatchetSettings
) -> None:
    """Issue 54: past guard's 16 held answers, parallel guessers were answered at once (358 a
    second). Now each wrong key waits its turn: 100 at once are answered no faster than one
    guesser's 100 in a row would be, past the queue a 429 says when to come back, and the right
    key, sent while they guess, gets in at once."""
    base = f"http://127.0.0.1:{served}"
    refusals: list[httpx.Response] = []
    failures = redis.Redis.from_url(settings.redis_url)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(asyncio.run, crowd(base, GUESSES, refusals))
        wait_until(
            lambda: int(failures.get(FAILURES_KEY + "all") or 0) >= 2 * BUCKET_BURST,
            30,
            "the guessers to be under way",
        )
        # The admin logs in while they guess: polled (a 503 would be uvicorn's connection bound).
        tries: list[tuple[int, float]] = []
        admin_started = time.monotonic()
        with httpx.Client(base_url=base, timeout=30) as admin:

            def logged_in() -> bool:
                ok = admin.post("/login", data={"key": KEY, "next": "/"}, follow_redirects=False)
                tries.append((ok.status_code, time.monotonic() - admin_started))
                return ok.status_code == 303 and bool(ok.cookies.get(COOKIE))

            wait_until(logged_in, 30, "the admin to log in")
        admin_took = time.monotonic() - admin_started
        assert sorted(set(answers.result(120))) == [401]
    took = time.monotonic() - started
    bucket_s = (GUESSES - BUCKET_BURST) * BUCKET_INTERVAL_S
    assert took >= bucket_s, (took, bucket_s)
    assert admin_took < bucket_s / 4, (admin_took, bucket_s, tries)  # never waited its turn
    too_many = [r for r in refusals if r.status_code == 429]
    assert too_many, "the queue bound was never reached"
    assert all(int(r.headers["retry-after"]) >= 1 for r in too_many)
    assert all(r.json()["error"]["code"] == "too_many_wrong_keys" for r in too_many)

"""How fast the console lets a guesser try admin keys, and what the guessing costs the admin.

Run it from the repository root (about a minute)::

    .venv/bin/python bench/console_guessing.py [--seconds 20] [--guessers 48]

Method: a real redis-server and the console under uvicorn as `ratchet console` runs it
(console/service.py), on loopback. ``--guessers`` threads each send wrong keys to ``POST /login``
one after another, as fast as the answers come, for ``--seconds``; all from one address, as
behind an ingress. Meanwhile the admin logs in with the right key once a second. Reported: the
wrong keys answered per second (what a guesser gets), and the admin's login time under the attack
against the same login with nobody guessing (the peer, measured in the same run).
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import redis
import uvicorn

from console.app import create_app
from console.service import server_config
from embedded.processes import free_port, wait_until
from embedded.stack import redis_server_binary
from ratchet.settings import RatchetSettings

ADMIN_KEY = "bench-admin-key-" + "x" * 16


@contextmanager
def redis_at(folder: Path) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--save", "", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_until(lambda: _pings(url), 10, "redis-server to answer")
        yield url
    finally:
        server.terminate()
        server.wait(5)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.ConnectionError:
        return False


@contextmanager
def console_at(redis_url: str, home: Path) -> Iterator[str]:
    settings = RatchetSettings(
        redis_url=redis_url, home=home, secret="bench", proxy={"admin_key": ADMIN_KEY}
    )
    config = server_config(create_app(settings, start_readers=False), settings)
    config.port = free_port()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the console to listen")
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def login_times(base: str, count: int, every_s: float) -> list[float]:
    times = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for _ in range(count):
            started = time.perf_counter()
            answer = client.post("/login", data={"key": ADMIN_KEY}, follow_redirects=False)
            assert answer.status_code == 303, answer.status_code
            times.append(time.perf_counter() - started)
            time.sleep(every_s)
    return times


def guess(base: str, until: float, answered: list[int]) -> None:
    with httpx.Client(base_url=base, timeout=60) as client:
        while time.monotonic() < until:
            answer = client.post("/login", data={"key": "guess"})
            assert answer.status_code == 401, answer.status_code
            answered.append(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--guessers", type=int, default=48)
    args = parser.parse_args()
    logging.getLogger("console").setLevel(logging.ERROR)  # a line per wrong key otherwise
    folder = Path(tempfile.mkdtemp())
    with redis_at(folder) as url, console_at(url, folder) as base:
        idle = login_times(base, 20, 0.05)
        answered: list[int] = []
        until = time.monotonic() + args.seconds
        guessers = [
            threading.Thread(target=guess, args=(base, until, answered))
            for _ in range(args.guessers)
        ]
        for thread in guessers:
            thread.start()
        attacked = login_times(base, int(args.seconds) - 2, 1.0)
        for thread in guessers:
            thread.join()
    shutil.rmtree(folder, ignore_errors=True)
    rate = len(answered) / args.seconds
    years_128 = 2**127 / rate / (3600 * 24 * 365)
    print(f"guessers: {args.guessers} threads, {args.seconds:.0f} s, one source address")
    print(f"wrong keys answered: {rate:.0f}/s")
    print(f"years to find a 128-bit random key at that rate: 10^{math.log10(years_128):.0f}")
    idle_ms = statistics.median(idle) * 1000
    attacked_ms = statistics.median(attacked) * 1000
    print(f"admin login p50: {idle_ms:.1f} ms idle, {attacked_ms:.1f} ms under attack")
    print(f"admin login max under attack: {max(attacked) * 1000:.1f} ms")
    print(f"ratio under attack / idle: {attacked_ms / idle_ms:.2f}")


if __name__ == "__main__":
    main()

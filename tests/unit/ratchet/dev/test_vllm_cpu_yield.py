"""ratchet/dev/vllm_cpu_yield.py against vLLM's own shared-memory queue condition: after
register(), a reader with nothing to read sleeps on the notification socket instead of spinning,
and a notification still wakes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from ratchet.dev import vllm_cpu_yield

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
SpinCondition = shm_broadcast.SpinCondition
# vLLM's own, even where an earlier test in this process loaded vLLM's plugins (ours among them).
ORIGINAL_INIT = getattr(SpinCondition.__init__, "__wrapped__", SpinCondition.__init__)


def spin_pair(context: zmq.Context[zmq.Socket[bytes]]) -> tuple[Any, Any]:
    """A writer and a reader on one notification address, as vLLM's MessageQueue makes them."""
    address = f"inproc://ratchet-yield-{time.monotonic_ns()}"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    return writer, reader


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(autouse=True)
def restore_vllm() -> Iterator[None]:
    SpinCondition.__init__ = ORIGINAL_INIT
    yield
    SpinCondition.__init__ = ORIGINAL_INIT


def test_vllm_readers_spin_for_a_second_by_default(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """What the plugin exists for: if vLLM stops busy-waiting itself, the plugin can go."""
    _, reader = spin_pair(context)
    assert reader.busy_loop_s == 1


def test_after_register_a_reader_sleeps_until_notified(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    vllm_cpu_yield.register()
    vllm_cpu_yield.register()  # vLLM loads plugins once per process; twice must not stack
    writer, reader = spin_pair(context)
    assert reader.busy_loop_s == 0 and writer.busy_loop_s == 0
    # Just read: vLLM's default would return at once (one sched_yield, then the caller loops);
    # without the window the reader waits out its timeout on the socket.
    reader.record_read()
    started = time.monotonic()
    reader.wait(timeout_ms=300)
    assert time.monotonic() - started >= 0.25

    # A write's notification wakes it long before a 30 s timeout.
    woke = threading.Event()

    def wait_for_write() -> None:
        reader.record_read()
        reader.wait(timeout_ms=30_000)
        woke.set()

    thread = threading.Thread(target=wait_for_write)
    thread.start()
    deadline = time.monotonic() + 10
    while not woke.is_set() and time.monotonic() < deadline:
        writer.notify()  # PUB drops what is sent before the SUB joins: send until heard
        woke.wait(0.05)
    thread.join(10)
    assert woke.is_set()

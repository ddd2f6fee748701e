"""A vLLM plugin for the embedded stack: vLLM's engine waits for its CPU worker without spinning.

vLLM runs its worker in a second process and hands each step's input and output through a
shared-memory queue. A reader of that queue that has read in the last second (``busy_loop_s=1``
in ``vllm/distributed/device_communicators/shm_broadcast.py``'s ``SpinCondition``) polls the
queue in a loop of ``sched_yield()`` calls. On a GPU the wait is short and the host has cores to
spare. On the CPU build the worker *is* the computation, so while it computes a step the engine
process spins on the other core: measured here (2 cores, SmolLM2) vLLM took 1.97 cores with one
compute thread, leaving the learner, judge and proxy almost nothing. ``sched_yield`` does not
hand the core over under Linux's fair scheduler.

Why not simply drop the window (``busy_loop_s = 0``, so a reader always waits on the queue's
zmq notification socket)? That was this plugin's first version, and single answers became 20x
slower (0.7-1.2 tokens/s against 16, at 0.1 cores): the notification path misses wake-ups,
which vLLM itself only recovers from by re-checking every few seconds
(``SHM_READER_RECHECK_INTERVAL_MS``) and which its busy window normally hides.

:func:`register` (the ``vllm.general_plugins`` entry point ``ratchet_cpu_yield``, named in the
embedded stack's ``VLLM_PLUGINS``) keeps vLLM's window and its polling of the shared memory,
but replaces each ``sched_yield()`` of that loop with a sleep of :data:`NAP_S`: a reader still
sees a message within a fraction of a millisecond (a step here takes tens of milliseconds),
and the core it waited on is free meanwhile.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

PLUGIN_NAME = "ratchet_cpu_yield"
# Measured (bench/vllm_cpu_yield.py): 50 us answered as fast as vLLM's spin at 1.2 cores;
# 200 us cost 5-10% of single-answer speed.
NAP_S = 0.00005


def nap() -> None:
    """What a reader (or a writer waiting for room) does between two looks at the queue."""
    time.sleep(NAP_S)


def register() -> None:
    """Make vLLM's shared-memory queue nap instead of yield between looks. Idempotent (vLLM
    loads general plugins once per process, in every process)."""
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.sched_yield = nap
    log.info("%s: vLLM's queue waits nap %.2f ms instead of spinning", PLUGIN_NAME, NAP_S * 1e3)

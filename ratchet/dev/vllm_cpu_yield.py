"""A vLLM plugin for the embedded stack: vLLM's engine waits for its CPU worker without spinning.

vLLM runs its worker in a second process and hands each step's input and output through a
shared-memory queue. A reader of that queue that has read in the last second (``busy_loop_s=1``
in ``vllm/distributed/device_communicators/shm_broadcast.py``'s ``SpinCondition``) does not sleep
while it waits for the next message: it loops on ``sched_yield()``. On a GPU the wait is short
and the host has cores to spare. On the CPU build the worker *is* the computation, so while it
computes a step the engine process spins on the other core: measured here (2 cores, SmolLM2,
8 concurrent answers) vLLM took 1.9 cores with one compute thread, leaving the learner, judge and
proxy half a core. ``sched_yield`` does not hand the core over under Linux's fair scheduler.

:func:`register` (the ``vllm.general_plugins`` entry point ``ratchet_cpu_yield``, named in the
embedded stack's ``VLLM_PLUGINS``) sets that window to 0, so a reader that finds no message
waits on the queue's notification socket (the same path vLLM takes after a second idle). The
writer notifies on every message, so nothing waits longer than a socket wake-up (microseconds
against a step of tens of milliseconds here).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

PLUGIN_NAME = "ratchet_cpu_yield"


def register() -> None:
    """Give vLLM's shared-memory queue readers a busy-wait window of 0 s. Idempotent (vLLM
    loads general plugins once per process, in every process)."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    if getattr(spin.__init__, "_ratchet_no_spin", False):
        return
    original = spin.__init__

    @functools.wraps(original)  # keeps vLLM's own as __wrapped__
    def init_without_busy_wait(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = 0.0

    init_without_busy_wait._ratchet_no_spin = True  # type: ignore[attr-defined]
    spin.__init__ = init_without_busy_wait  # type: ignore[method-assign]
    log.info("%s: vLLM's queue readers wait on a socket instead of spinning", PLUGIN_NAME)

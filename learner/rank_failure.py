"""A training step that fails on one rank ends the round on every rank alike.

Under torchrun each rank trains its share of a round (learner/parallel.py). An exception in one
rank's forward, backward or optimizer step (a bad batch, an out-of-memory) used to leave that
rank's round while the others went on into the step's gradient sync, waiting in a collective
it would never join; the learner ended the process group and torchrun restarted all of it.

Now a rank that fails keeps its error (:class:`Failures`) and goes on to the step's boundary:
the all-reduce every rank joins anyway (the gradient sum, or the step's statistics) carries one
more number, how many ranks failed. When it is not zero every rank stops there, learns each
failed rank's error in one more collective (:func:`raise_agreed`) and raises
:class:`RanksFailed`: rank 0's service pauses the alias with that reason, the followers skip the
round, and no process ends. A failure after the last step's sync (the optimizer step, the step's
report) is agreed on once more at the round's end (:meth:`Failures.settle`).

What cannot be made even: a failure *inside* a collective's own work. With
``learner.sharding: fsdp`` the forward and backward gather and reduce-scatter the weights layer
by layer, so a rank that fails mid-forward leaves the others inside a gather; there it still
ends the process group (torchrun restarts it). With ``replicate`` the forward and backward are
local and the only collectives are the step's sums; a rank that dies or hangs inside one is
bounded by the round's collective timeout (learner/parallel.py, ``ROUND_COLLECTIVE_TIMEOUT``).

``RATCHET_LEARNER_FAULT_RANK`` (a test hook): every training step on that rank raises before
its first forward, the real learner otherwise (tests/integration/test_learner_ranks.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

log = logging.getLogger(__name__)

FAULT_ENV = "RATCHET_LEARNER_FAULT_RANK"

Result = TypeVar("Result")


class RanksFailed(RuntimeError):
    """A round's training failed on some ranks (each named, with its error); raised on every
    rank at the same step boundary, so none is left waiting in a collective."""


def injected_fault(rank: int) -> None:
    """The test hook: raise when ``RATCHET_LEARNER_FAULT_RANK`` names this rank."""
    if os.environ.get(FAULT_ENV) == str(rank):
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_ENV})")


class Failures:
    """This rank's first failure of the round, kept until the ranks agree on it. With one rank
    nothing is kept: the error is raised where it happens, as before."""

    def __init__(self, size: int, group: Any = None) -> None:
        self.size = size
        self.group = group
        self.own: Exception | None = None

    def run(self, work: Callable[[], Result]) -> Result | None:
        """``work``'s result; None when it failed on this rank (kept, to be agreed on)."""
        if self.size <= 1:
            return work()
        try:
            return work()
        except Exception as exc:  # agreed on at the next step boundary, raised there
            if self.own is None:
                log.warning("training failed on this rank: %r", exc)
                self.own = exc
            return None

    @property
    def flag(self) -> float:
        """What this rank adds to the step's sum: 1 when it failed."""
        return 0.0 if self.own is None else 1.0

    def check(self, failed_ranks: float) -> None:
        """At a step boundary, after the sum of every rank's :attr:`flag`: raise
        :class:`RanksFailed` on every rank when any failed."""
        if failed_ranks > 0:
            raise_agreed(self.own, self.group)

    def settle(self) -> None:
        """At the round's end: one more sum of the flags (a failure after the last step's sync)."""
        if self.size <= 1:
            return
        import torch

        flags = torch.tensor([self.flag], dtype=torch.float64)
        if dist.get_backend(self.group) == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        self.check(float(flags.item()))


def raise_agreed(own: Exception | None, group: Any = None) -> None:
    """Every rank, once the ranks know some failed: each rank's error, gathered in one
    collective, raised as :class:`RanksFailed` (from this rank's own error, if it had one)."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if own is None else f"{type(own).__name__}: {str(own)[:300]}"
    dist.all_gather_object(errors, mine, group=group)
    failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error is not None]
    raise RanksFailed("training failed on " + "; ".join(failed)) from own

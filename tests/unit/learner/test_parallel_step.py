"""A training step that fails on one rank ends the round on every rank at the same step
(learner/rank_failure.py): rank 0 raises RanksFailed naming the rank and its error (the service
pauses the alias with it), the follower skips the round, and both train the next round together.
Neither is left waiting in a collective the other never joins. A rank that hangs instead is
waited for only the round's collective timeout (learner/parallel.py), not the week between
rounds."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.parallel import follow, lead_round, send_stop
from learner.rank_failure import FAULT_ENV, RanksFailed
from learner.trainer import LoraGRPOLearner, StepProgress
from tests.unit.learner.test_parallel_load import free_port, join_group
from tests.unit.learner.test_trainer import random_groups, small_lora, tiny_model, train

__all__ = ["tiny_model"]  # the session fixture, shared with the trainer's tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3


class Faulty:
    """Rank 1's trainer: round 1 fails in its first step's forward (the test hook), round 2 in
    its last step's optimizer step (after that step's sum: agreed at the round's end), round 3
    trains. Records each round's outcome."""

    def __init__(self, trainer: LoraGRPOLearner) -> None:
        self.trainer = trainer
        self.outcomes: list[str] = []
        self.optimizer_steps = 0

    def read_adapter(self, folder: Path | None) -> Any:
        return self.trainer.read_adapter(folder)

    def set_adapter(self, read: Any) -> None:
        self.trainer.set_adapter(read)

    def train_round(self, groups: list[Any]) -> Any:
        round_number = len(self.outcomes) + 1
        if round_number == 1:
            os.environ[FAULT_ENV] = "1"
        optimizer = self.trainer.optimizer
        real_step = optimizer.step

        def failing_step(*args: Any, **kwargs: Any) -> Any:
            self.optimizer_steps += 1
            if round_number == 2 and self.optimizer_steps == STEPS:
                raise torch.OutOfMemoryError("CPU: out of memory (simulated)")
            return real_step(*args, **kwargs)

        optimizer.step = failing_step  # type: ignore[method-assign]
        try:
            stats = self.trainer.train_round(groups)
        except RanksFailed as exc:
            self.outcomes.append(f"failed: {exc}")
            raise
        finally:
            os.environ.pop(FAULT_ENV, None)
            optimizer.step = real_step  # type: ignore[method-assign]
            self.optimizer_steps = 0
        self.outcomes.append(f"trained {stats.steps} steps")
        return stats


def rank_main(rank: int, model: str, port: int, out: str) -> None:
    # A collective left waiting errs after a minute rather than in a week: the test's deadline.
    join_group(rank, port, datetime.timedelta(seconds=60))
    try:
        trainer = LoraGRPOLearner(
            Path(model), small_lora(), train(steps_per_round=STEPS), device="cpu"
        )
        if rank == 0:  # the service's side (learner/round.py): lead, then train
            outcomes: list[str] = []
            for seed in (1, 2, 3):
                groups = random_groups(seed, n=4)
                lead_round(trainer, groups, None)
                steps: list[int] = []

                def taken(progress: StepProgress, seen: list[int] = steps) -> None:
                    seen.append(progress.step)

                try:
                    stats = trainer.train_round(groups, taken)
                    outcomes.append(f"trained {stats.steps} steps")
                except RanksFailed as exc:
                    outcomes.append(f"failed after {len(steps)} steps: {exc}")
            send_stop()
        else:
            faulty = Faulty(trainer)
            follow(faulty)
            outcomes = faulty.outcomes
        Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))
    finally:
        dist.destroy_process_group()


def test_a_step_that_fails_on_one_rank_ends_the_round_on_every_rank(
    tiny_model: Path, tmp_path: Path
) -> None:
    ranks = mp.spawn(
        rank_main, args=(str(tiny_model), free_port(), str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.monotonic() + 240
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank still waits in a collective after the deadline")
    lead = json.loads((tmp_path / "rank0.json").read_text())
    follower = json.loads((tmp_path / "rank1.json").read_text())
    # Round 1: rank 1's first forward raised; rank 0 stopped at that step's sum, no step taken.
    assert lead[0].startswith("failed after 0 steps: training failed on rank 1: RuntimeError")
    assert FAULT_ENV in lead[0] and "rank 0" not in lead[0]
    assert follower[0] == lead[0].replace("failed after 0 steps", "failed")
    # Round 2: rank 1's last optimizer step raised after the last sum: agreed at the round's end.
    assert lead[1] == (
        f"failed after {STEPS} steps: training failed on rank 1: "
        "OutOfMemoryError: CPU: out of memory (simulated)"
    )
    assert follower[1].startswith("failed: training failed on rank 1: OutOfMemoryError")
    # Round 3: both ranks train it whole, together.
    assert lead[2] == follower[2] == f"trained {STEPS} steps"


def hung_rank_main(rank: int, model: str, port: int, out: str, release: Any) -> None:
    """Rank 1 takes the round and loads its adapter, then hangs (waits on ``release``) instead
    of training: rank 0's first sum waits for it only the round's collective timeout."""
    from learner import parallel

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    parallel.ROUND_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=10)
    parallel.start_from_env("cpu")
    trainer = LoraGRPOLearner(Path(model), small_lora(), train(steps_per_round=STEPS), device="cpu")
    groups = random_groups(1, n=4)
    if rank == 0:
        lead_round(trainer, groups, None)
        started = time.monotonic()
        try:
            trainer.train_round(groups)
            outcome = "trained"
        except RanksFailed:
            outcome = "agreed"
        except RuntimeError as exc:  # gloo's timeout: round.py ends the process group on it
            outcome = f"timed out after {time.monotonic() - started:.0f} s: {exc}"
        Path(out, "rank0.json").write_text(json.dumps(outcome))
        release.set()
    else:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        parallel.load_on_every_rank(trainer, None)
        release.wait()
    os._exit(0)  # the group is out of step: no teardown to wait on


def test_a_rank_that_hangs_in_a_round_is_waited_for_only_the_collective_timeout(
    tiny_model: Path, tmp_path: Path
) -> None:
    release = mp.get_context("spawn").Event()
    args = (str(tiny_model), free_port(), str(tmp_path), release)
    ranks = mp.spawn(hung_rank_main, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("rank 0 still waits for the hung rank after the deadline")
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome.startswith("timed out after "), outcome
    waited = float(outcome.removeprefix("timed out after ").split(" s")[0])
    assert 8 <= waited <= 60, outcome  # the round's timeout (10 s here), not the 7-day wait

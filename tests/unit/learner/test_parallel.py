"""A round trained data parallel on two ranks (gloo, the CPU backend torch.distributed ships) is
the round one rank trains alone: the same loss, stats and adapter to 1e-5, on both ranks, with
the step's micro-batches dealt between them. Rank 0 then leads a second round the follower
trains alongside it (learner/parallel.py's send_round / follow)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.parallel import Ranks, follow, send_round, send_stop
from learner.trainer import LoraGRPOLearner
from ratchet.dev.processes import free_port
from tests.unit.learner.test_trainer import random_groups, small_lora, tiny_model, train

__all__ = ["tiny_model"]  # the session fixture, shared with the trainer's tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small micro-batches: each step has several, so both ranks compute some of every step.
# Two epochs: the second's stop decision (learner.epoch_max_*) is made alike on both ranks.
KNOBS: dict[str, Any] = {
    "steps_per_round": 3,
    "micro_batch_tokens": 64,
    "learning_rate": 5e-3,
    "epochs_per_round": 2,
}


def learner(model: Path) -> LoraGRPOLearner:
    return LoraGRPOLearner(model, small_lora(), train(**KNOBS), device="cpu")


def outcome(trainer: LoraGRPOLearner, stats: Any) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in trainer.params],
        "loss": stats.loss,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.total_tokens,
        "ratio_min": stats.ratio_min,
        "ratio_max": stats.ratio_max,
        "grad_norm": stats.grad_norm,
        "steps": stats.steps,
        "stopped": stats.stopped,
        "approx_kl": stats.approx_kl,
    }


def rank_main(rank: int, model: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = learner(Path(model))
        assert trainer.ranks == Ranks(rank, 2)
        first = outcome(trainer, trainer.train_round(random_groups(1, n=6)))
        seen: list[dict[str, Any]] = []

        def train_round(groups: list[Any], adapter: Path | None) -> None:
            trainer.load_adapter(adapter)
            seen.append(outcome(trainer, trainer.train_round(groups)))

        if rank == 0:  # the service's side: lead one more round, then stop the follower
            groups = random_groups(2, n=5)
            send_round(groups, None)
            train_round(groups, None)
            send_stop()
        else:
            follow(train_round)
        torch.save({"first": first, "second": seen[0]}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_the_round_one_rank_trains(tiny_model: Path, tmp_path: Path) -> None:
    alone = learner(tiny_model)
    first = outcome(alone, alone.train_round(random_groups(1, n=6)))
    alone.load_adapter(None)
    second = outcome(alone, alone.train_round(random_groups(2, n=5)))
    assert alone.ranks == Ranks(0, 1)

    mp.spawn(rank_main, args=(str(tiny_model), free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        ranked = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for expected, got in ((first, ranked["first"]), (second, ranked["second"])):
            for a, b in zip(expected["params"], got["params"], strict=True):
                torch.testing.assert_close(b, a, rtol=0.0, atol=1e-5)
            assert any(p.abs().max() > 0 for p in got["params"])  # it did learn something
            for key in ("loss", "ratio_min", "ratio_max", "grad_norm", "approx_kl"):
                assert got[key] == pytest.approx(expected[key], abs=1e-5), key
            assert (got["steps"], got["stopped"]) == (expected["steps"], expected["stopped"])
            assert (got["completion_tokens"], got["total_tokens"]) == (
                expected["completion_tokens"],
                expected["total_tokens"],
            )

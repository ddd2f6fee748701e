"""With several ranks, an adapter that fails to load fails the round on every rank alike: rank 0
raises (the service pauses the alias with the reason, learner/service.py) and every follower
learns of it through the round's own collective, skips the round and waits for the next one,
instead of crashing while rank 0 carries on (torchrun would restart the whole group)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.parallel import follow, lead_round, send_stop
from learner.trainer import LoraGRPOLearner
from ratchet.store import AdapterStore
from tests.unit.learner.test_trainer import lora, random_groups, small_lora, tiny_model, train

__all__ = ["tiny_model"]  # the session fixture, shared with the trainer's tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def learner(model: Path) -> LoraGRPOLearner:
    return LoraGRPOLearner(model, small_lora(), train(steps_per_round=1), device="cpu")


class Counting:
    """A trainer that records the size of each round it trains."""

    def __init__(self, trainer: LoraGRPOLearner) -> None:
        self.trainer = trainer
        self.trained: list[int] = []

    def load_adapter(self, folder: Path | None) -> None:
        self.trainer.load_adapter(folder)

    def train_round(self, groups: list[Any]) -> Any:
        self.trained.append(len(groups))
        return self.trainer.train_round(groups)


def rank_main(rank: int, model: str, port: int, bad: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = Counting(learner(Path(model)))
        if rank == 0:  # the service's side (learner/round.py): lead, then train
            with pytest.raises(ValueError, match="rank, alpha, targets"):
                lead_round(trainer, random_groups(1, n=2), Path(bad))
            groups = random_groups(2, n=3)  # the next round: both ranks train it
            lead_round(trainer, groups, None)
            trainer.train_round(groups)
            send_stop()
        else:
            follow(trainer)
        trained = trainer.trained
        Path(out, f"rank{rank}.json").write_text(json.dumps(trained))
    finally:
        dist.destroy_process_group()


def test_an_adapter_that_fails_to_load_fails_the_round_on_every_rank(
    tiny_model: Path, tmp_path: Path
) -> None:
    # An adapter of another shape (lora.rank changed since it was written): it cannot continue.
    other = LoraGRPOLearner(
        tiny_model, lora(rank=8, alpha=16), train(steps_per_round=1), device="cpu"
    )
    bad = other.save_candidate(AdapterStore(tmp_path / "store"), "a", 1, 0, {})
    mp.spawn(rank_main, args=(str(tiny_model), free_port(), str(bad), str(tmp_path)), nprocs=2)
    # Both ranks lived through the failed round and trained the next one together.
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [3]

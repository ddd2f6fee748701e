"""Sharded by FSDP on two ranks (gloo), a round still measures served equals trained
(learner/sharded_forwards.py): rank 0's drift of the round's groups and its candidate's
fingerprint are those one rank computes alone on the same round, while the follower runs the
same forwards alongside (without it, rank 0's forwards would wait in FSDP's gathers: the test's
deadline)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.drift import DRIFT_KEY, FINGERPRINT_KEY, Measures, candidate_fingerprint
from learner.metrics import LearnerMetrics
from learner.parallel import Ranks, follow, lead_round, round_group, send_stop, start_from_env
from learner.sharded_forwards import sharded_forwards
from learner.trainer import LoraGRPOLearner
from ratchet.settings import LearnerSettings, RatchetSettings, ServedCheckSettings
from tests.unit.learner.test_parallel_load import free_port
from tests.unit.learner.test_trainer import random_groups, small_lora, tiny_model, train

__all__ = ["tiny_model"]  # the session fixture, shared with the trainer's tests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROBE = ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10))  # the tiny model has no tokenizer
ALIAS = "a"


def settings(sharding: str) -> LearnerSettings:
    return train(steps_per_round=2, learning_rate=5e-3, sharding=sharding)


def measured_round(trainer: LoraGRPOLearner, lead: bool) -> dict[str, Any]:
    """A round from a fresh LoRA (v0) on groups v0 sampled, measured as learner/round.py does:
    rank 0 leads the followers through it when there are some."""
    groups = random_groups(1, n=4)
    whole = RatchetSettings(
        learner=trainer.train.model_copy(
            update={"served_check": ServedCheckSettings(served_precision="float32")}
        )
    )
    measures = Measures(whole, LearnerMetrics())
    measures._probe = PROBE
    if lead:
        lead_round(trainer, groups, None, sharded_forwards(measures, trainer, 0))
    measures.before_training(trainer, ALIAS, 0, groups)
    trainer.train_round(groups)
    measures.after_training(trainer, ALIAS)
    return measures.for_candidate(trainer, ALIAS)


def rank_main(rank: int, model: str, port: int, out: str) -> None:
    # Joined as torchrun's ranks join (the service's own start): the round's collectives, FSDP's
    # included, in the group of their own with its timeout (learner/parallel.py).
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    assert start_from_env("cpu") == Ranks(rank, 2) and round_group() is not None
    try:
        trainer = LoraGRPOLearner(Path(model), small_lora(), settings("fsdp"), device="cpu")
        assert trainer.sharded
        if rank == 0:
            meta = measured_round(trainer, lead=True)
            send_stop()
            Path(out, "rank0.json").write_text(json.dumps(meta))
        else:
            follow(trainer)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # past FSDP's teardown in gloo's threads (tests/unit/learner/test_parallel_load.py)


def test_a_sharded_round_measures_the_drift_and_fingerprint_one_rank_does(
    tiny_model: Path, tmp_path: Path
) -> None:
    alone = LoraGRPOLearner(tiny_model, small_lora(), settings("replicate"), device="cpu")
    expected = measured_round(alone, lead=False)
    ranks = mp.spawn(
        rank_main, args=(str(tiny_model), free_port(), str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.monotonic() + 240
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank still waits in a collective after the deadline")
    sharded = json.loads((tmp_path / "rank0.json").read_text())

    drift, want = sharded[DRIFT_KEY], expected[DRIFT_KEY]
    assert drift["tokens"] == want["tokens"] > 0
    assert drift["mean_abs"] == pytest.approx(want["mean_abs"], abs=1e-5)
    taken, reference = sharded[FINGERPRINT_KEY], expected[FINGERPRINT_KEY]
    assert taken["token_ids"] == [list(p) for p in PROBE] == reference["token_ids"]
    for got, exact in zip(taken["logprobs"], reference["logprobs"], strict=True):
        assert got == pytest.approx(exact, abs=1e-4)
    # Of the round's candidate: the weights the round started from give another fingerprint.
    fresh = LoraGRPOLearner(tiny_model, small_lora(), settings("replicate"), device="cpu")
    fresh.load_adapter(None)
    start = candidate_fingerprint(fresh, PROBE).logprobs
    assert max(abs(a - b) for xs, ys in zip(start, taken["logprobs"], strict=True)
               for a, b in zip(xs, ys, strict=True)) > 1e-3  # fmt: skip

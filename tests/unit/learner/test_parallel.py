"""A round trained data parallel on two ranks (gloo, the CPU backend torch.distributed ships) is
the round one rank trains alone: the same loss, stats and adapter to 1e-5, on both ranks, with
the step's micro-batches dealt between them. Rank 0 then leads a second round the follower
trains alongside it (learner/parallel.py's send_round / follow). Both with each rank holding the
whole model (``learner.sharding: replicate``) and with the weights sharded by FSDP2 (``fsdp``),
whose saved adapter and optimizer state are those one rank writes, and which continues from
one rank's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from embedded.processes import free_port
from learner.parallel import Ranks, follow, is_sharded, lead_round, send_stop
from learner.trainer import OPTIMIZER_FILE, LoraGRPOLearner
from ratchet.store import AdapterStore
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


def learner(model: Path, sharding: str = "replicate") -> LoraGRPOLearner:
    return LoraGRPOLearner(model, small_lora(), train(**KNOBS, sharding=sharding), device="cpu")


def outcome(trainer: LoraGRPOLearner, stats: Any) -> dict[str, Any]:
    return {
        "params": [p.clone() for p in trainer.adapter_weights().values()],
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


def rank_main(rank: int, model: str, port: int, out: str, sharding: str = "replicate") -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if sharding == "fsdp" and rank > 0:  # a follower reads no weights: rank 0 sends its shards
            from transformers import AutoModelForCausalLM

            def no_reading(*args: Any, **kwargs: Any) -> None:
                raise AssertionError("an FSDP follower read the base from its checkpoint")

            AutoModelForCausalLM.from_pretrained = no_reading  # type: ignore[method-assign]
        trainer = learner(Path(model), sharding)
        base = trainer.model.get_base_model()
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
        assert trainer.ranks == Ranks(rank, 2) and trainer.sharded == (sharding == "fsdp")
        # Sharded, each rank holds its half of every LoRA and decoder-layer weight.
        layer_weight = trainer.model.get_parameter(
            "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"
        )
        for param in (*trainer.params, layer_weight):
            assert is_sharded(param) == trainer.sharded
            if trainer.sharded:
                shards: Any = param  # a DTensor
                assert shards.to_local().shape[0] * 2 == param.shape[0]
        first = outcome(trainer, trainer.train_round(random_groups(1, n=6)))
        if rank == 0:  # every rank gathered the adapter at the round's end; one writes it
            trainer.save_candidate(AdapterStore(Path(out) / "ranked"), "a", 1, 0, {})
        seen: list[dict[str, Any]] = []

        class Seeing:  # the trainer, keeping each round's outcome
            def read_adapter(self, folder: Path | None) -> Any:
                return trainer.read_adapter(folder)

            def set_adapter(self, read: Any) -> None:
                trainer.set_adapter(read)

            def train_round(self, groups: list[Any]) -> Any:
                stats = trainer.train_round(groups)
                seen.append(outcome(trainer, stats))
                return stats

        if rank == 0:  # the service's side: lead one more round, then stop the follower
            groups = random_groups(2, n=5)
            lead_round(Seeing(), groups, None)
            Seeing().train_round(groups)
            send_stop()
        else:
            follow(Seeing())
        # Continued from the version one rank wrote after round 1, its optimizer state with it.
        trainer.load_adapter(Path(out) / "alone" / "a@v1")
        Seeing().train_round(random_groups(3, n=5))
        torch.save({"first": first, "second": seen[0], "third": seen[1]}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_ranks_train_the_round_one_rank_trains(
    tiny_model: Path, tmp_path: Path, sharding: str
) -> None:
    alone = learner(tiny_model)
    first = outcome(alone, alone.train_round(random_groups(1, n=6)))
    written = alone.save_candidate(AdapterStore(tmp_path / "alone"), "a", 1, 0, {})
    alone.load_adapter(None)
    second = outcome(alone, alone.train_round(random_groups(2, n=5)))
    alone.load_adapter(written)
    third = outcome(alone, alone.train_round(random_groups(3, n=5)))
    assert alone.ranks == Ranks(0, 1)

    args = (str(tiny_model), free_port(), str(tmp_path), sharding)
    mp.spawn(rank_main, args=args, nprocs=2, join=True)
    # What rank 0 wrote is what one rank wrote: the adapter and the optimizer's moments.
    ranked_folder = tmp_path / "ranked" / "a@v1"
    for name in ("adapter_model.safetensors",):
        a, b = load_file(written / name), load_file(ranked_folder / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0.0, atol=1e-5)
    states = [torch.load(f / OPTIMIZER_FILE, weights_only=True) for f in (written, ranked_folder)]
    assert states[0]["param_names"] == states[1]["param_names"]
    for index, entry in states[0]["optimizer"]["state"].items():
        for key, value in entry.items():
            got = states[1]["optimizer"]["state"][index][key]
            assert type(got) is torch.Tensor  # whole tensors, not one rank's shards
            torch.testing.assert_close(got, value, rtol=0.0, atol=1e-5)
    for rank in (0, 1):
        ranked = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for expected, got in (
            (first, ranked["first"]),
            (second, ranked["second"]),
            (third, ranked["third"]),
        ):
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

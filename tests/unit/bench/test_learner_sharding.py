"""bench/learner_sharding.py counts the weights a rank keeps: all of a whole tensor (a sharded
one's local shard is checked on two ranks in tests/unit/learner/test_parallel.py)."""

from __future__ import annotations

import torch

from bench.learner_sharding import held_bytes


def test_a_whole_model_holds_every_weight_at_its_size() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    assert held_bytes(model) == (8 * 4 + 4 + 4 * 2) * 4
    assert held_bytes(model.to(torch.bfloat16)) == (8 * 4 + 4 + 4 * 2) * 2

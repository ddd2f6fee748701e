"""Reward-model scoring throughput: a group of K answers in one pass (the prompt once) against
each answer scored on its own.

Run it from the repository root (CPU, the embedded SmolLM2-135M-Instruct; no services)::

    .venv/bin/python bench/reward_model_scoring.py [--groups 12] [--k 4,8] [--threads 1]

Method
------
One process, one frozen base model (``ratchet.rewards.reward_model.AnswerFeatures``), float32 on
the CPU, ``--threads`` torch threads. Groups: the demo's prompts (``tasks.demo``), each with K
answers cut from the demo's own expected JSON and a few sentences of filler of varied length
(seeded), so answers differ in length as sampled ones do. For each K, the same groups are scored
two ways, after one unmeasured warm-up group each:

* grouped: ``AnswerFeatures.group(messages, answers)``, what the judge does: one row, the prompt
  once and every answer after it under the shared-prompt mask;
* separate: ``group(messages, [answer])`` once per answer, the prompt forwarded K times, as a
  scorer that reads (prompt, answer) pairs one by one would.

The head's dot product is negligible beside the forward pass and is left out. Prints groups per
second for both and their ratio, and checks the two give the same features (max difference).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded.model import prepare_model
from ratchet.rewards.reward_model import AnswerFeatures
from ratchet.settings import default_home
from tasks.demo import load_prompts

FILLER = (
    "Thanks for your order. ",
    "We will ship it soon. ",
    "Let me know if anything else is needed. ",
    "The details are below. ",
)


def answers_for(prompt: dict[str, Any], k: int, rng: random.Random) -> list[str]:
    expected = str(prompt.get("expected", "{}"))
    return [
        "".join(rng.choice(FILLER) for _ in range(rng.randint(0, 4))) + expected for _ in range(k)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--k", default="4,8")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    features = AnswerFeatures(prepare_model(default_home(), quiet=True))
    prompts = load_prompts()
    rng = random.Random(0)
    table = Table(title=f"reward-model scoring, {args.groups} groups, {args.threads} thread(s)")
    for column in ("K", "grouped groups/s", "separate groups/s", "speed-up", "max |diff|"):
        table.add_column(column, justify="right")
    for k in (int(x) for x in args.k.split(",")):
        groups = [(p["messages"], answers_for(p, k, rng)) for p in prompts[: args.groups + 1]]
        features.group(*groups[0])  # warm-up
        for answer in groups[0][1]:
            features.group(groups[0][0], [answer])
        start = time.perf_counter()
        together = [features.group(m, a) for m, a in groups[1:]]
        grouped_s = time.perf_counter() - start
        start = time.perf_counter()
        alone = [torch.cat([features.group(m, [x]) for x in a]) for m, a in groups[1:]]
        separate_s = time.perf_counter() - start
        diff = max(float((t - s).abs().max()) for t, s in zip(together, alone, strict=True))
        n = len(groups) - 1
        table.add_row(
            str(k),
            f"{n / grouped_s:.2f}",
            f"{n / separate_s:.2f}",
            f"{separate_s / grouped_s:.2f}x",
            f"{diff:.1e}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a version of a sorting alias learned: its greedy answers on unseen prompts, the verifier
split into its parts.

Run it from the repository root (CPU, the embedded SmolLM2-135M-Instruct; no services), with
the adapter folders of the versions to read (the outcome lane's ``ratings-defaults`` run on
sorting leaves them in its home's ``adapters/``)::

    .venv/bin/python bench/sorting_parts.py ADAPTER_DIR [ADAPTER_DIR ...]

The base and each adapter answer the sorting task's prompts ``--skip`` to ``--skip + --count``
(by default the 320 the ``ratings-defaults`` check keeps unseen) greedily, 64 tokens, as that
check scores them. For each: the mean reward, the share of answers that are the list alone (the
reward's format part, worth ``FORMAT_WEIGHT``), the mean order share (the rest) and the share
exactly sorted, so a lift can be read as "learned the format" or "learned to sort"; and each
adapter's lift over the base with its paired 95% interval, as the check computes it. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.reward_model_quality import generate_answers  # noqa: E402
from embedded.model import prepare_model  # noqa: E402
from ratchet.evaluation import paired_lift  # noqa: E402
from ratchet.settings import default_home  # noqa: E402
from tasks.sorting import generate_prompts, sorting_parts, sorting_reward  # noqa: E402


def rewards_of(prompts: list[dict[str, Any]], texts: list[str]) -> list[float]:
    return [
        sorting_reward(p["messages"], {"role": "assistant", "content": t})
        for p, t in zip(prompts, texts, strict=True)
    ]


def parts_of(prompts: list[dict[str, Any]], texts: list[str]) -> dict[str, float]:
    """The mean reward, list-alone share, order share and exactly-sorted share of the answers."""
    rewards, alone, share, exact = [], [], [], []
    for prompt, text in zip(prompts, texts, strict=True):
        sample = {"role": "assistant", "content": text}
        order, is_alone = sorting_parts(prompt["messages"], sample)
        rewards.append(sorting_reward(prompt["messages"], sample))
        alone.append(float(is_alone))
        share.append(order)
        exact.append(float(order == 1.0))  # the reply's numbers are the sorted list
    return {
        "reward": statistics.fmean(rewards),
        "list_alone": statistics.fmean(alone),
        "order_share": statistics.fmean(share),
        "exactly_sorted": statistics.fmean(exact),
    }


def lift_text(result: dict[str, float]) -> str:
    if "lift" not in result:
        return ""
    return f"{result['lift']:+.3f} [{result['lift_low']:+.3f}, {result['lift_high']:+.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("adapters", type=Path, nargs="*", help="adapter folders (PEFT)")
    parser.add_argument("--skip", type=int, default=256, help="the traffic's prompts")
    parser.add_argument("--count", type=int, default=320, help="the unseen prompts")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/sorting_parts.json")
    args = parser.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = args.model_path or prepare_model(default_home(), quiet=True)
    prompts = generate_prompts(args.skip + args.count)[args.skip :]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    results: dict[str, dict[str, float]] = {}
    base: list[float] = []
    for adapter in [None, *args.adapters]:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        name = "base" if adapter is None else adapter.name.rpartition("@")[2] or adapter.name
        texts = [a for [a] in generate_answers(model.eval(), tokenizer, prompts, chunk_prompts=32)]
        results[name] = parts_of(prompts, texts)
        rewards = rewards_of(prompts, texts)
        if adapter is None:
            base = rewards
        else:
            lift, low, high = paired_lift(rewards, base, samples=2000)
            results[name] |= {"lift": lift, "lift_low": low, "lift_high": high}

    table = Table(title=f"sorting, greedy answers to {len(prompts)} prompts")
    for column in ("model", "reward", "lift [95% CI]", "list alone", "order share", "sorted"):
        table.add_column(column)
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['reward']:.3f}",
            lift_text(r),
            f"{r['list_alone']:.1%}",
            f"{r['order_share']:.3f}",
            f"{r['exactly_sorted']:.1%}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

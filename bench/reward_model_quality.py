"""How well the learned reward model ranks answers it never saw: the shipped features and L2
against the ones before, on tasks rated by noisy simulated users.

Run it from the repository root (CPU, the embedded SmolLM2-135M-Instruct; no services)::

    .venv/bin/python bench/reward_model_quality.py [--tasks bullets,sorting] [--prompts 240]

Method
------
For each task, the base model samples ``--k`` answers to each of its first ``--prompts`` prompts
as the served traffic is sampled (temperature 0.7, 64 tokens; seeded, cached under
``bench/results/reward_model_quality/``). Simulated users rate each answer by the task's verifier
plus a normal error of sd ``--noise``, clipped to [0, 1] (issue 35's users). ``--eval-prompts``
prompts are held out; heads are trained on the ratings of ``--train-prompts`` others (a few
hundred ratings, as a first retrain has, and more), ``--seeds`` random splits each. Peers:

* ``before``: the last layer's features, L2 fixed at 1e-3 (the reward model until 2026-11-28);
* ``last layer, L2 chosen``: the same features, L2 chosen by ``choose_l2``;
* ``shipped``: ``AnswerFeatures`` and ``choose_l2`` as the learner uses them.

Each is measured on the held-out prompts three ways: the AUC against the noisy ratings (what the
learner sees and decides on), the AUC against the rule itself (what a round needs), and the
share of same-prompt answer pairs the rule tells apart that the model orders as it does (what a
GRPO group needs: its advantages are within a prompt). Prints each against ``before`` and writes
JSON and a plot to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedded.model import prepare_model  # noqa: E402
from ratchet.rewards.rated import RatedAnswer  # noqa: E402
from ratchet.rewards.reward_model import (  # noqa: E402
    AnswerFeatures,
    auc,
    choose_l2,
    fit_head,
    pairwise_accuracy,
    preference_pairs,
)
from ratchet.settings import default_home  # noqa: E402
from tasks import get_task  # noqa: E402

BEFORE_L2 = 1e-3
PEERS = ("before", "last layer, L2 chosen", "shipped")
MEASURES = ("auc_ratings", "auc_rule", "pairs_rule")


def sample_answers(
    model_path: Path, prompts: list[dict[str, Any]], k: int, seed: int
) -> list[list[str]]:
    """``k`` answers to each prompt from the base model, as served traffic samples them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    return generate_answers(model, tokenizer, prompts, k, temperature=0.7)


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    k: int = 1,
    temperature: float | None = None,
    chunk_prompts: int = 16,
) -> list[list[str]]:
    """``k`` answers of at most 64 tokens to each prompt from ``model`` (a PEFT model too),
    sampled at ``temperature``, or greedy where it is None; ``chunk_prompts`` prompts a batch."""
    import torch

    tokenizer.padding_side = "left"
    sampling: dict[str, Any] = {"do_sample": temperature is not None}
    if temperature is not None:
        sampling["temperature"] = temperature
    out: list[list[str]] = []
    for start in track(range(0, len(prompts), chunk_prompts), description="answering"):
        chunk = prompts[start : start + chunk_prompts]
        texts = [
            tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
            for p in chunk
            for _ in range(k)
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(
                **batch, **sampling, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id
            )
        answers = tokenizer.batch_decode(
            generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        out.extend(answers[i * k : (i + 1) * k] for i in range(len(chunk)))
    return out


def rated_answers(
    task: str, prompts: list[dict[str, Any]], answers: list[list[str]], noise: float, seed: int
) -> tuple[list[RatedAnswer], list[float]]:
    """(the users' ratings of every answer, the rule's score of each)."""
    reward = get_task(task).reward()
    rng = random.Random(seed)
    rated, rule = [], []
    for p, (prompt, group) in enumerate(zip(prompts, answers, strict=True)):
        for a, answer in enumerate(group):
            score = float(reward(prompt["messages"], {"role": "assistant", "content": answer}))
            rating = min(1.0, max(0.0, score + rng.gauss(0.0, noise)))
            rated.append(
                RatedAnswer(prompt["messages"], answer, rating, "user", f"p{p}", f"p{p}-a{a}")
            )
            rule.append(score)
    return rated, rule


def measure(
    features: Any,
    rated: list[RatedAnswer],
    rule: list[float],
    train: list[int],
    held: list[int],
    l2: float | None,
) -> dict[str, float]:
    """A head trained on ``train`` (``l2`` None: chosen), measured on ``held``."""
    trained = [rated[i] for i in train]
    if l2 is None:
        l2, _ = choose_l2(features[train], trained)
    head = fit_head(features[train], trained, l2=l2)
    predictions = head.predict(features[held])
    by_rule = [
        RatedAnswer([], "", rule[i], "", rated[i].prompt_hash, rated[i].completion_id) for i in held
    ]
    return {
        "auc_ratings": auc(predictions, [rated[i].score for i in held]) or 0.5,
        "auc_rule": auc(predictions, [rule[i] for i in held]) or 0.5,
        "pairs_rule": pairwise_accuracy(predictions, preference_pairs(by_rule)) or 0.5,
        "l2": l2,
    }


def splits(
    rated: list[RatedAnswer], eval_prompts: int, train_prompts: int, seed: int
) -> tuple[list[int], list[int]]:
    prompts = sorted({a.prompt_hash for a in rated})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[:eval_prompts])
    train = set(prompts[eval_prompts : eval_prompts + train_prompts])
    return (
        [i for i, a in enumerate(rated) if a.prompt_hash in train],
        [i for i, a in enumerate(rated) if a.prompt_hash in held],
    )


def run_task(task: str, args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    prompts = get_task(task).load_prompts()[: args.prompts]
    cache = (
        args.out.parent / "reward_model_quality" / f"answers-{task}-{args.prompts}x{args.k}.json"
    )
    if cache.exists():
        answers = json.loads(cache.read_text())
    else:
        answers = sample_answers(model_path, prompts, args.k, seed=0)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(answers))
    rated, rule = rated_answers(task, prompts, answers, args.noise, seed=1)
    features = {
        "last": AnswerFeatures(model_path, depth=1.0).rated(rated),
        "shipped": AnswerFeatures(model_path).rated(rated),
    }
    peers = {
        "before": ("last", BEFORE_L2),
        "last layer, L2 chosen": ("last", None),
        "shipped": ("shipped", None),
    }
    result: dict[str, Any] = {"mean_rule": statistics.fmean(rule), "by_train_prompts": {}}
    for n in args.train_prompts:
        rows: dict[str, list[dict[str, float]]] = {peer: [] for peer in PEERS}
        for seed in range(args.seeds):
            train, held = splits(rated, args.eval_prompts, n, seed)
            for peer, (which, l2) in peers.items():
                rows[peer].append(measure(features[which], rated, rule, train, held, l2))
        result["by_train_prompts"][str(n)] = {
            peer: {key: statistics.fmean(r[key] for r in runs) for key in (*MEASURES, "l2")}
            for peer, runs in rows.items()
        }
    return result


def print_table(console: Console, results: dict[str, Any], args: argparse.Namespace) -> None:
    table = Table(
        title=f"reward model on unseen prompts: {args.k} answers a prompt, users off the rule by "
        f"N(0, {args.noise:g}), {args.seeds} splits"
    )
    for column in ("task", "rated prompts", "peer", "L2", "AUC vs ratings", "AUC vs rule",
                   "pairs vs rule", "x before (rule AUC - 0.5)"):  # fmt: skip
        table.add_column(column)
    for task, result in results.items():
        for n, peers in result["by_train_prompts"].items():
            before = peers["before"]["auc_rule"] - 0.5
            for peer, m in peers.items():
                table.add_row(
                    task,
                    n,
                    peer,
                    f"{m['l2']:.3g}",
                    f"{m['auc_ratings']:.3f}",
                    f"{m['auc_rule']:.3f}",
                    f"{m['pairs_rule']:.3f}",
                    f"{(m['auc_rule'] - 0.5) / before:.2f}" if before > 0 else "-",
                )
    console.print(table)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (task, result) in zip(axes[0], results.items(), strict=True):
        sizes = list(result["by_train_prompts"])
        for peer in PEERS:
            values = [result["by_train_prompts"][n][peer]["auc_rule"] for n in sizes]
            ax.plot([int(n) for n in sizes], values, marker="o", label=peer)
        ax.set_title(f"{task}: AUC against the users' rule, unseen prompts")
        ax.set_xlabel("prompts whose ratings trained the head")
        ax.set_ylim(0.5, 1.0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="bullets,sorting")
    parser.add_argument("--prompts", type=int, default=240)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=80)
    parser.add_argument(
        "--train-prompts", type=lambda s: [int(x) for x in s.split(",")], default=[40, 160]
    )
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench/results/reward_model_quality.json"
    )
    args = parser.parse_args()
    if args.eval_prompts + max(args.train_prompts) > args.prompts:
        parser.error("--eval-prompts plus the largest --train-prompts exceeds --prompts")
    model_path = args.model_path or prepare_model(default_home(), quiet=True)
    results = {task: run_task(task, args, model_path) for task in args.tasks.split(",")}
    console = Console()
    print_table(console, results, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=2))  # fmt: skip
    plot(results, args.out.with_suffix(".png"))
    console.print(f"results: {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

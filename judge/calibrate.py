"""`ratchet judge calibrate`: should this judge be trusted with this rubric?

Runs the configured judge over groups a team has labelled, twice per group (samples presented in
order and in reverse), and reports:

- rank agreement with the labels: mean Spearman correlation per group, and pairwise accuracy
  (of all sample pairs whose labels differ, the share the judge orders the same way);
- position bias: the share of pairs whose order flips when only the presentation order changes,
  and the mean score of the sample shown first minus the one shown last.

Labels file: one JSON object per line, ``{"prompt": [messages], "samples": [assistant message or
string, ...], "labels": [number, ...], "tools": [...]?}``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from judge.metrics import JudgeMetrics
from judge.scoring import GroupScorer
from ratchet.rewards.agreement import pairwise_agreement, spearman
from ratchet.rewards.ruler import JudgeReplyError, build_judge_request
from ratchet.secrets import vllm_api_key
from ratchet.settings import RatchetSettings, RewardConfig


@dataclass(frozen=True)
class LabelledGroup:
    prompt: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    labels: list[float]
    tools: list[dict[str, Any]] | None = None


def load_labels(path: Path) -> list[LabelledGroup]:
    groups = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            samples = [
                s if isinstance(s, dict) else {"role": "assistant", "content": str(s)}
                for s in item["samples"]
            ]
            labels = [float(v) for v in item["labels"]]
            prompt = item["prompt"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a labelled group ({exc})") from None
        if len(samples) != len(labels) or len(samples) < 2:
            raise ValueError(f"{path}:{number}: needs >= 2 samples and one label per sample")
        groups.append(LabelledGroup(prompt, samples, labels, item.get("tools")))
    return groups


def order_flips(forward: list[float], reverse: list[float]) -> tuple[int, int]:
    """(pairs ordered differently by the two presentations, pairs ordered by either)."""
    flips = total = 0
    for i, j in itertools.combinations(range(len(forward)), 2):
        a, b = forward[i] - forward[j], reverse[i] - reverse[j]
        if a == 0 and b == 0:
            continue
        total += 1
        flips += (a > 0) != (b > 0) or a == 0 or b == 0
    return flips, total


@dataclass
class CalibrationReport:
    groups: int
    failed: int
    spearman_mean: float | None
    pairwise_accuracy: float | None
    flip_rate: float | None
    first_minus_last: float | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarise(
    results: list[tuple[LabelledGroup, list[float], list[float]]], failed: int
) -> CalibrationReport:
    rhos, agree, pairs, flips, flip_pairs, first_last = [], 0.0, 0, 0, 0, []
    for group, forward, reverse in results:
        mean_scores = [(f + r) / 2 for f, r in zip(forward, reverse, strict=True)]
        rho = spearman(mean_scores, group.labels)
        if rho is not None:
            rhos.append(rho)
        a, n = pairwise_agreement(mean_scores, group.labels)
        agree, pairs = agree + a, pairs + n
        f, n = order_flips(forward, reverse)
        flips, flip_pairs = flips + f, flip_pairs + n
        # Forward shows sample 0 first and the last sample last; reverse the opposite.
        first_last.append((forward[0] - reverse[0] + reverse[-1] - forward[-1]) / 2)
    return CalibrationReport(
        groups=len(results),
        failed=failed,
        spearman_mean=statistics.fmean(rhos) if rhos else None,
        pairwise_accuracy=agree / pairs if pairs else None,
        flip_rate=flips / flip_pairs if flip_pairs else None,
        first_minus_last=statistics.fmean(first_last) if first_last else None,
    )


async def judge_both_orders(
    scorer: GroupScorer, reward: RewardConfig, group: LabelledGroup
) -> tuple[list[float], list[float]] | None:
    k = len(group.samples)
    out = []
    for order in (list(range(k)), list(reversed(range(k)))):
        request = build_judge_request(
            group.prompt, group.samples, reward.rubric, tools=group.tools, order=order
        )
        try:
            out.append((await scorer.call_judge("calibrate", reward, request)).scores)
        except (JudgeReplyError, TimeoutError):
            return None
    return out[0], out[1]


def calibrate(
    settings: RatchetSettings,
    reward: RewardConfig,
    labels: Path,
    out: Path | None,
    console: Console,
) -> int:
    groups = load_labels(labels)
    scorer = GroupScorer(
        settings.judge,
        settings.vllm_url.rstrip("/") + "/v1",
        None,
        JudgeMetrics(),
        vllm_api_key(settings),
    )

    async def run() -> list[tuple[LabelledGroup, list[float], list[float]] | None]:
        limit = asyncio.Semaphore(settings.judge.concurrency)
        with Progress(console=console) as progress:
            task = progress.add_task(f"Judging {len(groups)} groups twice", total=len(groups))

            async def one(
                group: LabelledGroup,
            ) -> tuple[LabelledGroup, list[float], list[float]] | None:
                async with limit:
                    result = await judge_both_orders(scorer, reward, group)
                progress.advance(task)
                return None if result is None else (group, *result)

            return await asyncio.gather(*(one(g) for g in groups))

    raw = asyncio.run(run())
    results = [r for r in raw if r is not None]
    report = summarise(results, failed=len(raw) - len(results))
    table = Table(title=f"Judge {reward.judge_model} on {labels.name}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("reading")
    table.add_row("groups judged (failed)", f"{report.groups} ({report.failed})", "")
    table.add_row(
        "Spearman, mean per group",
        _fmt(report.spearman_mean),
        "1 = same ranking as the labels, 0 = unrelated",
    )
    table.add_row("pairwise accuracy", _fmt(report.pairwise_accuracy), "0.5 = chance")
    table.add_row(
        "flip rate (order reversed)",
        _fmt(report.flip_rate),
        "share of pairs a judge orders differently when only the order changes",
    )
    table.add_row(
        "first - last score", _fmt(report.first_minus_last), "> 0: favours what it reads first"
    )
    console.print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(report.as_dict(), indent=2))
        _plot(results, out / "calibration.png")
        console.print(f"Wrote {out / 'calibration.json'} and {out / 'calibration.png'}")
    return 0 if results else 1


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _plot(results: list[tuple[LabelledGroup, list[float], list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for group, forward, reverse in results:
        left.scatter(
            group.labels,
            [(f + r) / 2 for f, r in zip(forward, reverse, strict=True)],
            s=12,
            alpha=0.6,
        )
        right.scatter(forward, reverse, s=12, alpha=0.6)
    left.set(
        xlabel="label", ylabel="judge score (mean of both orders)", title="Agreement with labels"
    )
    right.plot([0, 1], [0, 1], color="grey", linewidth=1)
    right.set(
        xlabel="score, shown in order", ylabel="score, shown reversed", title="Position consistency"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

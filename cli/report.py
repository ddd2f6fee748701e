"""What the learner has done for an alias, read back from its Redis history: a table of rounds,
the learner's queue lag, and a plot (reward per round, gate win rate with its 95% interval,
promotions marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ratchet.bus import consumer_lag
from ratchet.records import GROUPS_TOPIC
from ratchet.rounds import RoundRow, rounds_of
from ratchet.settings import RatchetSettings

__all__ = ["RoundRow", "learner_lag", "plot_rounds", "rounds_of"]


def learner_lag(settings: RatchetSettings, timeout_s: float = 5.0) -> int | None:
    """Groups on ratchet.groups the learner has not committed yet; None if Kafka is away."""
    return consumer_lag(
        settings.kafka_bootstrap_servers,
        settings.kafka,
        settings.learner.consumer_group,
        GROUPS_TOPIC,
        timeout_s,
    )


def _plot_lift(axis: Any, lifted: list[tuple[int, RoundRow]]) -> None:
    """The gate's score lift over the live version per round, with its 95% interval."""
    xs = [i for i, _ in lifted]
    means = [r.lift or 0.0 for _, r in lifted]
    low = [(r.lift or 0.0) - (r.lift_low or 0.0) for _, r in lifted]
    high = [(r.lift_high or 0.0) - (r.lift or 0.0) for _, r in lifted]
    colours = ["tab:green" if r.passed else "tab:red" for _, r in lifted]
    axis.errorbar(xs, means, yerr=[low, high], fmt="none", ecolor="grey", capsize=3)
    axis.scatter(xs, means, c=colours, zorder=3)
    axis.axhline(0.0, linestyle="--", color="grey")
    axis.set_ylabel("gate score lift (95% CI)")


# The parts of a round's bill the cost panel stacks, in seconds (ratchet/bill.py).
COST_PARTS = (
    ("sample_seconds", "sampling", "tab:blue"),
    ("judge_seconds", "judge calls", "tab:orange"),
    ("train_seconds", "training", "tab:green"),
    ("gate_seconds", "gate", "tab:purple"),
)


def _plot_cost(axis: Any, rows: list[RoundRow]) -> None:
    """Each round's seconds by part, stacked, and its judge spend above the bar when it has one."""
    xs = list(range(1, len(rows) + 1))
    bottom = [0.0] * len(rows)
    for field, label, colour in COST_PARTS:
        heights = [getattr(r.bill, field) if r.bill else 0.0 for r in rows]
        axis.bar(xs, heights, bottom=bottom, label=label, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, row, top in zip(xs, rows, bottom, strict=True):
        if row.bill is not None and row.bill.judge_cost_usd > 0:
            axis.annotate(f"${row.bill.judge_cost_usd:.3f}", (x, top), ha="center", va="bottom")
    axis.set_ylabel("cost (seconds)")
    axis.legend(loc="upper left", fontsize="small")


def plot_rounds(alias: str, rows: list[RoundRow], threshold: float, path: Path) -> Path:
    """Reward per round on top, gate win rate with its 95% interval below, where the pairs had
    scores the score lift with its interval, and where rounds were billed what each cost;
    promotions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lifted = [(i, r) for i, r in enumerate(rows, 1) if r.lift is not None]
    billed = any(r.bill is not None for r in rows)
    panels = 2 + bool(lifted) + billed
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3 * panels), sharex=True)
    top, bottom = axes[0], axes[1]
    x = list(range(1, len(rows) + 1))
    rewards = [r.mean_reward if r.mean_reward is not None else float("nan") for r in rows]
    top.plot(x, rewards, marker="o", color="tab:blue")
    top.set_ylabel("training reward (mean)")
    top.set_title(f"{alias}: learning rounds")
    gated = [(i, r, r.win_rate) for i, r in zip(x, rows, strict=True) if r.win_rate is not None]
    if gated:
        xs = [i for i, _, _ in gated]
        rates = [rate for _, _, rate in gated]
        low = [rate - (r.ci_low if r.ci_low is not None else rate) for _, r, rate in gated]
        high = [(r.ci_high if r.ci_high is not None else rate) - rate for _, r, rate in gated]
        colours = ["tab:green" if r.passed else "tab:red" for _, r, _ in gated]
        bottom.errorbar(xs, rates, yerr=[low, high], fmt="none", ecolor="grey", capsize=3)
        bottom.scatter(xs, rates, c=colours, zorder=3)
    bottom.axhline(threshold, linestyle="--", color="grey", label=f"threshold {threshold}")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("gate win rate (95% CI)")
    bottom.set_xlabel("round (candidate version below)")
    bottom.set_xticks(x, [f"{i}\nv{r.version}" for i, r in zip(x, rows, strict=True)])
    for i, row in zip(x, rows, strict=True):
        if row.outcome == "promoted":
            for axis in axes:
                axis.axvline(i, color="tab:green", alpha=0.3, linewidth=6)
    bottom.legend(loc="lower right")
    extra = []
    if lifted:
        _plot_lift(axes[2], lifted)
        extra.append(axes[2])
    if billed:
        _plot_cost(axes[-1], rows)
        extra.append(axes[-1])
    for axis in extra:
        axis.set_xticks(x, [f"{i}\nv{r.version}" for i, r in zip(x, rows, strict=True)])
        axis.set_xlabel("round (candidate version below)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

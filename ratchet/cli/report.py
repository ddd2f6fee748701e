"""What the learner has done for an alias, read back from its Redis history: a table of rounds,
the learner's queue lag, and a plot (reward per round, gate win rate with its 95% interval,
promotions marked)."""

from __future__ import annotations

from pathlib import Path

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


def plot_rounds(alias: str, rows: list[RoundRow], threshold: float, path: Path) -> Path:
    """Reward per round on top, gate win rate with its 95% interval below; promotions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
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
            for axis in (top, bottom):
                axis.axvline(i, color="tab:green", alpha=0.3, linewidth=6)
    bottom.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

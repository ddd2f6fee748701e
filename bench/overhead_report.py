"""What bench/proxy_overhead.py reports: its results, the table, the targets, JSON and a plot."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.overhead_workload import PathStats

# Targets for the fast upstream, JSON answers, concurrency 1.
TARGET_ADDED_P50_MS = 0.5
TARGET_ADDED_P99_MS = 1.5
# The Responses API (translated to chat in the proxy) against the chat path, c=1.
TARGET_RESPONSES_GAP_MS = 0.1
# The Anthropic Messages API (translated to chat in the proxy) against the chat path, c=1.
TARGET_MESSAGES_GAP_MS = 0.05
# --baseline-code: this checkout's proxy against the baseline's, each mode, c=1 (issue 54).
TARGET_OVER_BASELINE_MS = 0.05

# Wide enough for the results table when the output is piped to a file.
console = Console(width=max(140, shutil.get_terminal_size((140, 40)).columns))


@dataclass
class Result:
    upstream: str
    mode: str
    concurrency: int
    direct: PathStats
    proxy: PathStats
    added_p50_ms: float
    added_p99_ms: float
    throughput_ratio: float
    # Median of each A-B-B-A round, to show how steady the added p50 was across the run.
    added_p50_by_round_ms: list[float] = field(default_factory=list)
    # --baseline-code: the other checkout's proxy on the same upstream, and this proxy's p50 over
    # it (positive: this checkout is slower), overall and per round.
    baseline: PathStats | None = None
    over_baseline_p50_ms: float | None = None
    over_baseline_by_round_ms: list[float] = field(default_factory=list)


def print_table(results: list[Result]) -> None:
    table = Table(title="Ratchet proxy overhead (latency in ms, client-side)")
    for col in ("upstream", "mode", "conc"):
        table.add_column(col)
    for col in (
        "direct p50",
        "direct p99",
        "proxy p50",
        "proxy p99",
        "added p50",
        "added p99",
        "added p50 per round",
        "tput ratio",
        "over baseline p50",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.upstream,
            r.mode,
            str(r.concurrency),
            f"{r.direct.p50_ms:.3f}",
            f"{r.direct.p99_ms:.3f}",
            f"{r.proxy.p50_ms:.3f}",
            f"{r.proxy.p99_ms:.3f}",
            f"{r.added_p50_ms:+.3f}",
            f"{r.added_p99_ms:+.3f}",
            _spread(r.added_p50_by_round_ms),
            f"{r.throughput_ratio:.2f}",
            "-" if r.over_baseline_p50_ms is None else f"{r.over_baseline_p50_ms:+.3f}",
        )
    console.print(table)
    for r in results:
        if r.direct.errors or r.proxy.errors:
            console.print(
                f"[red]{r.upstream} {r.mode} c={r.concurrency}: {r.direct.errors} requests failed "
                f"direct, {r.proxy.errors} through the proxy (left out of the latencies)"
            )


def _spread(values: list[float]) -> str:
    """min..max of the per-round added p50: how much of the difference is noise."""
    return f"{min(values):+.2f}..{max(values):+.2f}" if values else "-"


def check_targets(results: list[Result]) -> bool:
    base = next(
        (r for r in results if (r.upstream, r.mode, r.concurrency) == ("fast", "json", 1)), None
    )
    if base is None:
        console.print("[yellow]targets not checked: no fast/json/c=1 measurement in this run")
        return False
    checks = [
        ("added p50", base.added_p50_ms, TARGET_ADDED_P50_MS),
        ("added p99", base.added_p99_ms, TARGET_ADDED_P99_MS),
    ]
    for name, value, limit in checks:
        verdict = "[green]MET" if value <= limit else "[red]NOT MET"
        console.print(
            f"target {name} <= {limit} ms (fast upstream, json, c=1): {value:.3f} ms -> {verdict}"
        )
    for mode, api, limit in (
        ("responses", "Responses API", TARGET_RESPONSES_GAP_MS),
        ("messages", "Messages API", TARGET_MESSAGES_GAP_MS),
    ):
        translated = next(
            (r for r in results if (r.upstream, r.mode, r.concurrency) == ("fast", mode, 1)),
            None,
        )
        if translated is None:
            continue
        gap = translated.added_p50_ms - base.added_p50_ms
        checks.append((f"{api} added p50 over chat's", gap, limit))
        verdict = "[green]MET" if gap <= limit else "[red]NOT MET"
        console.print(
            f"target {api} added p50 within {limit} ms of chat's (fast upstream, c=1): "
            f"{translated.added_p50_ms:.3f} - {base.added_p50_ms:.3f} = {gap:+.3f} ms -> {verdict}"
        )
    for r in results:
        over = r.over_baseline_p50_ms
        if r.upstream != "fast" or r.concurrency != 1 or over is None:
            continue
        checks.append((f"{r.mode} p50 over the baseline", over, TARGET_OVER_BASELINE_MS))
        verdict = "[green]MET" if over <= TARGET_OVER_BASELINE_MS else "[red]NOT MET"
        console.print(
            f"target {r.mode} p50 at most {TARGET_OVER_BASELINE_MS} ms over the baseline proxy "
            f"(fast upstream, c=1): {over:+.3f} ms "
            f"(per round {_spread(r.over_baseline_by_round_ms)}) -> {verdict}"
        )
    return all(value <= limit for _, value, limit in checks)


def write_json(out: Path, results: list[Result], meta: dict[str, Any]) -> Path:
    path = out / "proxy_overhead.json"
    path.write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2, default=str)
    )
    return path


def write_plot(out: Path, results: list[Result]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print(
            "[yellow]matplotlib is not installed in this venv: no PNG written "
            "(pip install matplotlib to get bench/results/proxy_overhead.png)"
        )
        return None
    # One row per upstream: vLLM's noise (tens of ms) would flatten the fast upstream's curves.
    upstreams = sorted({r.upstream for r in results})
    fig, axes = plt.subplots(len(upstreams), 2, figsize=(11, 3.6 * len(upstreams)), squeeze=False)
    for row, upstream in zip(axes, upstreams, strict=True):
        for mode in sorted({r.mode for r in results if r.upstream == upstream}):
            rows = sorted(
                (r for r in results if (r.upstream, r.mode) == (upstream, mode)),
                key=lambda r: r.concurrency,
            )
            conc = [r.concurrency for r in rows]
            row[0].plot(conc, [r.added_p50_ms for r in rows], "o-", label=mode)
            row[1].plot(conc, [r.added_p99_ms for r in rows], "o-", label=mode)
        for ax, name, target in (
            (row[0], "added p50", TARGET_ADDED_P50_MS),
            (row[1], "added p99", TARGET_ADDED_P99_MS),
        ):
            if upstream == "fast":
                ax.axhline(target, color="grey", linestyle="--", label=f"target at c=1: {target}")
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r.concurrency for r in results}))
            ax.get_xaxis().set_major_formatter("{x:.0f}")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"{upstream} upstream: proxy {name} latency")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "proxy_overhead.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

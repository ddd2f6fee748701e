"""How fast does the whole loop, with its defaults, improve a task nobody tuned it for?

Run it from the repository root (CPU, the whole embedded stack on free ports, in a temporary home
per task; about ``--minutes`` plus 5 per task)::

    nice -n 19 .venv/bin/python bench/loop_speed.py --tasks sorting,bullets,demo --minutes 20

Method
------
For each bundled task (``tasks.TASKS``), one at a time, on a fresh stack (Tansu, Redis,
vLLM CPU, proxy, judge and learner as separate processes, started as ``ratchet up`` starts them):

1. config: a ``ratchet.yaml`` that gives the task's alias only ``reward: {kind: verifier,
   verifier: ...}`` and leaves every other setting at its default, beside the stack's own home
   and free ports; ``--set key=value`` overrides a setting for an experiment (dotted keys;
   ``alias.`` means the task's alias: ``--set alias.learning.group_size=6 --set
   learner.learning_rate=1e-3``; values are YAML);
2. traffic: the task's prompts but the last ``--eval`` go through the proxy with the official
   ``openai`` client, ``--clients`` at a time, cycling, until the first promotion (the alias's
   ``active`` version in Redis changes) or ``--minutes``;
3. watch, every 2 s: the alias's route and lifecycle history (Redis), the judge's groups and the
   learner's rounds, trained tokens and train seconds (their /metrics), and the learner's
   resident memory (its /metrics' ``process_resident_memory_bytes`` when it has one, else
   /proc; the peak is the kernel's high-water mark ``VmHWM``);
4. evaluate, with traffic, judge and learner stopped: the last ``--eval`` prompts (never sent)
   answered greedily by the base and by the promoted version (or, without one, the last
   candidate, reported as such) and scored by the task's verifier (``bench/demo_learning.py``'s
   ``evaluate``). The lift is the mean paired difference, with a 95% percentile-bootstrap
   interval over prompts (the gate's ``bootstrap_interval``).

Prints a table per task; writes ``--out`` (JSON) and a plot beside it (each gate's candidate and
incumbent held-out scores over time, promotions marked, the evaluation's scores as lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.demo_learning import evaluate, vllm_headers
from bench.loop_watch import Watch, Watcher, proc_memory
from embedded.config import default_config_text
from embedded.model import prepare_model
from embedded.processes import Stack, free_port
from embedded.stack import create_topics, embedded_stack
from ratchet.evaluation import paired_lift
from ratchet.settings import RatchetSettings, default_home, load_settings
from tasks import TASKS, Task, get_task, request_fields

BASE = "smollm2-135m-instruct"
BOOTSTRAP_SAMPLES = 2000  # resamples of the lift's interval
LIFT_BAR = 0.1  # issue 31's: a held-out lift of at least this, its interval above 0
PASSED = ("canary", "promote")  # lifecycle events of a candidate that passed its gate


# --- the config ------------------------------------------------------------------------------


def parse_sets(items: list[str]) -> list[tuple[list[str], Any]]:
    """``key.path=value`` pairs; the value is YAML (``1e-3``, ``true``, ``[a, b]``)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not all(key.split(".")):
            raise SystemExit(f"--set {item!r}: expected key.path=value")
        out.append((key.split("."), yaml.safe_load(value)))
    return out


def loop_config(
    home: Path, task: Task, sets: list[tuple[list[str], Any]], model_path: Path
) -> Path:
    """The task's alias with only its verifier; the rest is what the stack needs to run in
    ``home`` on free ports. Checked by loading it, so a bad ``--set`` fails before any start.
    ``model_path``: the model vLLM serves, shared by the tasks; the learner must name the same
    folder as its adapters' base, or vLLM's resolver refuses them."""
    # The embedded stack's own deployment settings (what `ratchet up` writes), not its aliases.
    packaged = yaml.safe_load(default_config_text())
    config: dict[str, Any] = {
        "home": str(home),
        "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "vllm_url": f"http://127.0.0.1:{free_port()}",
        "proxy": {"host": "127.0.0.1", "port": free_port()},
        "judge": {**packaged.get("judge", {}), "metrics_port": free_port()},
        "learner": {"metrics_port": free_port(), "base_model_path": str(model_path)},
        "aliases": {task.name: {"reward": {"kind": "verifier", "verifier": task.verifier}}},
    }
    for path, value in sets:
        keys = ["aliases", task.name, *path[1:]] if path[0] == "alias" else path
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    out = home / "ratchet.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    load_settings(out)
    return out


# --- traffic ---------------------------------------------------------------------------------


async def replay(
    proxy_url: str,
    alias: str,
    prompts: list[dict[str, Any]],
    clients: int,
    max_tokens: int,
    done: threading.Event,
    counts: dict[str, int],
) -> dict[str, int]:
    """Each client sends every ``clients``-th prompt, cycling, until ``done``; ``counts``
    (answered, failed) kept up to date as it goes."""
    counts.update(answered=0, failed=0)
    api = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="bench", max_retries=0)

    async def client(number: int) -> None:
        i = number
        while not done.is_set():
            prompt = prompts[i % len(prompts)]
            i += clients
            try:
                await api.chat.completions.create(
                    model=alias,
                    messages=prompt["messages"],
                    max_tokens=max_tokens,
                    user=f"bench-{number}",
                    timeout=300,
                    # A tool-use task's prompts carry their tools, as an app's requests would.
                    **request_fields(prompt),
                )
                counts["answered"] += 1
            except openai.APIError:
                counts["failed"] += 1
                await asyncio.sleep(1.0)  # as a client backs off

    try:
        await asyncio.gather(*(client(n) for n in range(clients)))
    finally:
        await api.close()
    return counts


# --- one task --------------------------------------------------------------------------------


def lift(candidate: list[float], base: list[float], samples: int) -> dict[str, float]:
    """Mean paired difference and its 95% percentile-bootstrap interval over prompts."""
    mean, low, high = paired_lift(candidate, base, samples)
    return {"lift": mean, "lift_low": low, "lift_high": high}


def score(
    settings: RatchetSettings,
    task: Task,
    served: str,
    prompts: list[dict[str, Any]],
    max_tokens: int,
) -> list[float]:
    make = evaluate(
        settings.vllm_url,
        served,
        prompts,
        max_tokens,
        vllm_headers(settings),
        task.reward(),
        None,
    )
    return asyncio.run(make).scores


def start(stack: Stack, settings: RatchetSettings, console: Console) -> None:
    """As `ratchet up` does: each part healthy before the next, topics made once the broker is."""
    try:
        with console.status("") as status:
            for part in stack.parts:
                status.update(f"starting {part.name} ({part.address}) ...")
                stack.start_part(part.name)
                if part.name == "kafka":
                    create_topics(settings)
    except BaseException:
        stack.stop()
        raise


def run_task(task: Task, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    prompts = task.load_prompts()
    train, held = prompts[: -args.eval], prompts[-args.eval :]
    with tempfile.TemporaryDirectory(prefix=f"ratchet-loop-{task.name}-") as tmp:
        home = args.home / task.name if args.home else Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        model_path = prepare_model(default_home(), quiet=True)
        config = loop_config(home, task, parse_sets(args.set), model_path)
        settings = load_settings(config)
        stack = embedded_stack(settings, config, model_path, services=("proxy", "judge", "learner"))
        for part in stack.parts:  # a busy machine imports torch slowly; this is no health test
            part.ready_timeout_s = max(part.ready_timeout_s, 600)
        start(stack, settings, console)
        try:
            watcher = Watcher(settings, task.name, stack)
            counts = drive(watcher, settings, task, train, args, console)
            peak = proc_memory(_pid(stack, "learner"))[1]
            watcher.watch.peak_rss = max(watcher.watch.peak_rss, peak)
            for name in ("proxy", "judge", "learner"):  # the evaluation has vLLM to itself
                stack.stop_part(name)
            result = report(
                settings, task, watcher.watch, held, counts, console, args.traffic_max_tokens
            )
            if args.curve:
                result |= learning_curve(
                    settings, task, watcher.watch, held, result, args.traffic_max_tokens, console
                )
            return result
        finally:
            stack.stop()


def _pid(stack: Stack, name: str) -> int | None:
    process = stack.part(name).process
    return process.pid if process is not None else None


def drive(
    watcher: Watcher,
    settings: RatchetSettings,
    task: Task,
    train: list[dict[str, Any]],
    args: argparse.Namespace,
    console: Console,
) -> dict[str, int]:
    """Traffic and the watcher until the first promotion (``--curve``: until the deadline) or
    the deadline, with a progress bar."""
    stop = threading.Event()
    proxy = f"http://{settings.proxy.host}:{settings.proxy.port}"
    counts: dict[str, int] = {}
    watcher.traffic = counts

    def traffic() -> None:
        asyncio.run(
            replay(proxy, task.name, train, args.clients, args.traffic_max_tokens, stop, counts)
        )

    threads = [
        threading.Thread(target=traffic, name="bench-traffic"),
        threading.Thread(target=watcher.run, args=(stop,), name="bench-watch"),
    ]
    watcher.started = time.monotonic()
    for thread in threads:
        thread.start()
    columns = (
        TextColumn(f"[bold]{task.name}[/bold]"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    deadline = args.minutes * 60
    try:
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("", total=deadline)
            while (elapsed := time.monotonic() - watcher.started) < deadline:
                watcher.stack.check()
                w = watcher.watch
                progress.update(
                    bar,
                    completed=elapsed,
                    description=(
                        f"groups {w.last('groups'):.0f}, held out {w.last('heldout'):.0f}, "
                        f"rounds {w.last('rounds'):.0f} ({w.last('rejected'):.0f} rejected), "
                        f"live v{w.last('active'):.0f}"
                    ),
                )
                if watcher.promoted.wait(1.0) and not args.curve:
                    break
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return counts


def report(
    settings: RatchetSettings,
    task: Task,
    watch: Watch,
    held: list[dict[str, Any]],
    counts: dict[str, int],
    console: Console,
    max_tokens: int,
) -> dict[str, Any]:
    minutes = (watch.timeline[-1]["t"] if watch.timeline else 0.0) / 60
    candidates = [
        e["version"] for e in watch.events if e["kind"] == "candidate" and e.get("version")
    ]
    version = watch.promoted or (candidates[-1] if candidates else None)
    console.print(f"scoring base{f' and v{version}' if version else ''} on {len(held)} prompts ...")
    # Cut where the traffic's answers were: base and promoted alike.
    base = score(settings, task, BASE, held, max_tokens)
    result: dict[str, Any] = {
        "base_scores": base,
        "task": task.name,
        "verifier": task.verifier,
        "minutes_run": round(minutes, 2),
        "minutes_to_first_promotion": (
            round(watch.first_promotion_s / 60, 2) if watch.first_promotion_s is not None else None
        ),
        # the first candidate through the gate (its canary start, or its promotion at weight 0)
        "minutes_to_first_gate_pass": next(
            (round(e["bench_s"] / 60, 2) for e in watch.events if e["kind"] in PASSED), None
        ),
        "evaluated_version": version,
        "evaluated_is_promoted": watch.promoted is not None,
        "eval_prompts": len(held),
        "base_score": statistics.fmean(base),
        "rounds": watch.last("rounds"),
        "rejected": watch.last("rejected"),
        "groups": watch.last("groups"),
        "judge_groups_per_minute": watch.last("groups") / minutes if minutes else 0.0,
        # the live version's sampled answers, as the judge scored them
        "judge_sample_reward_mean": (
            watch.last("reward_sum") / watch.last("rewards") if watch.last("rewards") else None
        ),
        "judge_zero_spread_share": (
            watch.last("zero_spread") / watch.last("groups") if watch.last("groups") else None
        ),
        "learner_tokens_per_second": (
            watch.last("trained_tokens") / watch.last("train_s") if watch.last("train_s") else None
        ),
        "learner_peak_rss_bytes": watch.peak_rss,
        "traffic": counts,
        "settings": settings.aliases[task.name].model_dump(mode="json")
        | {"learner": settings.learner.model_dump(mode="json")},
        "timeline": watch.timeline,
        "events": watch.events,
    }
    if version:
        promoted = score(settings, task, f"{task.name}@v{version}", held, max_tokens)
        result |= {"promoted_score": statistics.fmean(promoted), "promoted_scores": promoted}
        result |= lift(promoted, base, BOOTSTRAP_SAMPLES)
    return result


def learning_curve(
    settings: RatchetSettings,
    task: Task,
    watch: Watch,
    held: list[dict[str, Any]],
    result: dict[str, Any],
    max_tokens: int,
    console: Console,
) -> dict[str, Any]:
    """``--curve``: every promoted version scored on the prompts never sent, against the base
    (paired, with its 95% interval), at the minute and the count of prompts it went live; and
    what the run's last one bought per CPU-minute and per 1,000 prompts of traffic."""
    base = result["base_scores"]
    # report() has scored the version it evaluated already: the same answers, not drawn twice.
    scored: dict[int, list[float]] = {}
    if result["evaluated_version"] is not None and "promoted_scores" in result:
        scored[int(result["evaluated_version"])] = result["promoted_scores"]
    points = []
    promotions = [e for e in watch.events if e["kind"] == "promote" and e.get("version")]
    for event in promotions:
        version = int(event["version"])
        scores = scored.get(version)
        if scores is None:
            console.print(f"scoring v{version} (promoted at {event['bench_s'] / 60:.1f} min) ...")
            scores = score(settings, task, f"{task.name}@v{version}", held, max_tokens)
        points.append(
            {
                "version": version,
                "minute": round(event["bench_s"] / 60, 2),
                "prompts": prompts_at(watch, event["bench_s"]),
                "score": statistics.fmean(scores),
                **lift(scores, base, BOOTSTRAP_SAMPLES),
            }
        )
    answered = result["traffic"].get("answered", 0)
    return curve_summary(points, result["minutes_run"], answered, os.cpu_count() or 1)


def curve_summary(
    points: list[dict[str, Any]], minutes_run: float, answered: int, cores: int
) -> dict[str, Any]:
    """The curve and what it bought: the last promoted version's lift per CPU-minute of the
    run and per 1,000 prompts of its traffic, and the minute the first version whose lift
    reached LIFT_BAR, with its interval above 0, was promoted."""
    final = points[-1]["lift"] if points else 0.0
    cpu_minutes = minutes_run * cores
    proven = [p for p in points if p["lift"] >= LIFT_BAR and p["lift_low"] > 0]
    return {
        "curve": points,
        "final_lift": final,
        "cpu_minutes": round(cpu_minutes, 1),
        "lift_per_cpu_minute": final / cpu_minutes if cpu_minutes else None,
        "lift_per_1000_prompts": final / (answered / 1000) if answered else None,
        "minutes_to_lift_bar": proven[0]["minute"] if proven else None,
    }


def prompts_at(watch: Watch, seconds: float) -> int:
    """Prompts the traffic had had answered by then (the watcher's last poll before)."""
    seen = [p["answered"] for p in watch.timeline if p["t"] <= seconds]
    return int(seen[-1]) if seen else 0


# --- output ----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_table(console: Console, results: list[dict[str, Any]], minutes: float) -> None:
    table = Table(title=f"The loop with its defaults, {minutes:g} minutes of traffic per task")
    for column in (
        "task", "gate pass (min)", "first promotion (min)", "base", "promoted", "lift [95% CI]",
        "rounds (rejected)", "judge groups/min", "zero-spread groups", "learner tok/s",
        "learner peak RSS",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column == "task" else "right")
    for r in results:
        cand = _fmt(r.get("promoted_score"))
        if r.get("evaluated_version") and not r["evaluated_is_promoted"]:
            cand += f" (v{r['evaluated_version']}, not promoted)"
        ci = (
            f"{r['lift']:+.3f} [{r['lift_low']:+.3f}, {r['lift_high']:+.3f}]"
            if "lift" in r
            else "-"
        )
        table.add_row(
            r["task"],
            _fmt(r["minutes_to_first_gate_pass"], ".1f"),
            _fmt(r["minutes_to_first_promotion"], ".1f", f"none in {r['minutes_run']:.1f}"),
            _fmt(r["base_score"], ".3f"),
            cand,
            ci,
            f"{r['rounds']:.0f} ({r['rejected']:.0f})",
            _fmt(r["judge_groups_per_minute"], ".1f"),
            _fmt(r["judge_zero_spread_share"], ".0%"),
            _fmt(r["learner_tokens_per_second"], ".0f"),
            f"{r['learner_peak_rss_bytes'] / 2**30:.2f} GiB",
        )
    console.print(table)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Per task: each gate's held-out scores (candidate and incumbent) over time, promotions as
    vertical lines, the evaluation's base and promoted scores as horizontal lines, and the
    judge's groups on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        gates = [e for e in r["events"] if e["kind"] == "gate"]
        for key, label, marker in (
            ("candidate_score", "gate: candidate", "o"),
            ("incumbent_score", "gate: live", "x"),
        ):
            points = [(e["bench_s"] / 60, e["detail"].get(key)) for e in gates]
            points = [(t, v) for t, v in points if v is not None]
            if points:
                ax.scatter(*zip(*points, strict=True), marker=marker, label=label)
        for e in r["events"]:
            if e["kind"] == "promote":
                ax.axvline(e["bench_s"] / 60, color="tab:green", linestyle=":", label="promotion")
        ax.axhline(r["base_score"], color="grey", linestyle="--", label="base (eval)")
        if "promoted_score" in r:
            ax.axhline(r["promoted_score"], color="tab:green", linestyle="--", label="new (eval)")
        ax.set_ylim(0, 1)
        ax.set_xlim(0, max(r["minutes_run"], 1))
        ax.set_xlabel("minutes of traffic")
        ax.set_ylabel("held-out verifier score (greedy)")
        ax.set_title(r["task"])
        twin = ax.twinx()
        twin.plot(
            [p["t"] / 60 for p in r["timeline"]],
            [p["groups"] for p in r["timeline"]],
            color="tab:purple",
            alpha=0.4,
        )
        twin.set_ylabel("judge groups (purple)")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_curve(console: Console, results: list[dict[str, Any]], minutes: float) -> None:
    table = Table(title=f"Learning curves: {minutes:g} minutes of the loop per task, on defaults")
    for column in (
        "task", "base", "promoted versions: minute (prompts) lift [95% CI]", "first promotion",
        f"lift >= {LIFT_BAR} (min)", "lift per CPU-minute", "lift per 1,000 prompts",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column == "task" else "right")
    for r in results:
        points = "\n".join(
            f"v{p['version']}: {p['minute']:.1f} ({p['prompts']}) {p['lift']:+.3f} "
            f"[{p['lift_low']:+.3f}, {p['lift_high']:+.3f}]"
            for p in r.get("curve", [])
        )
        table.add_row(
            r["task"],
            _fmt(r["base_score"], ".3f"),
            points or "none",
            _fmt(r["minutes_to_first_promotion"], ".1f"),
            _fmt(r.get("minutes_to_lift_bar"), ".1f"),
            _fmt(r.get("lift_per_cpu_minute"), "+.4f"),
            _fmt(r.get("lift_per_1000_prompts"), "+.3f"),
        )
    console.print(table)


def plot_curve(results: list[dict[str, Any]], path: Path) -> None:
    """The held-out lift of the live version (the base's 0 until the first promotion, then
    each promoted version's, with its 95% interval) against minutes and against prompts of
    traffic, one line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_prompts) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        points = r.get("curve", [])
        answered = r["traffic"].get("answered", 0)
        axes = ((by_time, "minute", r["minutes_run"]), (by_prompts, "prompts", answered))
        for ax, key, end in axes:
            xs = [0.0] + [p[key] for p in points] + [end]
            ys = [0.0] + [p["lift"] for p in points]
            ys.append(ys[-1])
            (line,) = ax.step(xs, ys, where="post", label=r["task"])
            if points:
                ax.errorbar(
                    [p[key] for p in points],
                    [p["lift"] for p in points],
                    yerr=[
                        [p["lift"] - p["lift_low"] for p in points],
                        [p["lift_high"] - p["lift"] for p in points],
                    ],
                    fmt="o",
                    color=line.get_color(),
                    capsize=3,
                )
    for ax, label in ((by_time, "minutes of the loop"), (by_prompts, "prompts of traffic")):
        ax.axhline(LIFT_BAR, color="grey", linestyle=":", label=f"+{LIFT_BAR}")
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out lift of the live version (greedy)")
    by_time.legend(fontsize=7)
    fig.suptitle("What the loop bought, on its defaults (bench/loop_speed.py --curve)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated, of {list(TASKS)}"
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="of traffic per task, at most")
    parser.add_argument(
        "--curve",
        action="store_true",
        help="run the whole --minutes and score every promoted version (the learning curve)",
    )
    parser.add_argument(
        "--set", action="append", default=[], help="key.path=value (alias.* for the task's alias)"
    )
    parser.add_argument("--clients", type=int, default=3, help="concurrent traffic clients")
    parser.add_argument("--traffic-max-tokens", type=int, default=128)
    parser.add_argument("--eval", type=int, default=64, help="last prompts kept for evaluation")
    parser.add_argument("--out", type=Path, default=Path("bench/results/loop_speed.json"))
    parser.add_argument("--home", type=Path, help="keep each task's stack home (and logs) here")
    args = parser.parse_args()
    # SIGTERM (a `kill`, a CI timeout) unwinds like Ctrl-C, so each task's stack is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    tasks = [get_task(name.strip()) for name in args.tasks.split(",") if name.strip()]
    parse_sets(args.set)  # a malformed one fails now, not after a stack has started
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log keeps the table
    results = []
    for task in tasks:
        console.rule(f"{task.name}: {task.description}")
        results.append(run_task(task, args, console))
        print_table(console, results, args.minutes)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"minutes": args.minutes, "set": args.set, "clients": args.clients}
        args.out.write_text(json.dumps({**summary, "tasks": results}, indent=2, default=str))
        plot(results, args.out.with_suffix(".png"))
        if args.curve:
            print_curve(console, results, args.minutes)
            plot_curve(results, args.out.with_name(args.out.stem + "_curve.png"))
    console.print(f"written: {args.out} and the plots beside it")


if __name__ == "__main__":
    main()

"""The outcome lane: does the loop learn? Run with ``scripts/test --outcomes [options]``.

CI does not run it (it takes about three hours of the whole 2-core machine, and a correct
change can miss a bar by chance); run it before a release, after a change to what or how the
loop learns (learner, judge, gate, canary, rewards, their defaults), and add its table to
docs/results/outcome-runs.md. Each check runs in its own process, one after the other, on a
stack of its own:

* ``loop``: bench/loop_speed.py on the shipped defaults for each of ``--tasks`` (default: the
  demo task): traffic until the first promotion or ``--minutes``, then the promoted version's
  lift over the base on the task's prompts never sent, with its paired 95% interval. Bar: a
  promotion within ``--minutes`` and an interval above 0.
* ``curve`` (only when named: ``--checks curve``; about an hour and ten minutes a task):
  bench/loop_speed.py --curve, ``--curve-minutes`` (60) of the whole loop on the
  shipped defaults for each of ``--curve-tasks`` (default: all five bundled tasks), every
  promoted version scored on the task's prompts never sent (issue 31's learning curve). Bar, per
  task: the first promotion within 15 minutes and a lift of at least +0.1, its interval above
  0, from a version promoted within 30. Writes ``curve.json`` and ``curve_curve.png``.
* ``ratings``: tests/outcomes/test_learning_from_ratings.py, a loop driven by users' ratings
  alone (a reward model trained on them scores groups and gates; the ratings decide the
  canary). Bar: the test's own (a promoted version's lift on unseen prompts, its interval above
  0 and mean at least 0.02, within 40 minutes). Its alias is tuned, not on the defaults.
* ``ratings-defaults``: tests/outcomes/test_ratings_on_defaults.py, the same on the shipped
  defaults with noisy users (a fifth never rate, the rest off the rule by N(0, 0.1)) and traffic
  without pause, 45 minutes and then every promoted version measured (issue 35), once for each
  of ``--ratings-tasks`` (default: bullets and sorting, a format task and a correctness task),
  each in its own process on its own stack. Bar, per task: the first promotion within 25
  minutes and a lift of at least +0.1, interval above 0. Its figures say where the learner's
  minutes went (reward model, training, gates, canaries).

Prints one summary table, with each check's bar, and writes ``outcomes.json``, the loop's
``loop_speed.json`` and its learning-curve ``loop_speed.png`` and each check's log into
``--out`` (default: bench/results/outcomes, which git ignores). Exits 1 when a check misses its
bar or gives no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tests.outcomes.test_ratings_on_defaults import RATED_TASKS as RATINGS_TASKS

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("loop", "curve", "ratings", "ratings-defaults")
DEFAULT_CHECKS = ("loop", "ratings", "ratings-defaults")  # the curve takes hours: when named
CURVE_FIRST_PROMOTION_MIN = 15.0  # the curve's bar: the first promotion within this ...
CURVE_LIFT_BY_MIN = 30.0  # ... and a lift of loop_speed.LIFT_BAR proven by this minute
RATINGS_TEST = "tests/outcomes/test_learning_from_ratings.py"
RATINGS_DEFAULTS_TEST = "tests/outcomes/test_ratings_on_defaults.py"
FIGURES = {
    "loop": "loop_speed.json",
    "curve": "curve.json",
    "ratings": "ratings.json",
    "ratings-defaults": "ratings_defaults.json",
}


def loop_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bench" / "loop_speed.py"),
        "--tasks",
        args.tasks,
        "--minutes",
        str(args.minutes),
        "--out",
        str(args.out / "loop_speed.json"),
    ]


def curve_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bench" / "loop_speed.py"),
        "--curve",
        "--tasks",
        args.curve_tasks,
        "--minutes",
        str(args.curve_minutes),
        "--out",
        str(args.out / "curve.json"),
    ]


def ratings_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "pytest", RATINGS_TEST, "-p", "no:cacheprovider", "-s", "-q"]


def ratings_defaults_command(task: str) -> list[str]:
    test = f"{RATINGS_DEFAULTS_TEST}::test_the_loop_learns_from_noisy_ratings_on_the_defaults"
    return [sys.executable, "-m", "pytest", f"{test}[{task}]", "-p", "no:cacheprovider", "-s", "-q"]


def figures_name(check: str, task: str | None = None) -> str:
    """The file a check's run writes its figures to (one per task where a check runs several)."""
    name = FIGURES[check]
    return name if task is None else name.replace(".json", f"_{task}.json")


def runs_of(check: str, args: argparse.Namespace) -> list[tuple[str | None, list[str]]]:
    """A check's runs, one after the other: (its task, where it runs one per task; command)."""
    if check == "ratings-defaults":
        return [(task, ratings_defaults_command(task)) for task in args.ratings_tasks]
    commands = {"loop": loop_command, "curve": curve_command, "ratings": ratings_command}
    return [(None, commands[check](args))]


def run_check(
    name: str, command: list[str], log: Path, env: dict[str, str], console: Console
) -> tuple[int, float]:
    """The check's process, its output to ``log``; its last line shown while it runs. Its exit
    status and seconds."""
    started = time.monotonic()
    columns = (
        SpinnerColumn(),
        TextColumn(f"[bold]{name}[/bold]"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with log.open("w") as out, Progress(*columns, console=console) as progress:
        bar = progress.add_task("starting", total=None)
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, text=True
        )
        try:
            while process.poll() is None:
                progress.update(bar, description=last_line(log))
                time.sleep(1.0)
        except BaseException:
            process.terminate()  # both unwind on SIGTERM and stop their stacks
            process.wait(timeout=120)
            raise
    return process.returncode, time.monotonic() - started


def last_line(log: Path, width: int = 100) -> str:
    """The log's last non-empty line (a progress bar's last redraw), shortened."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:width] if lines else ""


def row(
    check: str,
    settings: str,
    *,
    first: float | None = None,
    minutes_run: float | None = None,
    lift: tuple[float, float, float] | None = None,
    prompts: int | None = None,
    ratings: int | None = None,
    bar: str = "-",
    passed: bool = False,
) -> dict[str, Any]:
    """One row of the lane's table (and of its JSON), whichever check it reports."""
    return {
        "check": check,
        "settings": settings,
        "minutes_to_first_promotion": first,
        "minutes_run": minutes_run,
        "lift": lift,
        "prompts": prompts,
        "ratings": ratings,
        "bar": bar,
        "passed": passed,
    }


def interval(point: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """A measured lift and its 95% interval, where there is one."""
    if point is None or point.get("lift") is None:
        return None
    return (point["lift"], point["lift_low"], point["lift_high"])


def loop_rows(out: Path, minutes: float, code: int) -> list[dict[str, Any]]:
    """One row per task of loop_speed.json (none when the run wrote none)."""
    path = out / "loop_speed.json"
    if not path.is_file():
        return [missing("loop", f"no {path.name} (exit {code})")]
    rows = []
    for task in json.loads(path.read_text())["tasks"]:
        promoted = task.get("evaluated_is_promoted") and task.get("minutes_to_first_promotion")
        lift = interval(task)
        check = f"loop: {task['task']}"
        if task.get("evaluated_version") and not task.get("evaluated_is_promoted"):
            check += f" (v{task['evaluated_version']} measured, not promoted)"
        rows.append(
            row(
                check,
                "the shipped defaults",
                first=task.get("minutes_to_first_promotion"),
                minutes_run=task.get("minutes_run"),
                lift=lift,
                prompts=task.get("eval_prompts"),
                bar=f"promoted within {minutes:g} min; lift's 95% interval above 0",
                passed=bool(promoted and lift is not None and lift[1] > 0),
            )
        )
    return rows


def curve_rows(out: Path, code: int) -> list[dict[str, Any]]:
    """One row per task of curve.json: its last promoted version's lift, and the bar."""
    path = out / "curve.json"
    if not path.is_file():
        return [missing("curve", f"no {path.name} (exit {code})")]
    rows = []
    for task in json.loads(path.read_text())["tasks"]:
        points = task.get("curve") or []
        first = task.get("minutes_to_first_promotion")
        proven = task.get("minutes_to_lift_bar")
        rows.append(
            row(
                f"curve: {task['task']}, {len(points)} promotion(s)",
                "the shipped defaults",
                first=first,
                minutes_run=task.get("minutes_run"),
                lift=interval(points[-1] if points else None),
                prompts=task.get("eval_prompts"),
                bar=f"promoted within {CURVE_FIRST_PROMOTION_MIN:g} min; +0.1 (interval "
                f"above 0) within {CURVE_LIFT_BY_MIN:g}",
                passed=first is not None
                and first <= CURVE_FIRST_PROMOTION_MIN
                and proven is not None
                and proven <= CURVE_LIFT_BY_MIN,
            )
        )
    return rows


def ratings_rows(
    out: Path, code: int, check: str = "ratings", task: str | None = None
) -> list[dict[str, Any]]:
    path = out / figures_name(check, task)
    label = check if task is None else f"{check} ({task})"
    if not path.is_file():
        return [missing(label, f"no {path.name} (exit {code})")]
    figures = json.loads(path.read_text())
    last = figures["promotions"][-1] if figures["promotions"] else None
    settings = figures["settings"]
    if parts := figures.get("minutes_by_part"):
        settings += "; minutes: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
    return [
        row(
            f"{label}: {len(figures['promotions'])} promotion(s) measured",
            settings,
            first=figures["minutes_to_first_promotion"],
            minutes_run=figures.get("minutes_run"),
            lift=interval(last),
            prompts=figures["unseen_prompts"],
            ratings=figures["ratings"],
            bar=figures["bar"],
            # The test's exit says it too; both must agree that the bar was met.
            passed=bool(figures["passed"]) and code == 0,
        )
    ]


def missing(check: str, why: str) -> dict[str, Any]:
    return row(check, why)


def first_promotion(row: dict[str, Any]) -> str:
    if row["minutes_to_first_promotion"] is not None:
        return f"{row['minutes_to_first_promotion']:.1f}"
    ran = row.get("minutes_run")
    return "-" if ran is None else f"none in {ran:.1f}"


def summary_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Outcome lane: does the loop learn?")
    for column in (
        "check", "settings", "first promotion (min)", "lift [95% CI] on unseen prompts",
        "unseen prompts", "ratings", "bar", "result",
    ):  # fmt: skip
        table.add_column(column, overflow="fold")
    for row in rows:
        lift = row["lift"]
        table.add_row(
            row["check"],
            row["settings"],
            first_promotion(row),
            "-" if lift is None else f"{lift[0]:+.3f} [{lift[1]:+.3f}, {lift[2]:+.3f}]",
            "-" if row["prompts"] is None else str(row["prompts"]),
            "-" if row["ratings"] is None else str(row["ratings"]),
            row["bar"],
            "[green]met[/green]" if row["passed"] else "[red]missed[/red]",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--checks", default=",".join(DEFAULT_CHECKS), help=f"comma-separated, of {CHECKS}"
    )
    parser.add_argument("--tasks", default="demo", help="loop_speed's tasks (comma-separated)")
    parser.add_argument("--minutes", type=float, default=20.0, help="loop_speed's traffic, at most")
    parser.add_argument(
        "--curve-tasks", default="demo,sorting,bullets,tool_use,triage", help="the curve's tasks"
    )
    parser.add_argument("--curve-minutes", type=float, default=60.0, help="of the loop per task")
    parser.add_argument(
        "--ratings-tasks",
        default=",".join(RATINGS_TASKS),
        help=f"ratings-defaults' tasks (comma-separated, of {RATINGS_TASKS})",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "outcomes", help="folder"
    )
    args = parser.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if unknown := set(checks) - set(CHECKS):
        parser.error(f"unknown checks {sorted(unknown)}: pick from {CHECKS}")
    args.ratings_tasks = [t.strip() for t in args.ratings_tasks.split(",") if t.strip()]
    if unknown := set(args.ratings_tasks) - set(RATINGS_TASKS):
        parser.error(f"unknown --ratings-tasks {sorted(unknown)}: pick from {RATINGS_TASKS}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    env = {**os.environ, "RATCHET_OUTCOMES_DIR": str(args.out)}
    rows: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    for check in checks:
        for task, command in runs_of(check, args):
            name = check if task is None else f"{check}-{task}"
            (args.out / figures_name(check, task)).unlink(missing_ok=True)  # not an earlier run's
            log = args.out / f"{name}.log"
            console.rule(f"{name}: log in {log}")
            code, timings[name] = run_check(name, command, log, env, console)
            console.print(f"{name}: exit {code} after {timings[name] / 60:.1f} min")
            if check == "loop":
                rows += loop_rows(args.out, args.minutes, code)
            elif check == "curve":
                rows += curve_rows(args.out, code)
            else:
                rows += ratings_rows(args.out, code, check, task)
    console.print(summary_table(rows))
    summary = {
        "checks": rows,
        "seconds": timings,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "outcomes.json").write_text(json.dumps(summary, indent=2))
    curve = args.out / "loop_speed.png"
    console.print(
        f"written: {args.out / 'outcomes.json'}" + (f", {curve}" if curve.is_file() else "")
    )
    return 0 if rows and all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

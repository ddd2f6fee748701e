"""Chaos soak: does the embedded stack lose anything while its parts die in turn?

Run it from the repository root (CPU, the whole embedded stack on free ports, in a temporary
home)::

    .venv/bin/python bench/soak.py --minutes 20

Method: ``embedded.soak`` (its docstring has the details). ``--clients`` clients send the demo
prompts to the ``demo`` alias through the proxy, half of them streamed, and rate half of their
answers; every ``--fault-every`` seconds one part, in turn (broker, Redis, vLLM, the proxy's log
worker, judge, learner), is killed at a random moment and restarted after ``--hold`` seconds (the
in-memory broker is frozen instead); poison records go onto each consumed topic and one ~5 MB
answer is asked for. The judge and learner run with the demo's settings, so the machine is as
loaded as in ``ratchet up``. At the end every answered exchange and every accepted rating is
looked up on the topics.

Prints the counts (lost must be 0; a failed request is allowed only while vLLM is down) and the
share of time each part was ready; writes ``--out`` (JSON) and a timeline plot beside it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded.config import default_config_text
from embedded.model import prepare_model
from embedded.processes import free_port
from embedded.soak import FAULTS, LATE_AFTER_S, Soak, SoakReport
from embedded.stack import create_topics, embedded_stack
from ratchet.settings import default_home, load_settings

ALIAS = "demo"


def soak_config(home: Path) -> Path:
    """The packaged ratchet.yaml on free ports in ``home``."""
    config: dict[str, Any] = yaml.safe_load(default_config_text())
    config |= {
        "home": str(home),
        "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "vllm_url": f"http://127.0.0.1:{free_port()}",
    }
    config["proxy"] = {**config.get("proxy", {}), "host": "127.0.0.1", "port": free_port()}
    config["judge"] = {**config.get("judge", {}), "metrics_port": free_port()}
    config["learner"] = {**config.get("learner", {}), "metrics_port": free_port()}
    path = home / "ratchet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def print_report(console: Console, report: SoakReport) -> None:
    table = Table(title=f"Chaos soak, {report.seconds:.0f} s")
    table.add_column("")
    table.add_column("", justify="right")
    rows: list[tuple[str, object]] = [
        ("requests sent", report.sent),
        ("answered", report.answered),
        *((f"failed: {cause}", n) for cause, n in sorted(report.failed.items())),
        ("failed outside a vLLM outage", len(report.failed_outside_vllm_faults)),
        ("records expected (answered)", report.records_expected),
        ("delivered", report.delivered),
        (f"  of them late (> {LATE_AFTER_S:.0f} s after the answer)", report.delivered_late),
        ("duplicated on ratchet.traffic", report.duplicated),
        ("LOST", len(report.lost)),
        ("ratings accepted", report.ratings_accepted),
        ("ratings lost", len(report.ratings_lost)),
        *(
            (f"poison on {t}: sent, dead-lettered", f"{n}, {report.poison_dead_lettered.get(t, 0)}")
            for t, n in report.poison_sent.items()
        ),
        (
            "5 MB answer",
            f"{report.huge_answer.get('status')} (try {report.huge_answer.get('attempt')})",
        ),
        *((f"ready: {name}", f"{share:.1%}") for name, share in report.ready_share.items()),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    for fault in report.faults:
        end = fault["ended"]
        took = f"{end - fault['started']:.0f} s" if end is not None else "not back"
        console.print(f"  {fault['part']:<10} at {fault['started']:6.0f} s, back after {took}")


def plot(report: SoakReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.5))
    width = 5.0
    bins = [i * width for i in range(int(report.seconds // width) + 2)]
    ok = [e["t"] for e in report.timeline if e["status"] == 200]
    bad = [e["t"] for e in report.timeline if e["status"] != 200]
    ax.hist(
        [ok, bad],
        bins=bins,
        stacked=True,
        color=["tab:green", "tab:red"],
        label=["answered", "failed"],
    )
    for fault in report.faults:
        end = fault["ended"] if fault["ended"] is not None else report.seconds
        ax.axvspan(fault["started"], end, color="tab:gray", alpha=0.25)
        ax.text(fault["started"], ax.get_ylim()[1] * 0.92, fault["part"], fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"requests per {width:.0f} s")
    ax.set_title(f"Chaos soak: {len(report.lost)} lost of {report.records_expected}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds a part stays down")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    parser.add_argument("--home", type=Path, help="keep the stack's home (and its logs) here")
    args = parser.parse_args()
    console = Console()

    with tempfile.TemporaryDirectory(prefix="ratchet-soak-") as tmp:
        home = args.home or Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        config = soak_config(home)
        settings = load_settings(config)
        model = prepare_model(default_home())
        stack = embedded_stack(settings, config, model, services=("proxy", "judge", "learner"))
        console.print("starting the embedded stack ...")
        stack.start(on_wait=lambda part: console.print(f"  {part.name} ({part.address})"))
        try:
            create_topics(settings)
            soak = Soak(
                settings,
                dict.fromkeys(("kafka", "redis", "vllm", "proxy", "judge", "learner"), stack),
                ALIAS,
                seconds=args.minutes * 60,
                clients=args.clients,
                fault_every_s=args.fault_every,
                hold_s=args.hold,
                seed=args.seed,
                faults=FAULTS,
            )
            columns = (
                TextColumn("soak"),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )
            with Progress(*columns, console=console) as progress:
                task = progress.add_task("", total=soak.seconds)

                def on_progress(t: float) -> None:
                    faults = ", ".join(f.part for f in soak.chaos.faults) or "none yet"
                    answered = sum(1 for e in soak.exchanges if e.status == 200)
                    progress.update(
                        task, completed=t, description=f"{answered} answered; faults: {faults}"
                    )

                report = soak.run(on_progress)
        finally:
            stack.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.to_json())
    plot(report, args.out.with_suffix(".png"))
    print_report(console, report)
    console.print(f"written: {args.out} and {args.out.with_suffix('.png')}")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()

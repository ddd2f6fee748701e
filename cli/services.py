"""`ratchet proxy`, `judge` (and `judge calibrate`), `learner` and `console`: run one service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.app import ConfigOption, app, console, settings_or_exit

judge_app = typer.Typer(
    help="Turn logged traffic into scored groups (RULER or a verifier).",
    invoke_without_command=True,
)
app.add_typer(judge_app, name="judge")


@app.command()
def proxy(config: ConfigOption = None) -> None:
    """Serve the OpenAI-compatible proxy."""
    from proxy.server import serve

    serve(settings_or_exit(config))


@judge_app.callback()
def judge(ctx: typer.Context, config: ConfigOption = None) -> None:
    """Run the judge: consume ratchet.traffic, produce ratchet.groups and ratchet.heldout."""
    if ctx.invoked_subcommand is not None:
        return
    from judge.service import serve as serve_judge

    serve_judge(settings_or_exit(config))


@judge_app.command("calibrate")
def judge_calibrate(
    labels: Annotated[Path, typer.Option(help="JSONL of labelled groups: prompt, samples, labels")],
    alias: Annotated[str | None, typer.Option(help="alias whose reward settings to use")] = None,
    out: Annotated[
        Path | None, typer.Option(help="write the report (JSON) and a plot here")
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Check a judge against labelled groups: rank agreement and position bias."""
    from judge.calibrate import calibrate

    settings = settings_or_exit(config)
    name = alias or next(iter(settings.aliases))
    if name not in settings.aliases:
        console.print(f"[red]unknown alias {name!r}[/red]")
        raise typer.Exit(2)
    raise typer.Exit(calibrate(settings, settings.aliases[name].reward, labels, out, console))


@app.command("console")
def console_service(config: ConfigOption = None) -> None:
    """Serve the web console: every alias, its rounds and canary, live, with admin actions."""
    from console.service import serve

    serve(settings_or_exit(config))


@app.command()
def learner(config: ConfigOption = None) -> None:
    """Run the learner: GRPO rounds on ratchet.groups, the gate, canaries and rollbacks."""
    from learner.service import serve

    serve(settings_or_exit(config))

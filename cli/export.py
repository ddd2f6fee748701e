"""`ratchet export`: an alias's groups, ratings, gate pairs or traffic as a dataset folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.app import AliasArgument, ConfigOption, app, console, settings_or_exit


@app.command()
def export(
    alias: AliasArgument,
    what: Annotated[str, typer.Option(help="groups, ratings, pairs or traffic")] = "groups",
    since: Annotated[
        str | None, typer.Option(help="only records from then on: 30m, 24h, 7d or an ISO time")
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="parquet or jsonl")] = "parquet",
    out: Annotated[
        Path | None, typer.Option(help="the folder to write (default ./<alias>-<what>)")
    ] = None,
    shard_rows: Annotated[int, typer.Option(min=1, help="rows per shard file")] = 1000,
    config: ConfigOption = None,
) -> None:
    """Export an alias's data as a Hugging Face `datasets` folder, streamed from Kafka. An
    interrupted export is continued by the same command."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    try:
        from cli.exporter.run import ExportError, begin
        from cli.exporter.run import export as run_export
    except ImportError as exc:  # pyarrow: the export extra (the learner's image has it)
        console.print(f"[red]{exc}: install ratchet[export] to export[/red]")
        raise typer.Exit(2) from None

    settings = settings_or_exit(config)
    if alias not in settings.aliases:
        console.print(f"[red]unknown alias {alias!r}: add it to ratchet.yaml first[/red]")
        raise typer.Exit(2)
    folder = out or Path(f"{alias}-{what}")
    try:
        state = begin(settings, folder, alias, what, fmt, since)
        if state.done:
            console.print(f"{folder} is complete: {state.rows} rows in {state.shards} shards")
            return
        if state.shards or state.positions:
            console.print(f"continuing the export in {folder} after {state.rows} rows")
        columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"{what} of {alias}: records read", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            state = run_export(settings, folder, state, shard_rows, progress)
    except ExportError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(
        f"{folder}: {state.rows} rows of {what} in {state.shards} {fmt} shards, "
        f"with a dataset card (README.md)"
    )

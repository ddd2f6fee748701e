"""The `ratchet` Typer app and what every command group shares: the console and --config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ratchet.settings import ConfigError, RatchetSettings, load_settings

app = typer.Typer(
    help="Ratchet: an LLM endpoint that improves itself from its own traffic.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="ratchet.yaml to use (default: $RATCHET_CONFIG, else ./ratchet.yaml)"
    ),
]
AliasArgument = Annotated[str, typer.Argument(help="the alias (the model name clients send)")]


def settings_or_exit(config: Path | None) -> RatchetSettings:
    """Load settings; on a bad setting print what to fix and exit 2."""
    try:
        return load_settings(config)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None

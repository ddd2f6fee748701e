"""The `ratchet` command line: the app in ``app``, one module per command group."""

from __future__ import annotations

import sys

# Importing a command group registers its commands on the app, in this order in `--help`.
# isort: off
from cli import stack, services, routing, status, lifecycle, adapters, export, demo  # noqa: F401

# isort: on
from cli.app import app, console
from ratchet.settings import ConfigError


def main() -> None:
    try:
        app()
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        sys.exit(2)

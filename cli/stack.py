"""`ratchet up`, `down` and `prepare-model`: the embedded stack on this machine."""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from cli.app import ConfigOption, app, console, settings_or_exit
from ratchet.settings import RatchetSettings, config_path

if TYPE_CHECKING:  # the heavy modules load only in the commands that use them
    from embedded.processes import Part, Stack


@app.command()
def up(config: ConfigOption = None) -> None:
    """Run the whole loop on this machine: broker, Redis, vLLM (CPU), proxy, judge, learner."""
    from embedded.config import write_default_config
    from embedded.model import prepare_model
    from embedded.processes import PartFailed
    from embedded.stack import create_topics, embedded_stack, read_state

    path = config or config_path()
    if write_default_config(path):
        console.print(f"Wrote a default config to [bold]{path}[/bold]")
    settings = settings_or_exit(path)
    assert settings.state_dir is not None
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    if read_state(settings.state_dir):
        console.print(
            "[yellow]A stack seems to be running already; `ratchet down` stops it.[/yellow]"
        )
        raise typer.Exit(1)
    model_path = prepare_model(settings.home)
    stack = embedded_stack(settings, path.resolve(), model_path)

    def on_signal(signum: int, _: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        with console.status("") as status:

            def waiting(part: Part) -> None:
                status.update(
                    f"Starting [bold]{part.name}[/bold] and waiting for it to be healthy…"
                )

            for part in stack.parts:
                stack.start_part(part.name, waiting)
                if part.name == "kafka":
                    create_topics(settings)
            stack.write_state()
        _print_stack(stack, settings)
        while True:
            stack.check()
            time.sleep(1)
    except PartFailed as exc:
        console.print(f"[red]✗ {exc}[/red]")
        _stop_uninterrupted(stack)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("\nStopping…")
        started = time.monotonic()
        _stop_uninterrupted(stack)
        console.print(f"Stopped in {time.monotonic() - started:.1f}s.")


def _stop_uninterrupted(stack: Stack) -> None:
    """Stop every part; a second Ctrl-C or `ratchet down` meanwhile would leave some running,
    and the stop is bounded anyway (STOP_DEADLINE_S)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    stack.stop()


def _print_stack(stack: Stack, settings: RatchetSettings) -> None:
    table = Table(title="Ratchet embedded stack")
    for column in ("part", "address", "pid", "log"):
        table.add_column(column)
    for part in stack.parts:
        pid = str(part.process.pid) if part.process else "-"
        table.add_row(part.name, part.address, pid, str(part.log_path))
    console.print(table)
    aliases = ", ".join(settings.aliases)
    console.print(
        f"Point an OpenAI client at [bold]http://{settings.proxy.host}:{settings.proxy.port}/v1"
        f"[/bold] with model = one of: {aliases}. Ctrl-C or `ratchet down` stops everything."
    )
    if not settings.auth_enabled:
        console.print(
            "Auth is off (loopback only). Set proxy.api_keys in ratchet.yaml to require keys."
        )


@app.command()
def down(config: ConfigOption = None) -> None:
    """Stop a stack started by `ratchet up`."""
    from embedded.stack import stop_running

    settings = settings_or_exit(config)
    assert settings.state_dir is not None
    started = time.monotonic()
    if stop_running(settings.state_dir):
        console.print(f"Stopped in {time.monotonic() - started:.1f}s.")
    else:
        console.print("No running stack found.")


@app.command("prepare-model")
def prepare_model_command(config: ConfigOption = None) -> None:
    """Convert the bundled SmolLM2 GGUF to the safetensors folder vLLM serves (once)."""
    from embedded.model import prepare_model

    console.print(str(prepare_model(settings_or_exit(config).home)))

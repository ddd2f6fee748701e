"""The `ratchet` command line."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ratchet.settings import ConfigError, RatchetSettings, config_path, load_settings

if TYPE_CHECKING:  # the heavy modules load only in the commands that use them
    from ratchet.registry import AliasRoute, RegistryWriter
    from ratchet.stack import Part, Stack

app = typer.Typer(
    help="Ratchet: an LLM endpoint that improves itself from its own traffic.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
alias_app = typer.Typer(
    help="Read and change which version each alias serves.", no_args_is_help=True
)
app.add_typer(alias_app, name="alias")
judge_app = typer.Typer(
    help="Turn logged traffic into scored groups (RULER or a verifier).",
    invoke_without_command=True,
)
app.add_typer(judge_app, name="judge")
console = Console()

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="ratchet.yaml to use (default: $RATCHET_CONFIG, else ./ratchet.yaml)"
    ),
]


def _settings(config: Path | None) -> RatchetSettings:
    try:
        return load_settings(config)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@app.command()
def up(config: ConfigOption = None) -> None:
    """Run the whole loop on this machine: broker, Redis, vLLM (CPU), proxy, judge, learner."""
    from ratchet.model import prepare_model
    from ratchet.settings import write_default_config
    from ratchet.stack import PartFailed, create_topics, embedded_stack, read_state

    path = config or config_path()
    if write_default_config(path):
        console.print(f"Wrote a default config to [bold]{path}[/bold]")
    settings = _settings(path)
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
        stack.stop()
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("\nStopping…")
        stack.stop()
        console.print("Stopped.")


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
    from ratchet.stack import stop_running

    settings = _settings(config)
    assert settings.state_dir is not None
    if stop_running(settings.state_dir):
        console.print("Stopped.")
    else:
        console.print("No running stack found.")


@app.command()
def proxy(config: ConfigOption = None) -> None:
    """Serve the OpenAI-compatible proxy."""
    from proxy.server import serve

    serve(_settings(config))


@judge_app.callback()
def judge(ctx: typer.Context, config: ConfigOption = None) -> None:
    """Run the judge: consume ratchet.traffic, produce ratchet.groups and ratchet.heldout."""
    if ctx.invoked_subcommand is not None:
        return
    from judge.service import serve as serve_judge

    serve_judge(_settings(config))


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

    settings = _settings(config)
    name = alias or next(iter(settings.aliases))
    if name not in settings.aliases:
        console.print(f"[red]unknown alias {name!r}[/red]")
        raise typer.Exit(2)
    raise typer.Exit(calibrate(settings, settings.aliases[name].reward, labels, out, console))


@app.command("prepare-model")
def prepare_model_command(config: ConfigOption = None) -> None:
    """Convert the bundled SmolLM2 GGUF to the safetensors folder vLLM serves (once)."""
    from ratchet.model import prepare_model

    console.print(str(prepare_model(_settings(config).home)))


@alias_app.command("set")
def alias_set(
    alias: str,
    active: Annotated[int | None, typer.Option(help="version to serve (0 = base model)")] = None,
    canary: Annotated[str | None, typer.Option(help="canary version, or 'none'")] = None,
    weight: Annotated[float | None, typer.Option(help="share of traffic for the canary")] = None,
    config: ConfigOption = None,
) -> None:
    """Change an alias's routing; every proxy picks it up at once."""
    from dataclasses import replace

    from ratchet.records import LifecycleEvent
    from ratchet.registry import RegistryWriter
    from ratchet.settings import NAME_PATTERN, NAME_RULE

    settings = _settings(config)
    if not NAME_PATTERN.match(alias):
        console.print(f"[red]alias {alias!r} is not a valid name: {NAME_RULE}[/red]")
        raise typer.Exit(2)
    if weight is not None and not 0.0 <= weight <= 1.0:
        console.print("[red]--weight must be in [0, 1][/red]")
        raise typer.Exit(2)
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    route = writer.read(alias)
    if route is None:
        console.print(f"[red]unknown alias {alias!r}: add it to ratchet.yaml first[/red]")
        raise typer.Exit(2)
    changes: dict[str, object] = {}
    if active is not None:
        if active < 0:
            console.print("[red]--active must be >= 0[/red]")
            raise typer.Exit(2)
        changes["active"] = active
    if canary is not None:
        changes["canary"] = None if canary.lower() == "none" else int(canary)
        if changes["canary"] is None:
            changes["canary_weight"] = 0.0
    if weight is not None:
        changes["canary_weight"] = weight
    new = replace(route, **changes)
    event = LifecycleEvent(
        alias=alias,
        kind="route",
        version=new.active,
        previous_version=route.active,
        actor="cli",
        detail={"canary": new.canary, "canary_weight": new.canary_weight},
    )
    writer.write(new, event)
    _print_routes({alias: new})


@alias_app.command("show")
def alias_show(
    alias: Annotated[str | None, typer.Argument()] = None, config: ConfigOption = None
) -> None:
    """Show which version each alias serves."""
    _print_routes(read_routes(_settings(config), alias)[1])


def read_routes(
    settings: RatchetSettings, alias: str | None
) -> tuple[RegistryWriter, dict[str, AliasRoute]]:
    """The registry and its routes: every alias's, or the one named (exit 2 if unknown)."""
    from ratchet.registry import RegistryWriter

    writer = RegistryWriter(settings.redis_url, settings.aliases)
    routes = writer.read_all()
    if alias is not None:
        if alias not in routes:
            console.print(f"[red]unknown alias {alias!r}[/red]")
            raise typer.Exit(2)
        routes = {alias: routes[alias]}
    return writer, routes


def _print_routes(routes: dict[str, AliasRoute]) -> None:
    from ratchet.registry import served_name

    table = Table()
    for column in ("alias", "active", "served as", "canary", "weight", "updated"):
        table.add_column(column)
    for name, route in sorted(routes.items()):
        table.add_row(
            name,
            f"v{route.active}",
            served_name(name, route.active, route.base_model),
            "-" if route.canary is None else f"v{route.canary}",
            f"{route.canary_weight:.0%}",
            route.updated_at or "-",
        )
    console.print(table)


# The learner's commands live in their own module; importing it registers them on `app`.
from ratchet import cli_learning  # noqa: E402, F401


def main() -> None:
    try:
        app()
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        sys.exit(2)


if __name__ == "__main__":
    main()

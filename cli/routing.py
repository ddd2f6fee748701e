"""`ratchet alias set|show`: which version each alias serves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from cli.app import ConfigOption, app, console, settings_or_exit
from ratchet.settings import RatchetSettings

if TYPE_CHECKING:
    from ratchet.registry import AliasRoute, RegistryWriter

alias_app = typer.Typer(
    help="Read and change which version each alias serves.", no_args_is_help=True
)
app.add_typer(alias_app, name="alias")


@alias_app.command("set")
def alias_set(
    alias: str,
    active: Annotated[int | None, typer.Option(help="version to serve (0 = base model)")] = None,
    canary: Annotated[str | None, typer.Option(help="canary version, or 'none'")] = None,
    weight: Annotated[float | None, typer.Option(help="share of traffic for the canary")] = None,
    force: Annotated[
        bool, typer.Option(help="serve a version the gate rejected or never judged")
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Change an alias's routing; every proxy picks it up at once."""
    from ratchet.registry import KEEP, RegistryWriter, set_route
    from ratchet.secrets import redis_connection_url
    from ratchet.settings import NAME_PATTERN, NAME_RULE

    settings = settings_or_exit(config)
    if not NAME_PATTERN.match(alias):
        console.print(f"[red]alias {alias!r} is not a valid name: {NAME_RULE}[/red]")
        raise typer.Exit(2)
    if weight is not None and not 0.0 <= weight <= 1.0:
        console.print("[red]--weight must be in [0, 1][/red]")
        raise typer.Exit(2)
    if active is not None and active < 0:
        console.print("[red]--active must be >= 0[/red]")
        raise typer.Exit(2)
    if alias not in settings.aliases:  # before the gate's verdicts, which would not say so
        console.print(f"[red]unknown alias {alias!r}: add it to ratchet.yaml first[/red]")
        raise typer.Exit(2)
    writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
    try:
        new_canary: int | object | None = KEEP
        if canary is not None:
            new_canary = None if canary.lower() == "none" else int(canary)
        overrode = unservable(settings, writer, alias, [active, new_canary])
        if overrode and not force:
            for why in overrode:
                console.print(f"[red]{why}; pass --force to serve it anyway[/red]")
            raise typer.Exit(1)
        new = set_route(writer, alias, "cli", active, new_canary, weight, forced=overrode)
    except (LookupError, ValueError) as exc:  # InvalidRoute is a ValueError too
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    print_routes({alias: new})


def unservable(
    settings: RatchetSettings, writer: RegistryWriter, alias: str, versions: list[object]
) -> list[str]:
    """Why each of the versions to be served (ints; others are kept or none) is not servable."""
    from ratchet.registry import HISTORY_LIMIT
    from ratchet.store import AdapterStore
    from ratchet.verdict import gate_verdict

    wanted = [v for v in versions if isinstance(v, int) and v > 0]
    if not wanted:
        return []
    assert settings.store_dir is not None  # RatchetSettings fills it in
    store, history = AdapterStore(settings.store_dir), writer.history(alias, HISTORY_LIMIT)
    verdicts = [gate_verdict(store, history, alias, version) for version in wanted]
    return [v.describe() for v in verdicts if not v.servable]


@alias_app.command("show")
def alias_show(
    alias: Annotated[str | None, typer.Argument()] = None, config: ConfigOption = None
) -> None:
    """Show which version each alias serves."""
    print_routes(read_routes(settings_or_exit(config), alias)[1])


def read_routes(
    settings: RatchetSettings, alias: str | None
) -> tuple[RegistryWriter, dict[str, AliasRoute]]:
    """The registry and its routes: every alias's, or the one named (exit 2 if unknown)."""
    from ratchet.registry import RegistryWriter
    from ratchet.secrets import redis_connection_url

    writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
    table = writer.read_all()
    for why in table.invalid.values():
        console.print(f"[yellow]{why}: fix or delete that hash; shown with its defaults[/yellow]")
    routes = table.routes
    if alias is not None:
        if alias not in routes:
            console.print(f"[red]unknown alias {alias!r}[/red]")
            raise typer.Exit(2)
        routes = {alias: routes[alias]}
    return writer, routes


def print_routes(routes: dict[str, AliasRoute]) -> None:
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

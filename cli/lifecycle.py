"""`ratchet promote`, `rollback`, `pause` and `resume`: one lifecycle change each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from cli.app import AliasArgument, ConfigOption, app, console, settings_or_exit
from ratchet.settings import RatchetSettings

if TYPE_CHECKING:
    from ratchet.lifecycle import Lifecycle


def lifecycle_for(settings: RatchetSettings, alias: str) -> Lifecycle:
    from ratchet.lifecycle import EventSink, Lifecycle
    from ratchet.registry import RegistryWriter
    from ratchet.secrets import redis_connection_url
    from ratchet.settings import NAME_PATTERN, NAME_RULE
    from ratchet.store import AdapterStore

    if not NAME_PATTERN.match(alias):
        console.print(f"[red]alias {alias!r} is not a valid name: {NAME_RULE}[/red]")
        raise typer.Exit(2)
    assert settings.store_dir is not None
    writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
    return Lifecycle(writer, AdapterStore(settings.store_dir), EventSink(settings, 5.0), "cli")


@contextlib.contextmanager
def lifecycle_session(settings: RatchetSettings, alias: str) -> Iterator[Lifecycle]:
    """The alias's Lifecycle for one command: a refused change exits 1 with the reason, and its
    event sink is closed (its events flushed) however the command ends."""
    from ratchet.lifecycle import LifecycleError

    lifecycle = lifecycle_for(settings, alias)
    try:
        yield lifecycle
    except LifecycleError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    finally:
        if lifecycle.sink is not None:
            lifecycle.sink.close()


def _apply(settings: RatchetSettings, alias: str, change: str, **kwargs: object) -> None:
    """Run one Lifecycle change and report it; a refused change exits 1 with the reason."""
    from ratchet.registry import served_name

    with lifecycle_session(settings, alias) as lifecycle:
        route = getattr(lifecycle, change)(alias, **kwargs)
    served = served_name(alias, route.active, route.base_model)
    paused = " (learning paused)" if route.paused else ""
    console.print(f"{alias}: active v{route.active} ({served}){paused}")
    if lifecycle.unsent:
        console.print(
            "[yellow]Kafka is unreachable: the change is in effect and in the alias's Redis "
            "history, but its event is not on ratchet.events.[/yellow]"
        )


@app.command()
def promote(
    alias: AliasArgument,
    version: Annotated[
        int | None, typer.Option(help="version to make active (default: the running canary)")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="serve a version the gate rejected or never judged")
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Make a version active now (ends any canary)."""
    from cli.routing import unservable

    settings = settings_or_exit(config)
    with lifecycle_session(settings, alias) as lifecycle:  # an unknown alias: exit 1, said why
        if version is None:
            route = lifecycle.route(alias)
            if route.canary is None:
                console.print(f"[red]{alias} has no canary; name one with --version N[/red]")
                raise typer.Exit(1)
            version = route.canary
        # As `alias set` and the console: a version the gate never passed is not served by a
        # typo.
        refused = [] if force else unservable(settings, lifecycle.writer, alias, [version])
    if refused:
        console.print(f"[red]{'; '.join(refused)}; pass --force to serve it anyway[/red]")
        raise typer.Exit(1)
    _apply(settings, alias, "promote", version=version, detail={"via": "cli"}, force=force)


@app.command()
def rollback(
    alias: AliasArgument,
    reason: Annotated[str, typer.Option(help="recorded in the rollback event")] = "manual",
    config: ConfigOption = None,
) -> None:
    """One step back, at once: end the canary, or restore the previously active version."""
    _apply(settings_or_exit(config), alias, "rollback", reason=reason)


@app.command()
def pause(
    alias: AliasArgument,
    reason: Annotated[str, typer.Option(help="recorded in the pause event")] = "manual",
    config: ConfigOption = None,
) -> None:
    """Stop learning for an alias (it keeps serving its active version)."""
    _apply(settings_or_exit(config), alias, "pause", reason=reason)


@app.command()
def resume(alias: AliasArgument, config: ConfigOption = None) -> None:
    """Resume learning for a paused alias."""
    _apply(settings_or_exit(config), alias, "resume")

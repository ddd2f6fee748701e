"""The learner's commands: `ratchet learner`, `status`, `promote`, `rollback`, `pause`, `resume`,
`report` and `demo`. Registered on the main app by ratchet/cli.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ratchet.cli import ConfigOption, _settings, app, console, read_routes
from ratchet.settings import RatchetSettings

if TYPE_CHECKING:
    from ratchet.lifecycle import Lifecycle

AliasArgument = Annotated[str, typer.Argument(help="the alias (the model name clients send)")]


@app.command()
def learner(config: ConfigOption = None) -> None:
    """Run the learner: GRPO rounds on ratchet.groups, the gate, canaries and rollbacks."""
    from learner.service import serve

    serve(_settings(config))


def _lifecycle(settings: RatchetSettings, alias: str) -> Lifecycle:
    from ratchet.lifecycle import EventSink, Lifecycle
    from ratchet.registry import RegistryWriter
    from ratchet.settings import NAME_PATTERN, NAME_RULE
    from ratchet.store import AdapterStore

    if not NAME_PATTERN.match(alias):
        console.print(f"[red]alias {alias!r} is not a valid name: {NAME_RULE}[/red]")
        raise typer.Exit(2)
    assert settings.store_dir is not None
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    return Lifecycle(writer, AdapterStore(settings.store_dir), EventSink(settings, 5.0), "cli")


def _apply(settings: RatchetSettings, alias: str, change: str, **kwargs: object) -> None:
    """Run one Lifecycle change and report it; a refused change exits 1 with the reason."""
    from ratchet.lifecycle import LifecycleError
    from ratchet.registry import served_name

    lifecycle = _lifecycle(settings, alias)
    try:
        route = getattr(lifecycle, change)(alias, **kwargs)
    except LifecycleError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    finally:
        if lifecycle.sink is not None:
            lifecycle.sink.close()
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
    force: Annotated[bool, typer.Option(help="serve a version the gate rejected")] = False,
    config: ConfigOption = None,
) -> None:
    """Make a version active now (ends any canary)."""
    settings = _settings(config)
    if version is None:
        route = _lifecycle(settings, alias).route(alias)
        if route.canary is None:
            console.print(f"[red]{alias} has no canary; name one with --version N[/red]")
            raise typer.Exit(1)
        version = route.canary
    _apply(settings, alias, "promote", version=version, detail={"via": "cli"}, force=force)


@app.command()
def rollback(
    alias: AliasArgument,
    reason: Annotated[str, typer.Option(help="recorded in the rollback event")] = "manual",
    config: ConfigOption = None,
) -> None:
    """One step back, at once: end the canary, or restore the previously active version."""
    _apply(_settings(config), alias, "rollback", reason=reason)


@app.command()
def pause(
    alias: AliasArgument,
    reason: Annotated[str, typer.Option(help="recorded in the pause event")] = "manual",
    config: ConfigOption = None,
) -> None:
    """Stop learning for an alias (it keeps serving its active version)."""
    _apply(_settings(config), alias, "pause", reason=reason)


@app.command()
def resume(alias: AliasArgument, config: ConfigOption = None) -> None:
    """Resume learning for a paused alias."""
    _apply(_settings(config), alias, "resume")


@app.command()
def status(
    alias: Annotated[str | None, typer.Argument(help="one alias (default: all)")] = None,
    rounds: Annotated[int, typer.Option(help="rounds to show per alias")] = 3,
    config: ConfigOption = None,
) -> None:
    """Per alias: active version, canary, pause, the last rounds with reward and gate result."""
    from ratchet.report import learner_lag, rounds_of

    settings = _settings(config)
    writer, routes = read_routes(settings, alias)
    table = Table()
    for column in ("alias", "active", "canary", "learning", "last rounds (reward, gate)"):
        table.add_column(column)
    for name, route in sorted(routes.items()):
        history = writer.history(name, limit=500)
        lines = []
        for row in rounds_of(history)[-rounds:]:
            gate = (
                "not gated yet"
                if row.win_rate is None
                else f"win {row.win_rate:.2f} [{row.ci_low:.2f}, {row.ci_high:.2f}] n={row.pairs}"
            )
            reward = "-" if row.mean_reward is None else f"{row.mean_reward:.3f}"
            lines.append(f"v{row.version}: reward {reward}, {gate}, {row.outcome}")
        canary = "-" if route.canary is None else f"v{route.canary} ({route.canary_weight:.0%})"
        learning = "paused" if route.paused else "on"
        if route.paused:
            reason = next(
                (e.get("detail", {}).get("reason") for e in history if e.get("kind") == "pause"),
                None,
            )
            learning += f": {reason}" if reason else ""
        table.add_row(name, f"v{route.active}", canary, learning, "\n".join(lines) or "-")
    console.print(table)
    lag = learner_lag(settings)
    console.print(
        "Learner queue lag: "
        + ("unknown (Kafka unreachable)" if lag is None else f"{lag} groups not yet committed")
    )


@app.command()
def report(
    alias: AliasArgument,
    out: Annotated[Path | None, typer.Option(help="PNG to write")] = None,
    config: ConfigOption = None,
) -> None:
    """Plot reward per round and gate win rate (95% CI) for an alias, promotions marked."""
    from ratchet.registry import RegistryWriter
    from ratchet.report import plot_rounds, rounds_of

    settings = _settings(config)
    if alias not in settings.aliases:
        console.print(f"[red]unknown alias {alias!r}[/red]")
        raise typer.Exit(2)
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    rows = rounds_of(writer.history(alias, limit=1000))
    if not rows:
        console.print(f"{alias} has no learning rounds yet.")
        raise typer.Exit(1)
    path = out or Path(f"{alias}-report.png")
    plot_rounds(alias, rows, settings.aliases[alias].gate.threshold, path)
    console.print(f"Wrote {path} ({len(rows)} rounds)")


@app.command()
def demo(
    alias: Annotated[str, typer.Option(help="alias to send the demo prompts to")] = "demo",
    count: Annotated[int, typer.Option(help="prompts to send (the set repeats if larger)")] = 200,
    rounds: Annotated[int, typer.Option(help="times to replay the prompts")] = 1,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 4,
    feedback: Annotated[
        bool,
        typer.Option(help="rate each answer with its verifier score via /v1/feedback, as a user"),
    ] = True,
    api_key: Annotated[str, typer.Option(envvar="RATCHET_DEMO_API_KEY")] = "unused",
    config: ConfigOption = None,
) -> None:
    """Replay the bundled demo prompts through the proxy as traffic, and score the answers.

    Prints the demo verifier's mean score per version that answered, so a promotion shows up as
    a new row with a higher score. Each score also goes back as user feedback, which is what a
    canary is judged by.
    """
    import asyncio

    import httpx
    from rich.progress import Progress

    from ratchet.demo import extraction_reward, load_prompts

    settings = _settings(config)
    if alias not in settings.aliases:
        console.print(f"[red]alias {alias!r} is not in ratchet.yaml[/red]")
        raise typer.Exit(2)
    prompts = load_prompts()
    work = [prompts[i % len(prompts)] for i in range(count)] * rounds
    base_url = f"http://{settings.proxy.host}:{settings.proxy.port}/v1"
    scores: dict[str, list[float]] = {}
    failures: list[str] = []

    async def replay(progress: Progress, task: int) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)
        raters = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
        )
        limit = asyncio.Semaphore(concurrency)

        async def one(prompt: dict[str, object]) -> None:
            messages = prompt["messages"]
            async with limit:
                try:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=alias, messages=messages, max_tokens=64, temperature=0.0
                    )
                except openai.OpenAIError as exc:
                    failures.append(str(exc)[:200])
                else:
                    completion = raw.parse()
                    answer = completion.choices[0].message
                    served = raw.headers.get("x-ratchet-served-name", "?")
                    sample = {"role": "assistant", "content": answer.content}
                    score = extraction_reward(messages, sample)
                    scores.setdefault(served, []).append(score)
                    if feedback:
                        rating = {"completion_id": completion.id, "score": score}
                        try:
                            rated = await raters.post("/feedback", json=rating)
                        except httpx.HTTPError as exc:
                            failures.append(f"feedback: {exc}"[:200])
                        else:
                            if rated.status_code != 200:
                                failures.append(f"feedback: {rated.status_code} {rated.text}"[:200])
            progress.advance(task)

        await asyncio.gather(*(one(p) for p in work))
        await client.close()
        await raters.aclose()

    with Progress(console=console) as progress:
        task = progress.add_task(f"Sending demo traffic to {alias}", total=len(work))
        asyncio.run(replay(progress, task))
    table = Table(title=f"{alias}: demo verifier score by version that answered")
    for column in ("served as", "answers", "mean score"):
        table.add_column(column)
    for served, values in sorted(scores.items()):
        table.add_row(served, str(len(values)), f"{sum(values) / len(values):.3f}")
    console.print(table)
    if failures:
        console.print(f"[yellow]{len(failures)} requests failed, e.g. {failures[0]}[/yellow]")

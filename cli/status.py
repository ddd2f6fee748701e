"""`ratchet status` and `report`: what the loop has done, as a table and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from cli.app import AliasArgument, ConfigOption, app, console, settings_or_exit
from cli.routing import read_routes

if TYPE_CHECKING:
    import redis

    from ratchet.registry import AliasRoute
    from ratchet.rounds import RoundRow
    from ratchet.settings import AliasConfig


@app.command()
def status(
    alias: Annotated[str | None, typer.Argument(help="one alias (default: all)")] = None,
    rounds: Annotated[int, typer.Option(help="rounds to show per alias")] = 3,
    config: ConfigOption = None,
) -> None:
    """Per alias: active version, canary, pause, what the learner is doing, the last rounds
    with reward, gate result and cost, and the judge's spend today."""
    from cli.report import learner_lag, rounds_of
    from ratchet.rewards.agreement import probes_agreement
    from ratchet.spend import budget_line, read_spend

    settings = settings_or_exit(config)
    writer, routes = read_routes(settings, alias)
    table = Table()
    columns = (
        "alias",
        "active",
        "canary",
        "learning",
        "learner",
        "last rounds (reward, gate, cost)",
    )
    for column in columns:
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
            if row.lift_text():
                gate += f", {row.lift_text()}"
            if row.origin == "import":
                label, trained = f"v{row.version} (imported)", f"from {row.source}"
            else:
                reward = "-" if row.mean_reward is None else f"{row.mean_reward:.3f}"
                start = f" (on from v{row.trained_from})" if row.carried_on else ""
                label, trained = f"v{row.version}{start}", f"reward {reward}"
            lines.append(f"{label}: {trained}, {gate}, {row.outcome}")
            if row.bill is not None:
                lines.append(f"  cost: {row.bill.line()}")
        canary = canary_cell(writer.redis, name, route)
        learning = "paused" if route.paused else "on"
        if route.paused:
            reason = next(
                (e.get("detail", {}).get("reason") for e in history if e.get("kind") == "pause"),
                None,
            )
            learning += f": {reason}" if reason else ""
        alias_config = settings.aliases.get(name)
        if alias_config is not None and alias_config.reward.learns_from_ratings:
            learning += "\n" + reward_model_line(writer.redis, name)
        if alias_config is not None and probes_agreement(alias_config):
            learning += "\n" + agreement_line(writer.redis, name, alias_config)
        if alias_config is not None:
            cap = alias_config.learning.max_cost_per_day
            learning += "\n" + budget_line(read_spend(writer.redis, name), cap)
        table.add_row(
            name,
            f"v{route.active}",
            canary,
            learning,
            learner_line(writer.redis, name),
            "\n".join(lines) or "-",
        )
    console.print(table)
    lag = learner_lag(settings)
    console.print(
        "Learner queue lag: "
        + ("unknown (Kafka unreachable)" if lag is None else f"{lag} groups not yet committed")
    )


def canary_cell(client: redis.Redis, alias: str, route: AliasRoute) -> str:
    """The canary and its share, and what the reward-hacking guard said of it, or of the
    active version it let through ("could not check" included: learner/reward_guard.py)."""
    from ratchet.reward_guard_state import guard_line

    canary = "-" if route.canary is None else f"v{route.canary} ({route.canary_weight:.0%})"
    guard = guard_line(client, alias, (route.canary, route.active))
    return canary if guard is None else f"{canary}\n{guard}"


def reward_model_line(client: redis.Redis, alias: str) -> str:
    """Why a feedback alias learns or waits: its reward model's held-out quality."""
    from ratchet.rewards.reward_status import RewardStatus, describe_reward_model

    return describe_reward_model(alias, RewardStatus.read(client, alias))


def agreement_line(client: redis.Redis, alias: str, config: AliasConfig) -> str:
    """How far the judge agrees with the users on rated answers (judge/agreement.py)."""
    from ratchet.rewards.agreement import read_agreement

    measures = read_agreement(client, alias)
    if measures is None:
        return "judge-user agreement: no rated answer scored yet"
    line = measures.line()
    low = measures.pairwise_accuracy is not None and (
        measures.pairwise_accuracy < config.feedback.min_agreement
        and measures.pairs >= config.feedback.agreement_min_pairs
    )
    if low:
        return f"[red]{line}: below feedback.min_agreement {config.feedback.min_agreement}[/red]"
    return line


def learner_line(client: redis.Redis, alias: str) -> str:
    """The alias's learner progress in one line; its hash expires when no learner renews it."""
    from ratchet.progress import read_progress

    progress = read_progress(client, alias)
    return "no learner progress" if progress is None else progress.describe()


@app.command()
def report(
    alias: AliasArgument,
    out: Annotated[Path | None, typer.Option(help="PNG to write")] = None,
    config: ConfigOption = None,
) -> None:
    """Plot reward per round and gate win rate (95% CI) for an alias, promotions marked."""
    from cli.report import plot_rounds, rounds_of
    from ratchet.registry import RegistryWriter
    from ratchet.secrets import redis_connection_url

    settings = settings_or_exit(config)
    if alias not in settings.aliases:
        console.print(f"[red]unknown alias {alias!r}[/red]")
        raise typer.Exit(2)
    writer = RegistryWriter(redis_connection_url(settings), settings.aliases)
    rows = rounds_of(writer.history(alias, limit=1000))
    if not rows:
        console.print(f"{alias} has no learning rounds yet.")
        raise typer.Exit(1)
    path = out or Path(f"{alias}-report.png")
    plot_rounds(alias, rows, settings.aliases[alias].gate.threshold, path)
    console.print(f"Wrote {path} ({len(rows)} rounds)")
    console.print(cost_table(rows))


def cost_table(rows: list[RoundRow]) -> Table:
    """Each round's bill, and for each promotion what it cost and what it bought."""
    from ratchet.rounds import promotion_bills

    promoted = promotion_bills(rows)
    table = Table(title="What learning cost")
    for column in ("version", "outcome", "round's cost", "cost to promote", "gate lift"):
        table.add_column(column)
    for row in rows:
        bill = promoted.get(row.version)
        table.add_row(
            f"v{row.version}",
            row.outcome,
            row.bill.line() if row.bill else "-",
            bill.line() if bill else "",
            row.lift_text() or "-",
        )
    return table

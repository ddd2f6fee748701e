"""HTML for the console: Jinja2 templates (console/templates, autoescaped) and the rounds plot,
drawn as inline SVG on the server so a page needs no chart library and works offline."""

from __future__ import annotations

from html import escape
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from ratchet.rounds import RoundRow

# The plot's colours, shared with console.css: chosen for at least 4.5:1 contrast on white.
PASSED, FAILED, REWARD, GRID = "#166a2e", "#b42318", "#1d4ed8", "#6b7280"

environment = Environment(
    loader=PackageLoader("console", "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


def number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """The last message's text (the question a held-out prompt asks)."""
    content = messages[-1].get("content") if messages else ""
    if isinstance(content, list):  # content parts: their text
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


environment.filters["number"] = number
environment.filters["count_of"] = lambda value: "-" if value is None else f"{value:.0f}"
environment.filters["prompt_text"] = prompt_text
environment.filters["percent"] = lambda value: "-" if value is None else f"{value:.0%}"


def render(template: str, **context: Any) -> str:
    return environment.get_template(template).render(**context)


def rounds_svg(rows: list[RoundRow], threshold: float, width: int = 640) -> str:
    """Two panels over the rounds, oldest left: training reward (mean) per round, and the gate's
    win rate with its 95% interval (green passed, red failed) against the threshold; promoted
    rounds are shaded green, rolled-back ones red."""
    if not rows:
        return ""
    height, panel, left, right, top_pad = 300, 110, 48, 12, 24
    step = (width - left - right) / max(1, len(rows))

    def x(i: int) -> float:
        return left + step * (i + 0.5)

    def y(value: float, base: float) -> float:  # value in [0, 1] inside the panel at `base`
        return base + panel * (1.0 - max(0.0, min(1.0, value)))

    top, bottom = top_pad, top_pad + panel + 40
    parts = [
        f'<svg class="plot" viewBox="0 0 {width} {height}" role="img" '
        'aria-labelledby="plot-title plot-desc" xmlns="http://www.w3.org/2000/svg">',
        '<title id="plot-title">Training reward and gate win rate per round</title>',
        f'<desc id="plot-desc">{len(rows)} rounds, oldest first; the gate threshold is '
        f"{threshold}.</desc>",
    ]
    for i, row in enumerate(rows):
        shade = {"promoted": PASSED, "rolled back": FAILED}.get(row.outcome)
        if shade:
            parts.append(
                f'<rect x="{x(i) - step / 2:.1f}" y="{top}" width="{step:.1f}" '
                f'height="{bottom + panel - top}" fill="{shade}" opacity="0.12"/>'
            )
    for base, label in ((top, "training reward"), (bottom, "gate win rate (95% CI)")):
        parts.append(
            f'<text x="{left}" y="{base - 6}" font-size="12" fill="#111">{escape(label)}</text>'
        )
        for tick in (0.0, 0.5, 1.0):
            parts.append(
                f'<line x1="{left}" x2="{width - right}" y1="{y(tick, base):.1f}" '
                f'y2="{y(tick, base):.1f}" stroke="{GRID}" stroke-width="0.5"/>'
                f'<text x="{left - 6}" y="{y(tick, base) + 4:.1f}" font-size="10" '
                f'text-anchor="end" fill="#111">{tick:g}</text>'
            )
    rewards = [(i, r.mean_reward) for i, r in enumerate(rows) if r.mean_reward is not None]
    if rewards:
        points = " ".join(f"{x(i):.1f},{y(v, top):.1f}" for i, v in rewards)
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{REWARD}" stroke-width="2"/>'
        )
        parts += [
            f'<circle cx="{x(i):.1f}" cy="{y(v, top):.1f}" r="3" fill="{REWARD}"/>'
            for i, v in rewards
        ]
    parts.append(
        f'<line x1="{left}" x2="{width - right}" y1="{y(threshold, bottom):.1f}" '
        f'y2="{y(threshold, bottom):.1f}" stroke="#111" stroke-dasharray="4 3"/>'
    )
    for i, row in enumerate(rows):
        if row.win_rate is None:
            continue
        colour = PASSED if row.passed else FAILED
        low = row.ci_low if row.ci_low is not None else row.win_rate
        high = row.ci_high if row.ci_high is not None else row.win_rate
        parts.append(
            f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{y(low, bottom):.1f}" '
            f'y2="{y(high, bottom):.1f}" stroke="{colour}" stroke-width="2"/>'
            f'<circle cx="{x(i):.1f}" cy="{y(row.win_rate, bottom):.1f}" r="4" fill="{colour}">'
            f"<title>v{row.version}: win rate {row.win_rate:.3f}</title></circle>"
        )
    for i, row in enumerate(rows):
        parts.append(
            f'<text x="{x(i):.1f}" y="{height - 6}" font-size="10" text-anchor="middle" '
            f'fill="#111">v{row.version}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)

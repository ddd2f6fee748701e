"""HTML for the console: Jinja2 templates (console/templates, autoescaped) and the rounds plot,
drawn as inline SVG on the server so a page needs no chart library and works offline."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Frame:
    """Where the rounds plot draws: one column per round, two panels of values in [0, 1]."""

    rounds: int
    width: int
    height: int = 300
    panel: int = 110
    left: int = 48
    right: int = 12
    top: int = 24  # the reward panel's top; the gate panel's is `bottom`

    @property
    def step(self) -> float:
        return (self.width - self.left - self.right) / max(1, self.rounds)

    @property
    def bottom(self) -> int:
        return self.top + self.panel + 40

    def x(self, i: int) -> float:
        return self.left + self.step * (i + 0.5)

    def y(self, value: float, base: float) -> float:  # value in [0, 1] inside the panel at `base`
        return base + self.panel * (1.0 - max(0.0, min(1.0, value)))


def rounds_svg(rows: list[RoundRow], threshold: float, width: int = 640) -> str:
    """Two panels over the rounds, oldest left: training reward (mean) per round, and the gate's
    win rate with its 95% interval (green passed, red failed) against the threshold; promoted
    rounds are shaded green, rolled-back ones red."""
    if not rows:
        return ""
    f = _Frame(len(rows), width)
    parts = [
        f'<svg class="plot" viewBox="0 0 {width} {f.height}" role="img" '
        'aria-labelledby="plot-title plot-desc" xmlns="http://www.w3.org/2000/svg">',
        '<title id="plot-title">Training reward and gate win rate per round</title>',
        f'<desc id="plot-desc">{len(rows)} rounds, oldest first; the gate threshold is '
        f"{threshold}.</desc>",
        *_outcome_shading(f, rows),
        *_panel_axes(f),
        *_reward_line(f, rows),
        f'<line x1="{f.left}" x2="{width - f.right}" y1="{f.y(threshold, f.bottom):.1f}" '
        f'y2="{f.y(threshold, f.bottom):.1f}" stroke="#111" stroke-dasharray="4 3"/>',
        *_gate_intervals(f, rows),
        *(
            f'<text x="{f.x(i):.1f}" y="{f.height - 6}" font-size="10" text-anchor="middle" '
            f'fill="#111">v{escape(str(row.version))}</text>'
            for i, row in enumerate(rows)
        ),
        "</svg>",
    ]
    return "".join(parts)


def _outcome_shading(f: _Frame, rows: list[RoundRow]) -> list[str]:
    shaded = []
    for i, row in enumerate(rows):
        shade = {"promoted": PASSED, "rolled back": FAILED}.get(row.outcome)
        if shade:
            shaded.append(
                f'<rect x="{f.x(i) - f.step / 2:.1f}" y="{f.top}" width="{f.step:.1f}" '
                f'height="{f.bottom + f.panel - f.top}" fill="{shade}" opacity="0.12"/>'
            )
    return shaded


def _panel_axes(f: _Frame) -> list[str]:
    axes = []
    for base, label in ((f.top, "training reward"), (f.bottom, "gate win rate (95% CI)")):
        axes.append(
            f'<text x="{f.left}" y="{base - 6}" font-size="12" fill="#111">{escape(label)}</text>'
        )
        for tick in (0.0, 0.5, 1.0):
            axes.append(
                f'<line x1="{f.left}" x2="{f.width - f.right}" y1="{f.y(tick, base):.1f}" '
                f'y2="{f.y(tick, base):.1f}" stroke="{GRID}" stroke-width="0.5"/>'
                f'<text x="{f.left - 6}" y="{f.y(tick, base) + 4:.1f}" font-size="10" '
                f'text-anchor="end" fill="#111">{tick:g}</text>'
            )
    return axes


def _reward_line(f: _Frame, rows: list[RoundRow]) -> list[str]:
    rewards = [(i, r.mean_reward) for i, r in enumerate(rows) if r.mean_reward is not None]
    if not rewards:
        return []
    points = " ".join(f"{f.x(i):.1f},{f.y(v, f.top):.1f}" for i, v in rewards)
    return [
        f'<polyline points="{points}" fill="none" stroke="{REWARD}" stroke-width="2"/>',
        *(
            f'<circle cx="{f.x(i):.1f}" cy="{f.y(v, f.top):.1f}" r="3" fill="{REWARD}"/>'
            for i, v in rewards
        ),
    ]


def _gate_intervals(f: _Frame, rows: list[RoundRow]) -> list[str]:
    marks = []
    for i, row in enumerate(rows):
        if row.win_rate is None:
            continue
        colour = PASSED if row.passed else FAILED
        low = row.ci_low if row.ci_low is not None else row.win_rate
        high = row.ci_high if row.ci_high is not None else row.win_rate
        marks.append(
            f'<line x1="{f.x(i):.1f}" x2="{f.x(i):.1f}" y1="{f.y(low, f.bottom):.1f}" '
            f'y2="{f.y(high, f.bottom):.1f}" stroke="{colour}" stroke-width="2"/>'
            f'<circle cx="{f.x(i):.1f}" cy="{f.y(row.win_rate, f.bottom):.1f}" r="4" '
            f'fill="{colour}"><title>v{escape(str(row.version))}: win rate '
            f"{row.win_rate:.3f}</title></circle>"
        )
    return marks

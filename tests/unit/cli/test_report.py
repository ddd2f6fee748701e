"""The learner's report: rounds read back from an alias's Redis history (written here by the real
Lifecycle, the way the learner writes it), and the rounds plot as a PNG."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cli.report import RoundRow, plot_rounds, rounds_of
from ratchet.lifecycle import Lifecycle
from ratchet.registry import RegistryWriter
from ratchet.settings import AliasConfig
from ratchet.store import AdapterStore

ALIAS = "support"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def gate_detail(win_rate: float, passed: bool) -> dict[str, Any]:
    lift = round(win_rate - 0.5, 3)  # a verifier alias's gate measures a score lift too
    return {
        "passed": passed,
        "win_rate": win_rate,
        "ci_low": win_rate - 0.1,
        "ci_high": win_rate + 0.1,
        "pairs": 40,
        "lift": lift,
        "lift_low": lift - 0.05,
        "lift_high": lift + 0.05,
    }


def train_and_gate(life: Lifecycle, version: int, reward: float, win_rate: float) -> None:
    """What the learner records for one round before its outcome."""

    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

    life.store.write(ALIAS, version, write_adapter, "/base", {"parent_version": version - 1})
    life.record(
        life.event(ALIAS, "candidate", version=version, detail={"mean_reward": reward, "groups": 8})
    )
    detail = gate_detail(win_rate, passed=win_rate > 0.6)
    life.record(life.event(ALIAS, "gate", version=version, detail=detail))


@pytest.fixture
def history(redis_url: str, tmp_path: Path) -> list[dict[str, Any]]:
    writer = RegistryWriter(redis_url, {ALIAS: AliasConfig()})
    life = Lifecycle(writer, AdapterStore(tmp_path / "adapters"), sink=None, actor="learner")
    train_and_gate(life, 1, reward=0.3, win_rate=0.8)
    life.start_canary(ALIAS, 1, 0.1, {})
    life.promote(ALIAS, 1, {"via": "canary"})
    train_and_gate(life, 2, reward=0.4, win_rate=0.3)
    life.reject(ALIAS, 2, {"reason": "win rate 0.3"})
    train_and_gate(life, 3, reward=0.5, win_rate=0.9)
    life.promote(ALIAS, 3)
    life.rollback(ALIAS, "manual")  # restores v1, rolls back v3
    train_and_gate(life, 4, reward=0.6, win_rate=0.7)
    life.start_canary(ALIAS, 4, 0.1, {})
    life.pause(ALIAS, "manual")
    life.record(life.event(ALIAS, "candidate", version=5, detail={"mean_reward": 0.7}))
    return writer.history(ALIAS, 200)


def test_rounds_of_gives_each_candidate_its_gate_and_fate(history: list[dict[str, Any]]) -> None:
    rows = rounds_of(history)
    assert [(r.version, r.outcome) for r in rows] == [
        (1, "promoted"),  # canary first, then promoted: the last word counts
        (2, "rejected"),
        (3, "rolled back"),  # the rollback names v1 restored; v3 is the one rolled back
        (4, "canary"),
        (5, "trained"),  # no gate yet
    ]
    first = rows[0]
    assert (first.mean_reward, first.groups, first.pairs, first.passed) == (0.3, 8, 40, True)
    assert (first.win_rate, first.ci_low, first.ci_high) == pytest.approx((0.8, 0.7, 0.9))
    assert (first.lift, first.lift_low, first.lift_high) == pytest.approx((0.3, 0.25, 0.35))
    assert first.lift_text() == "lift +0.300 [+0.250, +0.350]"
    assert rows[1].passed is False and rows[1].win_rate == pytest.approx(0.3)
    assert rows[4].lift is None and rows[4].lift_text() == ""
    assert rows[4].win_rate is None and rows[4].passed is None and rows[4].groups is None


def test_rounds_of_ignores_what_is_not_a_learner_round() -> None:
    history: list[dict[str, Any]] = [  # newest first
        {"kind": "promote", "version": 7, "previous_version": 0, "ts": "3"},  # set by hand
        {"kind": "gate", "version": 6, "detail": {"win_rate": 0.9}, "ts": "2"},  # no candidate
        {"kind": "pause", "detail": {"reason": "manual"}, "ts": "1"},
    ]
    assert rounds_of(history) == []
    assert rounds_of([]) == []


def test_plot_rounds_writes_a_png(history: list[dict[str, Any]], tmp_path: Path) -> None:
    target = tmp_path / "plots" / "rounds.png"  # the folder does not exist yet
    written = plot_rounds(ALIAS, rounds_of(history), threshold=0.5, path=target)
    assert written == target
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000
    # The gates measured a score lift: a third panel shows it (a taller figure).
    without = [replace(r, lift=None, lift_low=None, lift_high=None) for r in rounds_of(history)]
    plot_rounds(ALIAS, without, threshold=0.5, path=tmp_path / "two.png")
    assert _png_height(target) > _png_height(tmp_path / "two.png")


def test_billed_rounds_add_a_cost_panel_and_the_report_tables_what_promotions_cost(
    history: list[dict[str, Any]], tmp_path: Path
) -> None:
    from rich.console import Console

    from cli.status import cost_table
    from ratchet.bill import Bill

    rows = rounds_of(history)
    plot_rounds(ALIAS, rows, threshold=0.5, path=tmp_path / "plain.png")
    billed = [
        replace(r, bill=Bill(sample_seconds=10.0 * i, train_seconds=5.0, judge_cost_usd=0.01))
        for i, r in enumerate(rows, 1)
    ]
    plot_rounds(ALIAS, billed, threshold=0.5, path=tmp_path / "billed.png")
    assert _png_height(tmp_path / "billed.png") > _png_height(tmp_path / "plain.png")
    console = Console(width=300, record=True)
    console.print(cost_table(billed))
    text = console.export_text()
    # v1 was promoted after its own round alone; the table gives each round's bill too.
    assert "judge 0 calls $0.0100 (0 tok); sampling 0 tok 10 s; training 0 tok 5 s" in text


def _png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk's height


def test_plot_rounds_without_any_gate_still_plots(tmp_path: Path) -> None:
    rows = [RoundRow(version=1, ts="t", mean_reward=None, groups=None)]
    path = plot_rounds(ALIAS, rows, threshold=0.5, path=tmp_path / "one.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_rounds_of_tells_a_candidate_trained_on_from_a_rejected_one() -> None:
    def candidate(version: int, trained_from: int | None) -> dict[str, Any]:
        detail = {"mean_reward": 0.4} | (
            {} if trained_from is None else {"trained_from": trained_from}
        )
        return {"kind": "candidate", "version": version, "previous_version": 2, "detail": detail,
                "ts": str(version)}  # fmt: skip

    rows = rounds_of([candidate(5, 4), candidate(4, 2), candidate(3, None)])  # newest first
    assert [(r.version, r.live, r.trained_from, r.carried_on) for r in rows] == [
        (3, 2, None, False),  # written before carries existed
        (4, 2, 2, False),
        (5, 2, 4, True),
    ]

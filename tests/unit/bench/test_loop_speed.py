"""bench/loop_speed.py's pure parts: the generated config leaves every setting at its default but
the task's verifier; --set reaches the task's alias; the lift and its interval; /proc memory;
the learning curve's summary and plot, and the outcome lane's bar on it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.loop_speed import curve_summary, lift, loop_config, parse_sets, plot_curve, prompts_at
from bench.loop_watch import Watch, metric, proc_memory
from ratchet.settings import AliasConfig, LearnerSettings, load_settings
from tasks import TASKS
from tests.outcomes.lane import (
    RATINGS_DEFAULTS_TEST,
    RATINGS_TASKS,
    curve_rows,
    ratings_rows,
    runs_of,
)
from tests.outcomes.test_ratings_on_defaults import RATED_TASKS

MODEL = Path("/models/smollm2-135m-instruct")


def test_the_task_alias_gets_only_its_verifier_and_defaults_otherwise(tmp_path: Path) -> None:
    task = TASKS["sorting"]
    settings = load_settings(loop_config(tmp_path, task, [], MODEL))
    alias = settings.aliases[task.name]
    assert alias.reward.kind == "verifier" and alias.reward.verifier == task.verifier
    default = AliasConfig()
    assert alias.model_dump(exclude={"reward"}) == default.model_dump(exclude={"reward"})
    # The learner names the folder vLLM serves as its adapters' base, or vLLM refuses them.
    assert settings.learner.base_model_path == str(MODEL)
    ignore = {"metrics_port", "base_model_path"}
    assert settings.learner.model_dump(exclude=ignore) == LearnerSettings().model_dump(
        exclude=ignore
    )
    assert list(settings.aliases) == [task.name]


def test_set_overrides_the_task_alias_and_any_section(tmp_path: Path) -> None:
    sets = parse_sets(
        ["alias.learning.group_size=6", "learner.learning_rate=1e-3", "alias.gate.min_pairs=16"]
    )
    settings = load_settings(loop_config(tmp_path, TASKS["bullets"], sets, MODEL))
    assert settings.aliases["bullets"].learning.group_size == 6
    assert settings.aliases["bullets"].gate.min_pairs == 16
    assert settings.learner.learning_rate == pytest.approx(1e-3)
    raw = yaml.safe_load((tmp_path / "ratchet.yaml").read_text())
    assert raw["aliases"]["bullets"]["reward"]["verifier"] == TASKS["bullets"].verifier


def test_a_bad_set_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_sets(["learner.learning_rate"])
    with pytest.raises(Exception, match="learning_rat"):
        loop_config(tmp_path, TASKS["demo"], parse_sets(["learner.learning_rat=1"]), MODEL)


def test_lift_is_the_mean_paired_difference_with_an_interval_around_it() -> None:
    base = [0.2, 0.4, 0.0, 0.6] * 10
    better = [b + 0.2 for b in base]
    found = lift(better, base, samples=500)
    assert found["lift"] == pytest.approx(0.2)
    assert found["lift_low"] == pytest.approx(0.2) and found["lift_high"] == pytest.approx(0.2)
    mixed = lift([1.0, 0.0] * 20, [0.5] * 40, samples=500)
    assert mixed["lift_low"] < 0.0 < mixed["lift_high"]


def test_metric_sums_matching_samples_and_memory_comes_from_proc() -> None:
    samples = [
        ("ratchet_learner_rounds_total", {"alias": "a", "result": "rejected"}, 2.0),
        ("ratchet_learner_rounds_total", {"alias": "a", "result": "promoted"}, 1.0),
        ("ratchet_learner_rounds_total", {"alias": "b", "result": "rejected"}, 5.0),
    ]
    assert metric(samples, "ratchet_learner_rounds_total", alias="a") == 3.0
    assert metric(samples, "ratchet_learner_rounds_total", result="rejected") == 7.0
    rss, peak = proc_memory(os.getpid())
    assert 0 < rss <= peak
    assert proc_memory(None) == (0, 0)


def point(version: int, minute: float, prompts: int, lift: float, low: float) -> dict[str, Any]:
    return {
        "version": version,
        "minute": minute,
        "prompts": prompts,
        "score": 0.5 + lift,
        "lift": lift,
        "lift_low": low,
        "lift_high": lift + (lift - low),
    }


def test_the_curve_says_what_the_last_version_bought_and_when_the_bar_was_first_proven() -> None:
    points = [point(2, 12.0, 800, 0.12, -0.01), point(5, 26.5, 1700, 0.15, 0.05)]
    summary = curve_summary(points, minutes_run=60.0, answered=4000, cores=2)
    assert summary["final_lift"] == 0.15
    assert summary["cpu_minutes"] == 120.0
    assert summary["lift_per_cpu_minute"] == pytest.approx(0.15 / 120)
    assert summary["lift_per_1000_prompts"] == pytest.approx(0.15 / 4)
    # v2 lifted +0.12 but its interval reached below 0: the bar was proven by v5
    assert summary["minutes_to_lift_bar"] == 26.5
    none = curve_summary([], minutes_run=60.0, answered=0, cores=2)
    assert none["final_lift"] == 0.0 and none["minutes_to_lift_bar"] is None
    assert none["lift_per_1000_prompts"] is None


def test_prompts_at_is_the_traffic_count_at_the_last_poll_before() -> None:
    watch = Watch(timeline=[{"t": 0.0, "answered": 0}, {"t": 2.0, "answered": 7}])
    assert prompts_at(watch, 1.9) == 0
    assert prompts_at(watch, 5.0) == 7


def test_the_curve_plot_and_the_lane_read_a_run(tmp_path: Path) -> None:
    def task(name: str, points: list[dict[str, Any]], first: float | None) -> dict[str, Any]:
        minutes = 60.0
        return {
            "task": name,
            "base_score": 0.4,
            "minutes_run": minutes,
            "minutes_to_first_promotion": first,
            "eval_prompts": 64,
            "traffic": {"answered": 3000},
            **curve_summary(points, minutes, 3000, 2),
        }

    tasks = [
        task("sorting", [point(2, 9.0, 500, 0.11, 0.02), point(4, 41.0, 2100, 0.2, 0.1)], 9.0),
        task("bullets", [point(3, 17.0, 900, 0.3, 0.2)], 17.0),  # first promotion too late
        task("triage", [], None),
    ]
    plot_curve(tasks, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    (tmp_path / "curve.json").write_text(json.dumps({"tasks": tasks}))
    rows = curve_rows(tmp_path, 0)
    assert [row["passed"] for row in rows] == [True, False, False]
    assert rows[0]["lift"] == pytest.approx((0.2, 0.1, 0.3))
    assert rows[2]["lift"] is None and rows[2]["check"] == "curve: triage, 0 promotion(s)"
    assert curve_rows(tmp_path / "nowhere", 1)[0]["passed"] is False


def test_the_lane_reports_the_defaults_ratings_check_with_its_minutes_by_part(
    tmp_path: Path,
) -> None:
    figures = {
        "settings": "the shipped defaults",
        "minutes_to_first_promotion": 21.5,
        "minutes_run": 45.1,
        "promotions": [{"version": 2, "lift": 0.12, "lift_low": 0.05, "lift_high": 0.19}],
        "unseen_prompts": 320,
        "ratings": 700,
        "bar": "first promotion within 25 min ...",
        "passed": True,
        "minutes_by_part": {"reward_model_training": 3.25, "policy_training": 12.0},
    }
    (tmp_path / "ratings_defaults_sorting.json").write_text(json.dumps(figures))
    [row] = ratings_rows(tmp_path, 0, "ratings-defaults", "sorting")
    assert row["check"] == "ratings-defaults (sorting): 1 promotion(s) measured" and row["passed"]
    assert row["settings"] == (
        "the shipped defaults; minutes: reward_model_training 3.2, policy_training 12.0"
    )
    assert row["lift"] == (0.12, 0.05, 0.19) and row["ratings"] == 700
    assert not ratings_rows(tmp_path, 1, "ratings-defaults", "sorting")[0]["passed"]  # exit too
    assert ratings_rows(tmp_path, 0, "ratings-defaults", "bullets")[0]["settings"] == (
        "no ratings_defaults_bullets.json (exit 0)"  # each task's run reads its own figures
    )
    assert ratings_rows(tmp_path, 0, "ratings")[0]["settings"] == "no ratings.json (exit 0)"


def test_the_lane_runs_the_defaults_ratings_check_once_per_task_each_its_own_test() -> None:
    args = argparse.Namespace(ratings_tasks=["bullets", "sorting"])
    runs = runs_of("ratings-defaults", args)
    assert [task for task, _ in runs] == ["bullets", "sorting"]
    assert [command[3].rsplit("[", 1)[1] for _, command in runs] == ["bullets]", "sorting]"]
    assert all(c[3].startswith(RATINGS_DEFAULTS_TEST + "::") for _, c in runs)
    assert RATINGS_TASKS == RATED_TASKS  # the lane offers exactly the tasks the test knows

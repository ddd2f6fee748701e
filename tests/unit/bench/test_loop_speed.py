"""bench/loop_speed.py's pure parts: the generated config leaves every setting at its default but
the task's verifier; --set reaches the task's alias; the lift and its interval; /proc memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from bench.loop_speed import lift, loop_config, parse_sets
from bench.loop_watch import metric, proc_memory
from ratchet.settings import AliasConfig, LearnerSettings, load_settings
from ratchet.tasks import TASKS

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

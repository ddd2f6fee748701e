"""The chart's values schema and the settings reference are generated from the models: each is
byte-equal to what `python -m ratchet.settings.generate` writes, and `--check` says when not."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.settings import AliasConfig, LearnerSettings, RatchetSettings
from ratchet.settings.generate import (
    CHART_PART_PATH,
    DEFAULTS_TEMPLATE_PATH,
    PAGE_PATH,
    REPO,
    SCHEMA_PATH,
    TEMPLATE_DEFAULTS,
    main,
    model_schema,
    outputs,
)


@pytest.mark.parametrize("path", [SCHEMA_PATH, DEFAULTS_TEMPLATE_PATH, PAGE_PATH], ids=str)
def test_the_generated_file_is_what_the_command_writes(path: Path) -> None:
    expected = outputs(REPO)[REPO / path]
    assert (REPO / path).read_text() == expected, (
        f"{path} is stale: run `python -m ratchet.settings.generate`"
    )


def test_check_fails_when_a_generated_file_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (CHART_PART_PATH, SCHEMA_PATH, DEFAULTS_TEMPLATE_PATH, PAGE_PATH):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, tmp_path / path)
    assert main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / PAGE_PATH
    page.write_text(page.read_text() + "a hand edit\n")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert f"{PAGE_PATH} is stale" in capsys.readouterr().err
    assert main(["--root", str(tmp_path)]) == 0  # rewrites it
    assert main(["--check", "--root", str(tmp_path)]) == 0
    assert page.read_text() == (REPO / PAGE_PATH).read_text()


def test_the_command_runs_as_a_module(tmp_path: Path) -> None:
    for path in (CHART_PART_PATH, SCHEMA_PATH, DEFAULTS_TEMPLATE_PATH, PAGE_PATH):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, tmp_path / path)
    (tmp_path / SCHEMA_PATH).write_text("{}\n")
    run = [sys.executable, "-m", "ratchet.settings.generate", "--root", str(tmp_path)]
    stale = subprocess.run([*run, "--check"], capture_output=True, text=True, check=False)
    assert stale.returncode == 1 and "values.schema.json is stale" in stale.stderr
    subprocess.run(run, check=True)
    assert (tmp_path / SCHEMA_PATH).read_text() == (REPO / SCHEMA_PATH).read_text()


def test_the_reference_lists_every_setting_with_its_variable() -> None:
    page = (REPO / PAGE_PATH).read_text()
    for name in RatchetSettings.model_fields:
        assert f"`{name}`" in page or f"`{name}.`" in page or f"## `{name}`" in page, name
    assert (
        "| `learner.lora.rank` | integer | `8` | ≥ 1, ≤ 32 | `RATCHET_LEARNER__LORA__RANK` |"
        in (page)
    )
    assert "`aliases.<name>.gate.min_pairs`" in page
    assert "`RATCHET_ALIASES__<NAME>__GATE__MIN_PAIRS`" in page


def test_the_schema_carries_the_models_descriptions() -> None:
    """One source: a description written on a field reaches the chart's schema."""
    schema = json.loads((REPO / SCHEMA_PATH).read_text())
    learner = schema["properties"]["learner"]["properties"]["config"]["properties"]
    rank = learner["lora"]["properties"]["rank"]
    assert (
        rank["description"]
        == model_schema(LearnerSettings)["properties"]["lora"]["properties"]["rank"]["description"]
    )


def test_the_templates_read_only_generated_defaults() -> None:
    """Each `$defaults.<path>` a template reads is one the generator writes (a missing one would
    read as nil, i.e. 0, in Helm), with the model's value."""
    text = (REPO / DEFAULTS_TEMPLATE_PATH).read_text()
    defaults = json.loads(text.split("-}}\n", 1)[1].rsplit("{{- end }}", 1)[0])
    templates = "".join(p.read_text() for p in (REPO / "helm/ratchet/templates").glob("*.tpl"))
    read = set(re.findall(r"\$defaults\.([\w.]+)", templates))
    assert read and read <= set(TEMPLATE_DEFAULTS), read - set(TEMPLATE_DEFAULTS)
    assert defaults["learner"]["lora"]["rank"] == LearnerSettings().lora.rank
    assert defaults["aliases"]["gate"]["max_pairs"] == AliasConfig().gate.max_pairs

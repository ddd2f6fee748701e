"""`ratchet demo`'s tally by version: while a canary runs the proxy does not say which version
answered (proxy.expose_arm is off in every shipped config), so those answers are credited from
the proxy's traffic records."""

from __future__ import annotations

from importlib import resources

import yaml
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.cli.demo import DemoReplay


def test_concealed_answers_are_credited_to_the_version_their_records_name() -> None:
    replay = DemoReplay("demo", "http://proxy/v1", "unused", 1, feedback=False)
    replay.scores = {"demo@v1": [1.0]}
    replay.concealed = {"c1": 0.5, "c2": 1.0, "c3": 0.0}
    replay.resolve({"c1": "demo@v1", "c2": "demo@v2"})
    assert replay.scores == {"demo@v1": [1.0, 0.5], "demo@v2": [1.0], "?": [0.0]}
    assert replay.concealed == {}


def test_the_packaged_config_does_not_expose_the_arm() -> None:
    text = resources.files("ratchet.dev").joinpath("ratchet.yaml").read_text(encoding="utf-8")
    assert "expose_arm" not in (yaml.safe_load(text).get("proxy") or {})


def test_the_demo_takes_its_key_from_the_environment_not_the_command_line() -> None:
    """A key on the command line shows in `ps` and the shell's history (audit L-6)."""
    result = CliRunner().invoke(app, ["demo", "--api-key", "sk-secret"])
    assert result.exit_code == 2 and "No such option" in result.output, result.output

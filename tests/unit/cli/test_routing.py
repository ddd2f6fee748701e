"""`ratchet alias set` against a real Redis and adapter store: it serves only what the gate passed
(or the base model) unless forced, and a forced set says so in the alias's history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli  # noqa: F401  (registers the commands on the app)
import ratchet.lifecycle
from cli.app import app
from ratchet.lifecycle import Lifecycle
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore
from ratchet.verdict import gate_verdict

ALIAS = "support"


@pytest.fixture
def life(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Lifecycle:
    """v1 passed the gate and is live, v2 was rejected, v3 was written and never gated."""
    Path("ratchet.yaml").write_text(f"aliases:\n  {ALIAS}: {{base_model: base}}\n")
    monkeypatch.setenv("RATCHET_REDIS_URL", redis_url)
    # No Kafka here: the CLI's event sink would wait out its 5 s send timeout on every change
    # (30 s for this module); what is checked is the route and the history in Redis.
    monkeypatch.setattr(ratchet.lifecycle, "EventSink", lambda *_: None)
    settings = RatchetSettings()
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)
    for version in (1, 2, 3):
        store.write(ALIAS, version, adapter, "/models/base", {"parent_version": 0})
    life = Lifecycle(RegistryWriter(redis_url, settings.aliases), store, sink=None, actor="test")
    for version, passed in ((1, True), (2, False)):
        detail = {"passed": passed, "win_rate": 0.6, "reason": "win rate 0.41 < 0.55"}
        life.record(life.event(ALIAS, "gate", version=version, detail=detail))
    life.promote(ALIAS, 1)
    life.reject(ALIAS, 2, {"reason": "win rate 0.41 < 0.55"})
    for version in (3,):
        life.record(life.event(ALIAS, "candidate", version=version))
    return life


def adapter(folder: Path) -> None:
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))


def alias_set(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["alias", "set", ALIAS, *args])
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


def route_of(life: Lifecycle) -> AliasRoute:
    route = life.writer.read(ALIAS)
    assert route is not None
    return route


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--active", "2"], "support@v2 was rejected by the gate (win rate 0.41 < 0.55)"),
        (["--canary", "2", "--weight", "0.5"], "support@v2 was rejected by the gate"),
        (["--active", "3"], "support@v3 is never gated"),
        (["--canary", "3"], "support@v3 is never gated"),
        (["--active", "4"], "support@v4 is never gated"),  # not even in the store
    ],
)
def test_a_version_the_gate_did_not_pass_is_refused_without_force(
    life: Lifecycle, args: list[str], said: str
) -> None:
    before = route_of(life)
    code, output = alias_set(*args)
    assert code == 1, output
    assert said in output and "pass --force to serve it anyway" in output
    assert route_of(life) == before  # nothing written
    assert life.writer.history(ALIAS)[0]["kind"] != "route"


def test_what_the_gate_passed_and_the_base_model_are_set_without_force(life: Lifecycle) -> None:
    code, output = alias_set("--active", "0", "--canary", "1", "--weight", "0.2")
    assert code == 0, output
    route = route_of(life)
    assert (route.active, route.canary, route.canary_weight) == (0, 1, 0.2)
    event = life.writer.history(ALIAS)[0]
    assert event["kind"] == "route" and "forced" not in event["detail"]
    # Ending the canary or changing its weight names no version: nothing to check.
    assert alias_set("--canary", "none")[0] == 0


def test_a_forced_set_is_written_and_its_event_names_the_actor_and_the_override(
    life: Lifecycle,
) -> None:
    code, output = alias_set("--active", "2", "--canary", "3", "--weight", "0.1", "--force")
    assert code == 0, output
    route = route_of(life)
    assert (route.active, route.canary) == (2, 3)
    event = life.writer.history(ALIAS)[0]
    assert (event["kind"], event["actor"], event["version"]) == ("route", "cli", 2)
    assert event["detail"]["forced"] is True
    # The console's history shows an event's reason: the override is there, verdict by verdict.
    reason = event["detail"]["reason"]
    assert reason.startswith("forced: ")
    assert "support@v2 was rejected by the gate" in reason and "support@v3 is never gated" in reason


def test_the_verdict_outlives_a_trimmed_history_and_an_unmounted_store(
    life: Lifecycle, tmp_path: Path
) -> None:
    store, history = life.store, life.writer.history(ALIAS)
    # The history trimmed: the store still knows v2 was rejected, and that v1 was served.
    assert gate_verdict(store, [], ALIAS, 2).verdict == "rejected"
    assert gate_verdict(store, [], ALIAS, 1).verdict == "served before"
    assert gate_verdict(store, [], ALIAS, 3).verdict == "never gated"
    # Where the learner's store is not mounted, the history alone decides.
    elsewhere = AdapterStore(tmp_path / "not-mounted")
    assert gate_verdict(elsewhere, history, ALIAS, 1).verdict == "passed"
    assert gate_verdict(elsewhere, history, ALIAS, 2).verdict == "rejected"
    assert gate_verdict(elsewhere, history, ALIAS, 0).servable


def test_an_unknown_alias_is_named_before_any_verdict(life: Lifecycle) -> None:
    result = CliRunner().invoke(app, ["alias", "set", "billing", "--active", "3"])
    assert result.exit_code == 2 and "unknown alias 'billing'" in result.output


def promote(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["promote", ALIAS, *args])
    return result.exit_code, " ".join(result.output.split())


def test_promote_refuses_a_version_the_gate_never_passed_without_force(life: Lifecycle) -> None:
    """As `alias set`: `ratchet promote --version 3` would otherwise serve a never-judged
    candidate to every user at once."""
    for version, said in (("3", "support@v3 is never gated"), ("2", "rejected by the gate")):
        code, output = promote("--version", version)
        assert code == 1 and said in output and "--force" in output, output
        assert route_of(life).active == 1
    code, output = promote("--version", "3", "--force")
    assert code == 0, output
    assert route_of(life).active == 3

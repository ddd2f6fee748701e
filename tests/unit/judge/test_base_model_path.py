"""The judge's reward models read the base model at learner.base_model_path, which it needs only
for aliases that learn from ratings: it refuses to start without it and never falls back to the
embedded stack's model (embedded is the dev stack's, not a service's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from judge.service import JudgeService
from ratchet.settings import AliasConfig, ConfigError, RatchetSettings
from tests.unit.ratchet.test_layout import imported_modules, modules_of

RATED = AliasConfig(reward={"kind": "feedback"}, canary={"weight": 0.1})


def settings_with(redis_url: str, tmp_path: Path, **learner: object) -> RatchetSettings:
    return RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        secret="a-test-secret",
        aliases={"rated": RATED, "plain": AliasConfig()},
        learner=learner,
    )


def test_a_judge_for_rated_aliases_refuses_to_start_without_the_base_model_path(
    redis_url: str, tmp_path: Path
) -> None:
    settings = settings_with(redis_url, tmp_path)
    with pytest.raises(ConfigError) as refused:
        JudgeService(settings)
    message = str(refused.value)
    assert "['rated']" in message  # the aliases that need it, and not the others
    assert "learner.base_model_path" in message and "RATCHET_LEARNER__BASE_MODEL_PATH" in message
    # Nothing was prepared on the side: the embedded model folder stays absent.
    assert not (tmp_path / "models").exists()


def test_the_reward_models_score_with_the_configured_base_model(
    redis_url: str, tmp_path: Path
) -> None:
    base = tmp_path / "base-model"  # read on first use only: it need not exist yet
    service = JudgeService(settings_with(redis_url, tmp_path, base_model_path=str(base)))
    models = service.scorer.reward_models
    assert models is not None and models.base_model_path == base


def test_a_judge_for_rated_aliases_refuses_to_start_without_what_reward_models_run_on(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge extra brings no torch: a judge that must score with reward models says what to
    install at start, not at the first rated group."""
    real_find_spec = importlib.util.find_spec
    absent = {"torch", "transformers"}

    def find_spec(name: str, *args: object) -> object:
        return None if name in absent else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    settings = settings_with(redis_url, tmp_path, base_model_path=str(tmp_path / "base"))
    with pytest.raises(ConfigError) as refused:
        JudgeService(settings)
    message = str(refused.value)
    assert "['rated']" in message and "torch, transformers" in message
    assert "ratchet[judge,learner]" in message


def test_without_rated_aliases_the_judge_needs_no_base_model(
    redis_url: str, tmp_path: Path
) -> None:
    settings = RatchetSettings(
        redis_url=redis_url, home=tmp_path, secret="s", aliases={"plain": AliasConfig()}
    )
    assert JudgeService(settings).scorer.reward_models is None


def test_the_judge_imports_nothing_from_the_embedded_stack() -> None:
    modules = modules_of("judge")
    assert "judge.service" in modules  # the walk sees the judge
    reaching = {
        name: sorted(m for m in found if m == "embedded" or m.startswith("embedded."))
        for name, path in modules.items()
        if (found := imported_modules(path.read_text(), name, path.name == "__init__.py"))
    }
    assert {name: dev for name, dev in reaching.items() if dev} == {}

"""The learner trains adapters of the base model at learner.base_model_path: it refuses to start
without it and never falls back to the embedded stack's model (embedded is the dev stack's,
not a service's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.service import base_model, serve
from ratchet.settings import ConfigError, RatchetSettings
from tests.unit.ratchet.test_layout import imported_modules, modules_of


@pytest.mark.timeout(60)  # a learner that did start would run until stopped
def test_the_learner_refuses_to_start_without_the_base_model_path(
    redis_url: str, tmp_path: Path
) -> None:
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, secret="a-test-secret")
    with pytest.raises(ConfigError) as refused:
        serve(settings)
    message = str(refused.value)
    assert "learner.base_model_path" in message and "RATCHET_LEARNER__BASE_MODEL_PATH" in message
    # Refused before anything started: no model prepared on the side, no store opened.
    assert settings.store_dir is not None and not settings.store_dir.exists()
    assert not (tmp_path / "models").exists()


def test_the_configured_base_model_path_is_the_one_trained_on(tmp_path: Path) -> None:
    base = tmp_path / "base-model"  # loaded on the first round only: it need not exist yet
    settings = RatchetSettings(home=tmp_path, learner={"base_model_path": str(base)})
    assert base_model(settings) == base


def test_the_learner_imports_nothing_from_the_embedded_stack() -> None:
    modules = modules_of("learner")
    assert "learner.service" in modules  # the walk sees the learner
    reaching = {
        name: sorted(m for m in found if m == "embedded" or m.startswith("embedded."))
        for name, path in modules.items()
        if (found := imported_modules(path.read_text(), name, path.name == "__init__.py"))
    }
    assert {name: dev for name, dev in reaching.items() if dev} == {}

"""The embedded stack tells the judge and learner where vLLM's model is: they no longer fall
back to preparing it themselves, so `ratchet up` must set learner.base_model_path for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from embedded.stack import embedded_stack
from ratchet.settings import load_settings


def service_settings_base_model(
    config: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str | None]:
    """learner.base_model_path as each service of the embedded stack loads it: from its config
    file, in the environment the stack starts it with."""
    stack = embedded_stack(load_settings(config), config, model, services=("judge", "learner"))
    seen = {}
    for name in ("judge", "learner"):
        part = stack.part(name)
        assert part.command[-2:] == ["--config", str(config)]
        with monkeypatch.context() as env:
            env.delenv("RATCHET_LEARNER__BASE_MODEL_PATH", raising=False)
            for key, value in {**stack.env, **part.env}.items():
                env.setenv(key, value)
            seen[name] = load_settings(config).learner.base_model_path
    return seen


def write(tmp_path: Path, **learner: object) -> Path:
    config = tmp_path / "ratchet.yaml"
    config.write_text(yaml.safe_dump({"home": str(tmp_path), "learner": learner}))
    return config


def test_the_judge_and_learner_get_the_model_vllm_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "models" / "smollm2-135m-instruct"
    seen = service_settings_base_model(write(tmp_path), model, monkeypatch)
    assert seen == {"judge": str(model), "learner": str(model)}
    # vLLM is started with the same path as its --model.
    vllm = embedded_stack(load_settings(write(tmp_path)), None, model, services=()).part("vllm")
    assert str(model) in vllm.command


def test_a_configured_base_model_path_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, base_model_path="/srv/models/base")
    seen = service_settings_base_model(config, tmp_path / "embedded-model", monkeypatch)
    assert seen == {"judge": "/srv/models/base", "learner": "/srv/models/base"}

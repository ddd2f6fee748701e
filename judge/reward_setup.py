"""The reward models the judge loads at start: those of the aliases that learn from ratings,
which score answers with the base model vLLM serves. A judge that would need one and cannot
have it (no ``learner.base_model_path``, packages missing) refuses to start, saying why."""

from __future__ import annotations

from pathlib import Path

from ratchet.rewards.reward_model import RewardModels, missing_packages
from ratchet.settings import ConfigError, RatchetSettings


def reward_models(settings: RatchetSettings) -> RewardModels | None:
    """The reward models of aliases that learn from ratings, if any: they score answers with
    the base model at ``learner.base_model_path`` (read on first use), which must then be set."""
    rated = sorted(a for a, c in settings.aliases.items() if c.reward.learns_from_ratings)
    if not rated:
        return None
    path = settings.learner.base_model_path
    if not path:
        # No dev fallback here: the judge must not reach into the embedded stack (embedded).
        raise ConfigError(
            f"aliases {rated} learn from ratings, so the judge needs the base model their "
            "reward models score with, but learner.base_model_path is empty: set it in "
            "ratchet.yaml or RATCHET_LEARNER__BASE_MODEL_PATH to the base model vLLM serves "
            "(`ratchet up` and the Helm chart set it themselves)"
        )
    if missing := missing_packages():  # the judge extra brings none: said at start
        raise ConfigError(
            f"aliases {rated} learn from ratings, so the judge scores with their reward models, "
            f"which need {', '.join(missing)}: install it as pip install 'ratchet[judge,learner]' "
            "plus the torch wheel of this machine"
        )
    assert settings.store_dir is not None
    return RewardModels(settings.store_dir, Path(path))

"""The outcome lane: tests that assert what a stochastic learning run learned.

They take tens of minutes of the whole machine and may miss their bar by chance, so neither CI
nor a plain ``pytest`` runs them: they are collected only when named (``scripts/test
tests/outcomes/...``, ``pytest tests/outcomes``) or picked with ``-m outcome``.
``scripts/test --outcomes`` runs them with bench/loop_speed.py and prints their figures
(tests/outcomes/lane.py). They use the integration lane's shared embedded stack, started the
same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The integration lane's shared stack: the same fixtures, registered for this folder too.
from tests.integration.conftest import embedded, embedded_start

__all__ = ["embedded", "embedded_start"]

HERE = Path(__file__).resolve().parent


def _named(config: pytest.Config) -> bool:
    """Whether the command line names this folder or something in it, or picks the marker."""
    if "outcome" in (config.option.markexpr or ""):
        return True
    for arg in config.args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _named(config):
        return
    ours = [item for item in items if HERE in Path(item.path).resolve().parents]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if item not in ours]

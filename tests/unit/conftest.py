"""Shared fixtures of the unit tests: a clean RATCHET_* environment in an empty directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No test sees the developer's RATCHET_* variables or a ./ratchet.yaml in the cwd."""
    for name in list(os.environ):
        if name.upper().startswith("RATCHET_"):
            monkeypatch.delenv(name, raising=False)
    # ./ratchet.yaml is the fallback config; run where there is none.
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("RATCHET_HOME", str(tmp_path / "home"))
    yield

"""The default ``ratchet.yaml`` that ``ratchet up`` writes when none exists (a packaged file)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_config_text() -> str:
    return resources.files("embedded").joinpath("ratchet.yaml").read_text(encoding="utf-8")


def write_default_config(path: Path) -> bool:
    """Create a default ratchet.yaml if none exists; return whether one was written."""
    if path.exists():
        return False
    path.write_text(default_config_text(), encoding="utf-8")
    return True

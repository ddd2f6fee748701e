"""fsync helpers: what a crash must not undo (adapters published by rename, spooled records)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a file created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under ``root``, then every directory, deepest first."""
    folders = [root]
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_dir():
            folders.append(path)
        else:
            fsync_file(path)
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
        fsync_dir(folder)

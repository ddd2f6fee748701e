"""fsync helpers: what a crash must not undo (adapters published by rename, spooled records);
and private files for what holds users' prompts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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


def private_dir(path: Path) -> None:
    """``path`` created if missing, readable by this user alone (it holds users' prompts and
    answers, waiting for Kafka), whatever the umask. An existing folder this user does not own
    keeps its mode: the mount decides it (a Kubernetes volume)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.getuid():
        path.chmod(0o700)


def open_private_append(path: Path) -> Any:
    """``path`` opened to append bytes, created mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return os.fdopen(fd, "ab")

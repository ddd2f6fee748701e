"""The adapter store writes a version so that, whenever the machine stops, the version's name
shows a whole adapter or nothing: every file and folder reaches the disk before the rename that
publishes it, and the rename itself is made durable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ratchet.store import AdapterStore


class SyncLog:
    """os.fsync, recorded by the path it was called on (a power cut cannot be caused here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[Path] = []
        self._real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        self.synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        self._real(fd)


def test_a_version_is_on_disk_before_its_name_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path / "adapters")
    renames: list[tuple[Path, list[Path]]] = []
    real_rename = Path.rename
    sync = SyncLog(monkeypatch)

    def rename(self: Path, target: Path) -> Path:
        renames.append((Path(target), list(sync.synced)))
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)

    def write_adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (folder / "weights").mkdir()
        (folder / "weights" / "adapter_model.safetensors").write_bytes(b"\0" * 64)

    final = store.write("support", 1, write_adapter, "/models/base", {"parent_version": 0})
    [(target, synced_before)] = renames
    assert target == final
    names = {(p.parent.name, p.name) for p in synced_before}
    # Every file and folder of the adapter, under its temporary name.
    for name in ("adapter_config.json", "ratchet.json", "adapter_model.safetensors", "weights"):
        assert any(n == name for _, n in names), (name, synced_before)
    assert any(p.name.startswith(".tmp-support@v1") for p in synced_before)
    # Then the store's own folder, so the rename survives.
    assert sync.synced[-1] == store.root


def test_a_status_is_on_disk_before_it_replaces_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path / "adapters")
    store.write(
        "support",
        1,
        lambda f: (f / "adapter_config.json").write_text("{}"),
        "/models/base",
        {},
    )
    sync = SyncLog(monkeypatch)
    store.mark("support", 1, "rejected", {"win_rate": 0.4})
    folder = store.path("support", 1)
    assert sync.synced[0].parent == folder and sync.synced[0].name.startswith(".")
    assert sync.synced[-1] == folder
    assert store.status("support", 1) == {"status": "rejected", "win_rate": 0.4}

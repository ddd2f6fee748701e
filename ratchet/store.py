"""The adapter store: one folder per version, named by its served name.

``<store>/<alias>@v<N>/`` holds the PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``) and ``ratchet.json`` (parent version, training steps, data seen,
gate result). vLLM's filesystem resolver loads a version by that folder name on first request, so
a version is written to a temporary folder and renamed into place: a reader never sees half an
adapter, and a version, once written, is never changed.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ratchet.durable import fsync_dir, fsync_file, fsync_tree

META_FILE = "ratchet.json"
# What became of a version after it was written (gated, rejected, promoted, rolled back). Kept
# apart from ratchet.json so the adapter and its provenance stay immutable.
STATUS_FILE = "status.json"
_VERSION_DIR = re.compile(r"^(?P<alias>[a-z0-9][a-z0-9._-]{0,63})@v(?P<version>[1-9][0-9]*)$")


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, alias: str, version: int) -> Path:
        if version < 1:
            raise ValueError("v0 is the base model; adapters start at v1")
        return self.root / f"{alias}@v{version}"

    def exists(self, alias: str, version: int) -> bool:
        return (self.path(alias, version) / "adapter_config.json").is_file()

    def versions(self, alias: str) -> list[int]:
        found = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                match = _VERSION_DIR.match(entry.name)
                if match and match["alias"] == alias and (entry / "adapter_config.json").is_file():
                    found.append(int(match["version"]))
        return sorted(found)

    def write(
        self,
        alias: str,
        version: int,
        write_adapter: Callable[[Path], None],
        base_model_path: str,
        meta: dict[str, Any],
    ) -> Path:
        """Write a new version atomically. ``write_adapter(folder)`` saves the PEFT files."""

        def write_files(folder: Path) -> None:
            write_adapter(folder)
            config_path = folder / "adapter_config.json"
            config = json.loads(config_path.read_text())
            # vLLM's resolver only loads adapters whose base is exactly its --model value.
            config["base_model_name_or_path"] = base_model_path
            config_path.write_text(json.dumps(config, indent=2))

        return self.write_folder(alias, version, write_files, meta)

    def write_folder(
        self, name: str, version: int, write_files: Callable[[Path], None], meta: dict[str, Any]
    ) -> Path:
        """Write ``<name>@v<version>/`` atomically: ``write_files(folder)``, then ``ratchet.json``.
        Also what holds an alias's reward models (``<alias>.reward@v<N>``)."""
        final = self.path(name, version)
        if final.exists():
            raise FileExistsError(f"{final.name} exists; versions are immutable")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            write_files(tmp)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            # On disk before it is visible: after a crash the name shows a whole version or none.
            fsync_tree(tmp)
            tmp.rename(final)
            fsync_dir(self.root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def folder_versions(self, name: str) -> list[int]:
        """Versions of ``name`` with a complete folder (its ratchet.json is written last)."""
        found = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                match = _VERSION_DIR.match(entry.name)
                if match and match["alias"] == name and (entry / META_FILE).is_file():
                    found.append(int(match["version"]))
        return sorted(found)

    def meta(self, alias: str, version: int) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self.path(alias, version) / META_FILE).read_text())
        return meta

    def mark(self, alias: str, version: int, status: str, detail: dict[str, Any]) -> None:
        """Record what became of a version (``rejected``, ``promoted``, ``rolled_back``...)."""
        folder = self.path(alias, version)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder.name} is not in the store")
        tmp = folder / f".{STATUS_FILE}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps({"status": status, **detail}, indent=2, sort_keys=True))
        fsync_file(tmp)
        tmp.replace(folder / STATUS_FILE)  # atomic: a reader sees the old status or the new one
        fsync_dir(folder)

    def status(self, alias: str, version: int) -> dict[str, Any] | None:
        path = self.path(alias, version) / STATUS_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def is_rejected(self, alias: str, version: int) -> bool:
        status = self.status(alias, version)
        return status is not None and status.get("status") == "rejected"

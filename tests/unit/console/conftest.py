"""The console's tests share a real Redis, settings with an admin key, and an alias with a
history: v1 promoted through a round, v2 on canary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from console.app import create_app
from ratchet.gate_pairs import GatePair, write_gate_pairs
from ratchet.lifecycle import Lifecycle
from ratchet.registry import RegistryWriter
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore

ALIAS = "support"
KEY = "the-admin-key"


def make_settings(
    redis_url: str, tmp_path: Path, admin_key: str = KEY, **console: object
) -> RatchetSettings:
    return RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        secret="a-test-secret",
        proxy={"admin_key": admin_key},
        console=console,
        aliases={ALIAS: {}, "other": {}},
    )


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> RatchetSettings:
    return make_settings(redis_url, tmp_path)


@pytest.fixture
def lifecycle(settings: RatchetSettings) -> Lifecycle:
    """v1 promoted through a round (candidate, gate, promote), v2 on canary."""
    assert settings.store_dir is not None
    store = AdapterStore(settings.store_dir)

    def adapter(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

    for version in (1, 2):
        meta = {"parent_version": version - 1, "rounds": version, "groups_seen": 32 * version}
        store.write(ALIAS, version, adapter, "/models/base", meta)
    life = Lifecycle(RegistryWriter(settings.redis_url, settings.aliases), store, sink=None)
    for version, win in ((1, 0.8), (2, 0.7)):
        gate = {"win_rate": win, "ci_low": win - 0.2, "ci_high": win + 0.1, "pairs": 40}
        gate |= {"lift": win - 0.5, "lift_low": win - 0.6, "lift_high": win - 0.4}
        life.record(life.event(ALIAS, "candidate", version=version, detail={"mean_reward": 0.4}))
        life.record(life.event(ALIAS, "gate", version=version, detail={**gate, "passed": True}))
    life.promote(ALIAS, 1)
    life.start_canary(ALIAS, 2, 0.25, {})
    pair = GatePair([{"role": "user", "content": "Sort 3 1 2"}], "1 2 3", "3 2 1", 1.0)
    write_gate_pairs(life.writer.redis, ALIAS, 2, [pair])
    return life


def client_for(settings: RatchetSettings) -> TestClient:
    return TestClient(create_app(settings, start_readers=False), base_url="http://127.0.0.1:8404")

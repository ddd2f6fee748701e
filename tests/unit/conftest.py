"""Shared fixtures of the unit tests: a clean RATCHET_* environment in an empty directory."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ratchet.dev.processes import free_port
from ratchet.dev.stack import redis_server_binary


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


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real, empty redis-server of its own on a free port."""
    port = free_port()
    server = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(5)

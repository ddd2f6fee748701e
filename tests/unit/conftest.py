"""Shared fixtures of the unit tests: a clean RATCHET_* environment in an empty directory, and
one redis-server for the session that each test that asks for it gets empty."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from embedded.processes import free_port, wait_until
from embedded.stack import redis_server_binary


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real redis-server on a free port for the whole session; tests get it via redis_url."""
    port = free_port()
    data_dir = tmp_path_factory.mktemp("redis")
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
            str(data_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def answers() -> bool:
        assert server.poll() is None, f"redis-server exited with {server.returncode}"
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, 10, "redis-server to answer")
        yield url
    finally:
        server.terminate()
        server.wait(5)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """A real redis-server, empty at the start of the test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture(scope="session")
def real_base_model() -> Path:
    """The embedded stack's base model folder, from the real Ratchet home (`scripts/test` prepares
    it before pytest). Session-scoped, so it is resolved before `clean_env` points RATCHET_HOME at
    an empty folder, where it would be converted again (25 s) for every test that asks."""
    from embedded.model import prepare_model
    from ratchet.settings import default_home

    return prepare_model(default_home(), quiet=True)


@pytest.fixture(scope="session")
def real_answer_features(real_base_model: Path) -> Any:
    """The reward model's features of the real base model, loaded once (5 s) for the tests that
    train or score with it."""
    from ratchet.rewards.reward_model import AnswerFeatures

    return AnswerFeatures(real_base_model)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread: on a small CPU shared with vLLM, two spinning OpenMP threads are
    several times slower than one, and the models of unit tests gain nothing from more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

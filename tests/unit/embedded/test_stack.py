"""embedded.stack's supervision with small real processes: order, health, death, a clean stop
within one deadline."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from embedded.processes import STOP_DEADLINE_S, Part, PartFailed, Stack, wait_until


def python_part(
    name: str,
    code: str,
    ready_file: Path | None = None,
    timeout_s: float = 10,
    infrastructure: bool = False,
) -> Part:
    return Part(
        name=name,
        command=[sys.executable, "-c", code],
        address=name,
        is_ready=(lambda: ready_file.exists()) if ready_file else (lambda: True),
        ready_timeout_s=timeout_s,
        infrastructure=infrastructure,
    )


def deaf_child(pid_file: Path) -> str:
    """A child script that ignores SIGTERM, then publishes its pid (whole, by a rename)."""
    return (
        "import os, pathlib, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"tmp = pathlib.Path({str(pid_file)!r} + '.tmp'); tmp.write_text(str(os.getpid()))\n"
        f"tmp.rename({str(pid_file)!r})\n"
        "time.sleep(60)"
    )


def on_sigterm(handler: str, ready_file: Path, then: str = "time.sleep(60)") -> str:
    """A child script: ``handler`` (Python statements) runs on SIGTERM; the ready file is
    written once the handler is in place, so a stop never finds the default action instead."""
    return (
        "import pathlib, signal, subprocess, sys, time\n"
        "def handle(*_):\n"
        + "".join(f"    {line}\n" for line in handler.splitlines())
        + "signal.signal(signal.SIGTERM, handle)\n"
        f"pathlib.Path({str(ready_file)!r}).touch()\n"
        f"{then}\n"
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def test_parts_start_in_order_and_stop_with_their_children(tmp_path: Path) -> None:
    first_ready = tmp_path / "first"
    # The second part checks that the first was healthy before it started.
    first = python_part(
        "first",
        f"import pathlib,time; pathlib.Path({str(first_ready)!r}).touch(); time.sleep(60)",
        first_ready,
    )
    child_pid_file = tmp_path / "child.pid"
    second = python_part(
        "second",
        "import subprocess,sys,time,pathlib\n"
        f"assert pathlib.Path({str(first_ready)!r}).exists()\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(child_pid_file)!r}).write_text(str(c.pid))\n"
        "time.sleep(60)",
        child_pid_file,
    )
    stack = Stack([first, second], tmp_path / "state")
    stack.start()
    stack.check()
    assert first.process and second.process
    pids = [first.process.pid, second.process.pid, int(child_pid_file.read_text())]
    assert (tmp_path / "state" / "stack.json").exists()
    stack.stop()
    # The grandchild is killed with its group but reaped by init, a moment later.
    wait_until(lambda: all(gone(pid) for pid in pids), 5, "every process (and grandchild) gone")
    assert not (tmp_path / "state" / "stack.json").exists()


def test_part_that_dies_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    ok = python_part("ok", "import time; time.sleep(60)")
    broken = python_part(
        "broken",
        "print('port 9092 already in use', flush=True); raise SystemExit(3)",
        tmp_path / "never",
    )
    stack = Stack([ok, broken], tmp_path / "state")
    with pytest.raises(PartFailed) as failed:
        stack.start()
    assert failed.value.name == "broken"
    assert "exited with code 3" in str(failed.value)
    assert "port 9092 already in use" in failed.value.log_tail
    assert ok.process is None, "the parts already started are stopped again"


def test_part_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    slow = python_part("slow", "import time; time.sleep(60)", tmp_path / "never", timeout_s=1)
    stack = Stack([slow], tmp_path / "state")
    with pytest.raises(PartFailed, match="not healthy after 1s"):
        stack.start()


def test_part_that_dies_later_is_caught_by_check(tmp_path: Path) -> None:
    short = python_part("short", "import time; print('bye', flush=True); time.sleep(0.5)")
    stack = Stack([short], tmp_path / "state")
    stack.start()
    wait_until(lambda: not short.running, 10, "the short-lived part to exit")
    with pytest.raises(PartFailed, match="short exited with code 0") as failed:
        stack.check()
    assert "bye" in failed.value.log_tail
    stack.stop()


def test_vllm_requires_the_key_the_services_derive(tmp_path: Path) -> None:
    """The embedded vLLM gets the key every service derives from the same settings, through
    its environment (never argv, which `ps` shows), and the guard that puts every route but
    /health and /metrics behind it."""
    import importlib

    from embedded.stack import GUARD_MIDDLEWARE, vllm_part
    from ratchet.secrets import vllm_api_key
    from ratchet.settings import RatchetSettings

    settings = RatchetSettings(home=tmp_path)
    part = vllm_part(settings, tmp_path / "model", "smollm2-135m-instruct")
    key = vllm_api_key(settings)
    assert part.env["VLLM_API_KEY"] == key
    assert not any(key in arg for arg in part.command)
    assert "--api-key" not in part.command
    assert part.command[part.command.index("--middleware") + 1] == GUARD_MIDDLEWARE
    module, _, name = GUARD_MIDDLEWARE.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
    # A second service on this machine (a fresh settings object) derives the same key.
    assert vllm_api_key(RatchetSettings(home=tmp_path)) == key
    configured = RatchetSettings(home=tmp_path, vllm_api_key="configured-key")
    assert vllm_part(configured, tmp_path / "m", "b").env["VLLM_API_KEY"] == "configured-key"


def test_parts_that_ignore_or_resist_sigterm_are_down_within_the_deadline(tmp_path: Path) -> None:
    """Parts are stopped together under one deadline, not one after another with a grace each:
    three that outlast any grace still leave the stack down within STOP_DEADLINE_S, and the
    broker they use is still asked to stop gracefully before the kill."""
    ready = {name: tmp_path / f"{name}.ready" for name in ("deaf", "slow", "orphaning", "broker")}
    child_pid_file = tmp_path / "child.pid"
    broker_stopped = tmp_path / "broker.stopped"
    broker = python_part(
        "broker",
        on_sigterm(f"pathlib.Path({str(broker_stopped)!r}).touch(); sys.exit(0)", ready["broker"]),
        ready["broker"],
        infrastructure=True,
    )
    # Ignores SIGTERM altogether.
    deaf = python_part("deaf", on_sigterm("pass", ready["deaf"]), ready["deaf"])
    # A training step that takes 30 s to come back to the stop flag.
    slow = python_part(
        "slow", on_sigterm("time.sleep(30); sys.exit(0)", ready["slow"]), ready["slow"]
    )
    # Exits at once but leaves a child that ignores SIGTERM (vLLM's engine core, say).
    orphaning = python_part(
        "orphaning",
        on_sigterm(
            "sys.exit(0)",
            ready["orphaning"],
            then=f"c = subprocess.Popen([sys.executable, '-c', {deaf_child(child_pid_file)!r}])\n"
            "time.sleep(60)",
        ),
        ready["orphaning"],
    )
    quick = python_part("quick", "import time; time.sleep(60)")
    stack = Stack([broker, deaf, slow, orphaning, quick], tmp_path / "state")
    stack.start()
    wait_until(child_pid_file.exists, 10, "the orphaning part's child to ignore SIGTERM")
    pids = [p.process.pid for p in stack.parts if p.process] + [int(child_pid_file.read_text())]
    assert len(pids) == 6

    started = time.monotonic()
    stack.stop()
    took_s = time.monotonic() - started

    assert took_s < STOP_DEADLINE_S, f"the stack took {took_s:.1f}s to stop"
    assert broker_stopped.exists(), "the broker was killed instead of asked to stop"
    assert all(part.process is None for part in stack.parts)
    # The leaders are reaped by the stop itself; the orphaned child by init, a moment later.
    wait_until(lambda: all(gone(pid) for pid in pids), 2, "every process (and the child) gone")


def test_infrastructure_is_asked_to_stop_once_the_parts_that_use_it_have_exited(
    tmp_path: Path,
) -> None:
    """The proxy's log worker flushes to Kafka as it stops: the broker, started first, is asked
    to stop only after the service has exited, and neither waits for the deadline."""
    service_ready, broker_ready = tmp_path / "service.ready", tmp_path / "broker.ready"
    flushed, broker_saw = tmp_path / "flushed", tmp_path / "broker.saw"
    broker = python_part(
        "broker",
        on_sigterm(
            f"saw = pathlib.Path({str(flushed)!r}).exists()\n"
            f"pathlib.Path({str(broker_saw)!r}).write_text(str(saw)); sys.exit(0)",
            broker_ready,
        ),
        broker_ready,
        infrastructure=True,
    )
    service = python_part(
        "service",
        on_sigterm(
            f"time.sleep(0.5); pathlib.Path({str(flushed)!r}).touch(); sys.exit(0)", service_ready
        ),
        service_ready,
    )
    stack = Stack([broker, service], tmp_path / "state")
    stack.start()
    started = time.monotonic()
    stack.stop()
    took_s = time.monotonic() - started
    assert broker_saw.read_text() == "True", "the broker stopped before the service had flushed"
    assert took_s < 5, f"a graceful stop took {took_s:.1f}s: something waited for the deadline"


def test_embedded_redis_serves_this_machine_in_protected_mode(tmp_path: Path) -> None:
    """Started as `ratchet up` starts it: loopback clients are served, and protected mode (no
    password: nobody but this machine) is on."""
    import subprocess

    import redis

    from embedded.processes import free_port
    from embedded.stack import redis_part

    url = f"redis://127.0.0.1:{free_port()}/0"
    part = redis_part(url, tmp_path)
    server = subprocess.Popen(part.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(part.is_ready, 15, "the embedded redis to listen")
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        client.close()
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("user", ["", "ratchet"])
def test_embedded_redis_with_a_password_requires_it_and_never_shows_it(
    tmp_path: Path, user: str
) -> None:
    """The password is in a 0600 file, not on the command line (every local user's `ps`), and
    Redis refuses a client without it; quotes, spaces and line breaks survive redis.conf."""
    import subprocess

    import redis

    from embedded.processes import free_port
    from embedded.stack import redis_part
    from ratchet.secrets import with_password

    password = 'a "quoted\\ pass\nword" @:/'
    bare = f"redis://{user + '@' if user else ''}127.0.0.1:{free_port()}/0"
    url = with_password(bare, password)
    part = redis_part(url, tmp_path / "redis")
    assert not [arg for arg in part.command if "quoted" in arg or "pass" in arg]
    conf = tmp_path / "redis" / "redis.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "redis").stat().st_mode & 0o777 == 0o700
    server = subprocess.Popen(part.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(part.is_ready, 15, "the embedded redis to listen")
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(bare).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(with_password(bare, "guess")).ping()
    finally:
        server.terminate()
        server.wait(10)


def test_ratchet_ups_own_redis_requires_the_password_every_service_derives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the default redis_url, `ratchet up` starts Redis requiring the password that every
    process of this home derives from its secret: no file or setting to keep in step."""
    import redis

    from embedded.stack import embedded_stack
    from ratchet.secrets import redis_connection_url
    from ratchet.settings import RatchetSettings

    monkeypatch.delenv("RATCHET_REDIS_URL", raising=False)
    settings = RatchetSettings(home=tmp_path)
    stack = embedded_stack(settings, None, tmp_path / "model", services=())
    conf = Path(stack.part("redis").command[1]).read_text()
    password = redis.connection.parse_url(redis_connection_url(settings))["password"]
    assert conf == f'requirepass "{password}"\n'
    # A service or the CLI started later in the same home connects with the same password.
    assert redis_connection_url(RatchetSettings(home=tmp_path)) == redis_connection_url(settings)

"""ratchet.dev.stack's supervision with small real processes: order, health, death, clean stop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ratchet.dev.processes import Part, PartFailed, Stack, wait_until


def python_part(
    name: str, code: str, ready_file: Path | None = None, timeout_s: float = 10
) -> Part:
    return Part(
        name=name,
        command=[sys.executable, "-c", code],
        address=name,
        is_ready=(lambda: ready_file.exists()) if ready_file else (lambda: True),
        ready_timeout_s=timeout_s,
        stop_timeout_s=3,
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

    from ratchet.dev.stack import GUARD_MIDDLEWARE, vllm_part
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

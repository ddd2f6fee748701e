"""`ratchet up` and `ratchet down` as a user runs them: the whole stack, then a clean stop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import redis

from embedded.model import model_dir, prepare_model
from embedded.processes import wait_until
from embedded.stack import read_state
from ratchet.settings import default_home
from tests.integration.conftest import ALIAS, write_config

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_up_serves_then_down_stops_everything(tmp_path: Path) -> None:
    config_path, config = write_config(tmp_path)
    # The model as `ratchet prepare-model` (which scripts/test runs first) leaves it in the
    # user's home, so `up` starts without converting it again.
    model_dir(tmp_path).parent.mkdir(parents=True)
    model_dir(tmp_path).symlink_to(prepare_model(default_home(), quiet=True))
    proxy_url = f"http://127.0.0.1:{config['proxy']['port']}"
    # Redis's password from a secret file, as the chart mounts it: the embedded Redis requires
    # it, and every service and the CLI read it from the folder.
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "RATCHET_REDIS_PASSWORD").write_text("redis-pass-from-a-file\n")
    env = {**os.environ, "RATCHET_HOME": str(tmp_path), "RATCHET_SECRETS_DIR": str(secrets)}
    env.pop("RATCHET_REDIS_URL", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:

        def up_and_running() -> bool:
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            return read_state(tmp_path / "state") is not None

        wait_until(up_and_running, 600, "ratchet up to write its state", 0.5)
        state = read_state(tmp_path / "state")
        assert state is not None
        pids = [info["pid"] for info in state["parts"].values()]  # type: ignore[union-attr]
        parts = {"kafka", "redis", "vllm", "proxy", "judge", "learner", "console"}
        assert set(state["parts"]) == parts  # type: ignore[arg-type]

        client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="k", max_retries=0)
        completion = client.chat.completions.create(
            model=ALIAS, max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert completion.choices[0].message.content is not None
        assert httpx.get(f"{proxy_url}/readyz").json()["kafka"] is True
        console_url = f"http://127.0.0.1:{config['console']['port']}"
        overview = httpx.get(f"{console_url}/")
        assert overview.status_code == 200 and f'href="/alias/{ALIAS}"' in overview.text

        # The CLI reads Redis with the password; a client without it is refused.
        status = subprocess.run(
            [sys.executable, "-m", "cli", "status", ALIAS, "--config", str(config_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(config["redis_url"]).ping()

        down = subprocess.run(
            [sys.executable, "-m", "cli", "down", "--config", str(config_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Stopped" in down.stdout
        up.wait(60)
        output = up.stdout.read() if up.stdout else ""
        assert up.returncode == 0, output
        # The table of what ran where was printed, and no part outlived the stack.
        assert "Ratchet embedded stack" in output and "vllm" in output
        assert not [pid for pid in pids if alive(pid)]
        assert read_state(tmp_path / "state") is None
        leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
        assert not leftovers.stdout.strip(), f"orphans: {leftovers.stdout}"
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)

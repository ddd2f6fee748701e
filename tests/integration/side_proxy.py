"""A proxy of a test's own beside the session's, on the session's Kafka and Redis: for settings
the shared proxy must not change (a smaller record limit) or an upstream a test can cut off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from embedded.processes import Stack
from embedded.stack import proxy_part
from ratchet.secrets import vllm_api_key
from ratchet.settings import load_settings
from tests.integration.conftest import Embedded, write_config


@contextlib.contextmanager
def side_proxy(
    env: Embedded, home: Path, vllm_url: str | None = None, **proxy: Any
) -> Iterator[str]:
    """Start it (its own home, hence its own server secret; vLLM's key is the session's) with
    these `proxy` settings; yields its base URL and stops it after."""
    path, config = write_config(home, **proxy)
    config["kafka_bootstrap_servers"] = env.settings.kafka_bootstrap_servers
    config["redis_url"] = env.settings.redis_url
    config["vllm_url"] = vllm_url or env.settings.vllm_url
    config["vllm_api_key"] = vllm_api_key(env.settings)
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    stack = Stack([proxy_part(settings, path)], home / "stack")
    stack.start()
    try:
        yield f"http://127.0.0.1:{settings.proxy.port}"
    finally:
        stack.stop()

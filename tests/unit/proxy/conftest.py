"""The real proxy app in-process, in front of a small aiohttp server standing in for vLLM.

A test sets ``upstream["handler"]`` to what vLLM should answer on /v1/chat/completions. Kafka's
and Redis's ports are closed: records land in the proxy's spool under the test's tmp_path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from proxy.app import create_app
from ratchet.dev.processes import free_port as closed_port
from ratchet.settings import RatchetSettings


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _no_handler(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "the test set no handler"}}, status=500)


@pytest.fixture
async def upstream() -> AsyncIterator[dict[str, Any]]:
    routes: dict[str, Any] = {"handler": _no_handler}

    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await routes["handler"](request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dispatch)
    app.router.add_get("/health", _health)
    # A handler still running at the end (a hang) is cancelled, not waited for.
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = closed_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    routes["url"] = f"http://127.0.0.1:{port}"
    yield routes
    await runner.cleanup()


@pytest.fixture
async def proxy(
    upstream: dict[str, Any], tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = RatchetSettings(
        home=tmp_path,  # its own spool; the broker's port is closed, so records land there
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=f"redis://127.0.0.1:{closed_port()}/0",
        vllm_url=upstream["url"],
        proxy={"upstream_timeout_s": 0.5},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.ratchet

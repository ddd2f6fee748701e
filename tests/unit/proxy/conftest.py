"""The real proxy app in-process, in front of a small aiohttp server standing in for vLLM.

A test sets ``upstream["handler"]`` to what vLLM should answer on /v1/chat/completions (and
/v1/completions, /tokenize), and ``upstream["max_model_len"]`` to the context length /v1/models
reports.
Kafka's and Redis's ports are closed: records land in the proxy's spool under the test's tmp_path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from embedded.processes import free_port as closed_port
from proxy.app import create_app
from ratchet.settings import RatchetSettings


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _no_handler(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "the test set no handler"}}, status=500)


@pytest.fixture
async def upstream() -> AsyncIterator[dict[str, Any]]:
    routes: dict[str, Any] = {"handler": _no_handler, "max_model_len": 2048}

    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await routes["handler"](request)

    async def models(_: web.Request) -> web.Response:
        card = {"id": "smollm2-135m-instruct", "max_model_len": routes["max_model_len"]}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dispatch)
    app.router.add_post("/v1/completions", dispatch)
    app.router.add_post("/tokenize", dispatch)  # POST /v1/responses/input_tokens asks it
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", _health)
    # A handler still running at the end (a hang) is cancelled, not waited for.
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = closed_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    routes["url"] = f"http://127.0.0.1:{port}"
    yield routes
    await runner.cleanup()


ProxyFactory = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, Any]]]


@pytest.fixture
def proxy_with(upstream: dict[str, Any], tmp_path: Path) -> ProxyFactory:
    """``async with proxy_with(**proxy_settings) as (client, state)``: the app in front of the
    fake vLLM, with these proxy settings."""

    @asynccontextmanager
    async def running(**proxy: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
        settings = RatchetSettings(
            home=tmp_path,  # its own spool; the broker's port is closed, so records land there
            kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
            redis_url=f"redis://127.0.0.1:{closed_port()}/0",
            vllm_url=upstream["url"],
            proxy={"upstream_timeout_s": 0.5, **proxy},
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                yield client, app.state.ratchet

    return running


@pytest.fixture
async def proxy(proxy_with: ProxyFactory) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async with proxy_with() as running:
        yield running

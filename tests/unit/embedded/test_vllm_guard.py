"""vLLM's guard (embedded/vllm_guard.py): the key on every route but /health and /metrics.

vLLM's own --api-key guards /v1, /v2, /inference and /cohere only; vLLM 0.32 with runtime LoRA
updating also mounts SageMaker's ``POST /adapters`` outside them. The guard is tested here as
ASGI middleware around a stand-in app, and, where vLLM is installed, inside vLLM's own app as
``--middleware`` builds it (no engine: the routes are reached, not served).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from embedded import vllm_guard
from embedded.vllm_guard import RequireApiKey

KEY = "the-vllm-key"


async def downstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What the guard protects: answers 200 "served" to whatever reaches it."""
    if scope["type"] == "lifespan":
        await send({"type": "lifespan.startup.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> RequireApiKey:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    return RequireApiKey(downstream)


async def call(guard: RequireApiKey, method: str, path: str, auth: str | None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    transport = httpx.ASGITransport(app=guard)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        return await client.request(method, path, headers=headers)


# Routes vLLM 0.32 serves outside its own key's prefixes, and some inside them.
GUARDED = [
    ("POST", "/adapters"),
    ("DELETE", "/adapters/support@v3"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/scale_elastic_ep"),
    ("GET", "/openapi.json"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/chat/completions"),
    ("OPTIONS", "/v1/chat/completions"),
    ("GET", "/health/"),
]
WRONG = [None, "Bearer not-the-key", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer "]


@pytest.mark.parametrize(("method", "path"), GUARDED)
@pytest.mark.parametrize("auth", WRONG)
async def test_every_route_needs_the_key(
    guard: RequireApiKey, method: str, path: str, auth: str | None
) -> None:
    resp = await call(guard, method, path, auth)
    assert resp.status_code == 401
    assert resp.text != "served"
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert KEY not in resp.text


@pytest.mark.parametrize(("method", "path"), GUARDED)
@pytest.mark.parametrize("auth", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"])
async def test_the_key_lets_a_request_through(
    guard: RequireApiKey, method: str, path: str, auth: str
) -> None:
    resp = await call(guard, method, path, auth)
    assert (resp.status_code, resp.text) == (200, "served")


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_probes_and_prometheus_need_no_key(guard: RequireApiKey, path: str) -> None:
    assert (await call(guard, "GET", path, None)).text == "served"


def test_a_root_path_is_taken_off_before_the_open_paths_are_checked(
    guard: RequireApiKey,
) -> None:
    assert guard.allowed({"type": "http", "root_path": "/vllm", "path": "/vllm/health"})
    assert not guard.allowed({"type": "http", "root_path": "/vllm", "path": "/vllm/adapters"})


async def test_a_websocket_without_the_key_is_closed_before_it_opens(
    guard: RequireApiKey,
) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    await guard(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


async def test_lifespan_passes_through(guard: RequireApiKey) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard({"type": "lifespan"}, asyncio.Event().wait, send)  # type: ignore[arg-type]
    assert sent == [{"type": "lifespan.startup.complete"}]


@pytest.mark.parametrize("value", [None, "", "   "])
def test_without_a_key_vllm_does_not_start(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    if value is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", value)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        RequireApiKey(downstream)


def test_the_refusal_is_the_openai_envelope() -> None:
    body = json.loads(vllm_guard._REFUSAL)
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_inside_vllms_own_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's app as `--middleware` builds it: without the guard, vLLM's own key leaves
    POST /adapters open; with it, every route but /health and /metrics needs the key."""
    pytest.importorskip("vllm")
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    monkeypatch.setenv("VLLM_API_KEY", KEY)

    def client(*flags: str) -> TestClient:
        parser = make_arg_parser(FlexibleArgumentParser())
        app = build_app(parser.parse_args(["--model", "m", *flags]), supported_tasks=("generate",))
        return TestClient(app, raise_server_exceptions=False)

    bare = client()
    # The hole the guard closes: vLLM's own key does not cover SageMaker's adapter route.
    assert bare.post("/adapters", json={"name": "x", "src": "/tmp"}).status_code != 401
    guarded = client("--middleware", "embedded.vllm_guard.RequireApiKey")
    for method, path in GUARDED:
        assert guarded.request(method, path).status_code == 401, path
    assert guarded.get("/metrics").status_code == 200
    authorized = guarded.post("/adapters", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert authorized.status_code != 401

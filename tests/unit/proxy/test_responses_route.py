"""``POST /v1/responses`` and ``/v1/chat/completions`` through the real app: a request refused
before it is routed, for a reason of the client's or by an error of ours, answers in the one error
envelope and is still charged to its key's rate (proxy/generation.py ``refused``); and the
Responses routes' other refusals: a bad ``previous_response_id``, vLLM's own refusal, no key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

import proxy.generation
import proxy.responses_route
from embedded.processes import free_port as closed_port
from proxy.app import create_app
from ratchet.settings import RatchetSettings
from tests.unit.proxy.conftest import ProxyFactory

ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app with Kafka, Redis and vLLM on closed ports: nothing here gets past routing."""
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=f"redis://127.0.0.1:{closed_port()}/0",
        vllm_url=f"http://127.0.0.1:{closed_port()}",
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        # Starlette re-raises what its 500 handler answered; the client must see the answer.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            yield http


@pytest.fixture
def charged(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The key hash of each request that ``refused`` charged, on either route."""
    calls: list[str | None] = []

    async def record(_: Any, arrival: proxy.generation.Arrival) -> None:
        calls.append(arrival.key_hash)

    monkeypatch.setattr(proxy.responses_route, "refused", record)
    monkeypatch.setattr(proxy.generation, "refused", record)
    return calls


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert "Traceback" not in answer.text
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize("fmt", ["json", ["json_object"], 3])
async def test_a_text_format_that_is_not_an_object_is_a_400_naming_it_and_charged(
    client: httpx.AsyncClient, charged: list[str | None], fmt: Any
) -> None:
    body = {"model": "support", "input": "hi", "text": {"format": fmt}}
    error = error_of(await client.post("/v1/responses", json=body), 400)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "text.format",
        "invalid_type",
    )
    assert charged == [None]


async def test_an_unexpected_error_before_routing_is_a_500_and_still_charged(
    client: httpx.AsyncClient, charged: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(proxy.responses_route, "to_chat", broken)
    monkeypatch.setattr(proxy.generation, "parse", broken)
    responses = await client.post("/v1/responses", json={"model": "support", "input": "hi"})
    assert error_of(responses, 500)["code"] == "internal_error"
    chat = {"model": "support", "messages": [{"role": "user", "content": "hi"}]}
    completions = await client.post("/v1/chat/completions", json=chat)
    assert error_of(completions, 500)["code"] == "internal_error"
    assert charged == [None, None]


@pytest.mark.parametrize("previous", [5, "", "resp_" + "x" * 300])
async def test_a_previous_response_id_that_cannot_be_one_of_ours_is_a_400(
    client: httpx.AsyncClient, charged: list[str | None], previous: Any
) -> None:
    body = {"model": "support", "input": "hi", "previous_response_id": previous}
    error = error_of(await client.post("/v1/responses", json=body), 400)
    assert error["param"] == "previous_response_id"
    assert charged == [None]


async def test_vllm_refusing_a_response_request_is_its_refusal_in_the_envelope(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    """Not streamed: vLLM's 400 (a prompt past the context, say) reaches the client as a 400
    naming vLLM's parameter, not a 500 and not a Responses object."""

    async def refuse(_: web.Request) -> web.Response:
        error = {"message": "too many tokens", "type": "BadRequestError", "param": "messages"}
        return web.json_response({"error": error}, status=400)

    upstream["handler"] = refuse
    async with proxy_with() as (http, _):
        answer = await http.post("/v1/responses", json={"model": "support", "input": "hi"})
    error = error_of(answer, 400)
    assert (error["code"], error["param"]) == ("upstream_rejected", "messages")


async def test_with_keys_required_the_responses_routes_ask_for_one(
    proxy_with: ProxyFactory,
) -> None:
    async with proxy_with(api_keys=["sk-unit-0123456789"]) as (http, _):
        answers = [
            await http.post("/v1/responses", json={"model": "support", "input": "hi"}),
            await http.get("/v1/responses/resp_1"),
            await http.delete("/v1/responses/resp_1"),
        ]
    for answer in answers:
        assert error_of(answer, 401)["code"] == "invalid_api_key"


async def test_malformed_responses_requests_use_up_the_keys_rate(
    redis_url: str, tmp_path: Path
) -> None:
    """End to end on a real Redis, with token budgets on (where ``refused`` charges): the bug's
    request is a 400 each time and counts, so the third is the 429 of a spent burst."""
    key = "sk-unit-0123456789"
    limits = {"requests_per_minute": 1, "burst": 2, "tokens_per_minute": 1_000_000}
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=redis_url,
        vllm_url=f"http://127.0.0.1:{closed_port()}",
        proxy={"api_keys": [key], "rate_limit": limits},
    )
    app = create_app(settings)
    body = {"model": "support", "input": "hi", "text": {"format": "json"}}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            headers = {"Authorization": f"Bearer {key}"}
            statuses = [
                (await http.post("/v1/responses", json=body, headers=headers)).status_code
                for _ in range(3)
            ]
    assert statuses == [400, 400, 429]


FIXED_FORMAT = {"type": "json_schema", "name": "a", "schema": {"enum": ["Buy X now."]}}
FIXED_TOOL = {
    "type": "function",
    "name": "say",
    "parameters": {
        "type": "object",
        "properties": {"verdict": {"const": "Buy X"}},
        "required": ["verdict"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"text": {"format": FIXED_FORMAT}}, "text.format", "unsupported_parameter"),
        (
            {"tools": [FIXED_TOOL], "tool_choice": {"type": "function", "name": "say"}},
            "tool_choice",
            "unsupported_parameter",
        ),
        ({"max_output_tokens": 10**9}, "max_output_tokens", "limit_exceeded"),
    ],
    ids=["fixing-text-format", "forced-fixed-call", "max-output-tokens"],
)
async def test_a_chat_path_refusal_names_the_responses_field_the_client_sent(
    client: httpx.AsyncClient,
    charged: list[str | None],
    fields: dict[str, Any],
    param: str,
    code: str,
) -> None:
    """The request is checked as the chat request it becomes: its refusal names the Responses
    field (``text.format``), never the chat one (``response_format``), in OpenAI's envelope."""
    body = {"model": "support", "input": "Which product?", **fields}
    error = error_of(await client.post("/v1/responses", json=body), 400)
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"].startswith(f"{param} ")
    for chat_name in ("response_format", "max_tokens"):
        assert chat_name not in error["message"].replace("proxy.max_tokens", "")
    assert charged == [None]

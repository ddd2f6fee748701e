"""``POST /v1/responses/input_tokens`` (proxy/responses_tokens.py): the pure translation of a
Responses body into vLLM's ``/tokenize`` request and of its answer into OpenAI's count, and the
route through the real app in front of a stand-in vLLM: what vLLM is asked, its refusals and
malformed answers in the envelope, keys, and the key's request rate on a real Redis. The count
against the real vLLM is tests/integration/test_responses.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

import proxy.responses_tokens
from embedded.processes import free_port as closed_port
from proxy.app import create_app
from proxy.errors import ProxyError
from proxy.generation import Arrival
from proxy.responses_api import to_chat
from proxy.responses_tokens import input_tokens_object, tokenize_body
from ratchet.settings import RatchetSettings
from tests.unit.proxy.conftest import ProxyFactory
from tests.unit.proxy.test_responses_route import error_of

ROUTE = "/v1/responses/input_tokens"
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
}
BODY = {"model": "support", "input": "Define sky.", "instructions": "Be brief.", "tools": [TOOL]}


def test_the_tokenize_request_is_the_chat_the_response_would_send() -> None:
    chat = to_chat(BODY, None).chat
    body = tokenize_body(chat, "support@v3")
    assert body["model"] == "support@v3" and body["add_generation_prompt"] is True
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Define sky."},
    ]
    assert body["tools"] == chat["tools"] and body["tools"][0]["function"]["name"] == "lookup"
    plain = tokenize_body(to_chat({"model": "support", "input": "hi"}, None).chat, "base")
    assert "tools" not in plain


def test_vllms_count_is_openais_input_token_count() -> None:
    answer = b'{"count": 12, "max_model_len": 2048, "tokens": [1, 2]}'
    assert input_tokens_object(answer) == {"object": "response.input_tokens", "input_tokens": 12}


@pytest.mark.parametrize("answer", [b"not json", b"[]", b'{"count": "12"}', b'{"count": true}'])
def test_an_answer_without_a_count_is_a_502(answer: bytes) -> None:
    with pytest.raises(ProxyError) as failed:
        input_tokens_object(answer)
    assert (failed.value.status, failed.value.code) == (502, "upstream_error")


async def test_the_count_is_vllms_for_the_translated_chat_and_nothing_is_generated(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    async def tokenize(request: web.Request) -> web.Response:
        asked.append((request.path, await request.json()))
        return web.json_response({"count": 41, "max_model_len": 2048, "tokens": [0] * 41})

    upstream["handler"] = tokenize
    async with proxy_with() as (http, state):
        answer = await http.post(ROUTE, json=BODY, headers={"x-request-id": "mine"})
        assert state.traffic_log.depth == 0  # not an exchange: nothing for the log
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"object": "response.input_tokens", "input_tokens": 41}
    assert answer.headers["x-request-id"] == "mine"
    ((path, sent),) = asked
    assert path == "/tokenize"
    assert sent == tokenize_body(to_chat(BODY, None).chat, sent["model"])


async def test_vllms_refusal_is_a_400_in_the_envelope(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    async def refuse(_: web.Request) -> web.Response:
        error = {"message": "too many tokens", "type": "BadRequestError", "param": "messages"}
        return web.json_response({"error": error}, status=400)

    upstream["handler"] = refuse
    async with proxy_with() as (http, _):
        answer = await http.post(ROUTE, json=BODY)
    error = error_of(answer, 400)
    assert (error["code"], error["param"]) == ("upstream_rejected", "messages")


async def test_what_the_responses_route_refuses_is_refused_here_and_charged(
    proxy_with: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    charged: list[str | None] = []

    async def record(_: Any, arrival: Arrival) -> None:
        charged.append(arrival.key_hash)

    monkeypatch.setattr(proxy.responses_tokens, "refused", record)
    async with proxy_with() as (http, _):
        unknown = await http.post(ROUTE, json={**BODY, "background": True})
        no_model = await http.post(ROUTE, json={"input": "hi"})
        no_alias = await http.post(ROUTE, json={**BODY, "model": "nope"})
    assert error_of(unknown, 400)["param"] == "background"
    assert error_of(no_model, 400)["param"] == "model"
    assert error_of(no_alias, 404)["param"] == "model"
    assert charged == [None, None, None]


async def test_with_keys_required_counting_asks_for_one(proxy_with: ProxyFactory) -> None:
    async with proxy_with(api_keys=["sk-unit-0123456789"]) as (http, _):
        answer = await http.post(ROUTE, json=BODY)
    assert error_of(answer, 401)["code"] == "invalid_api_key"


async def test_each_count_takes_one_request_from_the_keys_rate(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """On a real Redis: a burst of two lets two counts through (both reach vLLM), the third is
    the 429 of a spent burst and never reaches vLLM."""
    calls: list[str] = []

    async def tokenize(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"count": 5, "max_model_len": 2048, "tokens": [0] * 5})

    upstream["handler"] = tokenize
    key = "sk-unit-0123456789"
    settings = RatchetSettings(
        home=tmp_path,
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=redis_url,
        vllm_url=upstream["url"],
        proxy={"api_keys": [key], "rate_limit": {"requests_per_minute": 1, "burst": 2}},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            headers = {"Authorization": f"Bearer {key}"}
            answers = [await http.post(ROUTE, json=BODY, headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert error_of(answers[2], 429)["type"]
    assert calls == ["/tokenize", "/tokenize"]

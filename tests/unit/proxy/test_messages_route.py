"""``POST /v1/messages`` through the real app in front of a scripted vLLM: the key as
``x-api-key`` or bearer, vLLM asked the chat request, and every refusal (the client's, the
route's, vLLM's) in Anthropic's error envelope with its status. The official client against the
real stack is tests/integration/test_messages.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from aiohttp import web

from tests.unit.proxy.conftest import ProxyFactory
from tests.unit.proxy.test_inflight import Held, bound, started

KEY = "sk-unit-0123456789"
BODY = {"model": "support", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def anthropic_error(answer: httpx.Response, status: int, kind: str) -> str:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    message: str = body["error"]["message"]
    return message


async def test_refusals_are_in_anthropics_envelope_with_their_status(
    proxy_with: ProxyFactory,
) -> None:
    async with proxy_with(api_keys=[KEY]) as (http, _):
        no_key = await http.post("/v1/messages", json=BODY)
        wrong_key = await http.post("/v1/messages", json=BODY, headers={"x-api-key": "nope"})
        thinking = await http.post(
            "/v1/messages",
            json=BODY | {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            headers={"x-api-key": KEY},
        )
        unknown = await http.post(
            "/v1/messages", json=BODY | {"model": "nobody"}, headers={"x-api-key": KEY}
        )
        json_headers = {"x-api-key": KEY, "content-type": "application/json"}
        not_json = await http.post("/v1/messages", content=b"{", headers=json_headers)
        chat = await http.post("/v1/chat/completions", json=BODY)
    anthropic_error(no_key, 401, "authentication_error")
    anthropic_error(wrong_key, 401, "authentication_error")
    assert "thinking" in anthropic_error(thinking, 400, "invalid_request_error")
    anthropic_error(unknown, 404, "not_found_error")
    anthropic_error(not_json, 400, "invalid_request_error")
    assert set(chat.json()) == {"error"}  # the other routes keep OpenAI's envelope


async def test_an_x_api_key_request_reaches_vllm_as_chat_and_answers_a_message(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    asked: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(await request.json())
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "stop",
            "stop_reason": None,
        }
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        body = {"id": "chatcmpl-x1", "model": asked[-1]["model"], "choices": [choice]}
        return web.json_response(body | {"usage": usage})

    upstream["handler"] = answer
    async with proxy_with(api_keys=[KEY]) as (http, _):
        got = await http.post("/v1/messages", json=BODY, headers={"x-api-key": KEY})
        bearer = await http.post(
            "/v1/messages", json=BODY, headers={"authorization": f"Bearer {KEY}"}
        )
    assert got.status_code == bearer.status_code == 200, got.text
    message = got.json()
    assert message == {
        "id": "msg_x1",
        "type": "message",
        "role": "assistant",
        "model": "support",  # the alias: the served name is concealed, as on chat
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 1},
    }
    assert asked[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert asked[0]["max_tokens"] == 8 and asked[0]["model"] != "support"


async def test_vllm_refusing_is_its_refusal_in_anthropics_envelope(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    async def refuse(_: web.Request) -> web.Response:
        error = {"message": "too many tokens", "type": "BadRequestError", "param": "messages"}
        return web.json_response({"error": error}, status=400)

    upstream["handler"] = refuse
    async with proxy_with() as (http, _):
        for stream in (False, True):
            answer = await http.post("/v1/messages", json=BODY | {"stream": stream})
            assert "too many tokens" in anthropic_error(answer, 400, "invalid_request_error")


async def test_a_stream_is_anthropics_events(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        asked = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {"id": "chatcmpl-s1", "model": asked["model"]}
        for chunk in (
            head | {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
            head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            head | {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}},
        ):
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    upstream["handler"] = stream
    async with proxy_with() as (http, _):
        answer = await http.post("/v1/messages", json=BODY | {"stream": True})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith(
        "text/event-stream"
    )
    kinds = [line[7:] for line in answer.text.split("\n") if line.startswith("event: ")]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert '"model":"support"' in answer.text and "[DONE]" not in answer.text


async def in_flight_call(
    middleware: Any, headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[str, Any]]:
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": headers}
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], orjson.loads(body)


async def test_x_api_key_clients_have_in_flight_bounds_of_their_own_in_anthropics_envelope() -> (
    None
):
    """proxy/inflight.py keys its bounds by the key as authenticate reads it: x-api-key clients
    are not one client, and a refusal on this route is in Anthropic's envelope."""
    app = Held()
    middleware = bound(app, max_in_flight=1)
    first = [(b"x-api-key", b"k1"), (b"content-length", b"100")]
    held = asyncio.create_task(in_flight_call(middleware, first))
    await started(app, 1)
    status, body = await in_flight_call(middleware, first)
    assert status == 429 and body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    other = asyncio.create_task(in_flight_call(middleware, [(b"x-api-key", b"k2")]))
    await started(app, 2)  # another key is let in while k1 is at its bound
    app.release.set()
    assert (await other)[0] == (await held)[0] == 200


FIXED_TOOL = {
    "name": "say",
    "input_schema": {
        "type": "object",
        "properties": {"verdict": {"const": "Buy X"}},
        "required": ["verdict"],
        "additionalProperties": False,
    },
}


async def test_a_chat_path_refusal_names_the_messages_field_in_anthropics_envelope(
    upstream: dict[str, Any], proxy_with: ProxyFactory
) -> None:
    """Checked as the chat request it becomes, a Messages request is refused in Anthropic's
    envelope naming its own fields: a forced call of a tool whose input_schema fixes the
    arguments is ``tool_choice``; a limit on the translated messages is ``messages``."""
    asked: list[Any] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({})

    upstream["handler"] = answer
    forced = BODY | {"tools": [FIXED_TOOL], "tool_choice": {"type": "tool", "name": "say"}}
    many = BODY | {"messages": [{"role": "user", "content": "hi"}] * 3}
    async with proxy_with(max_messages=2) as (http, _):
        refused_call = await http.post("/v1/messages", json=forced)
        too_many = await http.post("/v1/messages", json=many)
    message = anthropic_error(refused_call, 400, "invalid_request_error")
    assert message.startswith("tool_choice is not accepted for model 'support'"), message
    assert "response_format" not in message
    assert "messages" in anthropic_error(too_many, 400, "invalid_request_error")
    assert asked == []  # neither reached vLLM

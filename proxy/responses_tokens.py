"""``POST /v1/responses/input_tokens``: how many input tokens a Responses request would use,
answered as OpenAI's ``{"object": "response.input_tokens", "input_tokens": N}``.

The body is a Responses create request, checked and translated exactly as ``POST
/v1/responses`` does (proxy/responses_api.py ``to_chat``; ``previous_response_id`` read from the
store, scoped to the caller's key), routed by alias as that request would be, and the chat it
would become is tokenized by the vLLM replica that would serve it (vLLM's ``/tokenize`` renders
the served model's chat template over the messages and tools, with the generation prompt, as
its chat completions do). So the count is the ``prompt_tokens`` of the answer the same request
would get.

What it costs the key: the same key check and one request from the key's request rate as any
request (refused or not); no tokens of its token budgets, as nothing is generated; and no
exchange on ``ratchet.traffic``, as there is no answer for the judge to score. Counted in
``ratchet_proxy_requests_total`` with endpoint ``responses.input_tokens``.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from proxy.errors import ProxyError
from proxy.generation import Arrival, arrive, parse, refused, route
from proxy.responses_api import to_chat
from proxy.responses_route import ENDPOINT, previous_conversation
from proxy.state import ProxyState, read_json
from proxy.upstream import upstream_error
from proxy.validation import check_alias
from ratchet.fleet import conversation_key
from ratchet.records import CLIENT_REQUEST_ID_MAX

METRIC_ENDPOINT = "responses.input_tokens"
# vLLM's answer lists the token ids too: at most one per byte of the request, each a few bytes.
ANSWER_BYTES_PER_BODY_BYTE = 16
ANSWER_BYTES_SLACK = 1 << 16


def tokenize_body(chat: dict[str, Any], served: str) -> dict[str, Any]:
    """What vLLM's ``/tokenize`` gets for a translated chat request: the messages and tools its
    chat template renders, with the generation prompt (as a chat completion's prompt has)."""
    body: dict[str, Any] = {
        "model": served,
        "messages": chat["messages"],
        "add_generation_prompt": True,
    }
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    return body


def input_tokens_object(answer: bytes) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer as OpenAI's input token count; a 502 if it has no count."""
    try:
        count = orjson.loads(answer).get("count")
    except (orjson.JSONDecodeError, AttributeError):
        count = None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ProxyError(
            502,
            "the model server's token count was not understood",
            type="server_error",
            code="upstream_error",
        )
    return {"object": "response.input_tokens", "input_tokens": count}


async def count_input_tokens(state: ProxyState, request: Request) -> Response:
    """Authenticate, check and translate, route, take one request from the key's rate, ask the
    replica that would serve it to tokenize; OpenAI's error envelope on every refusal."""
    arrival = arrive(state, request)
    try:
        payload, _ = await read_json(request, state.limits)
        check_alias(payload)
        previous = await previous_conversation(state, payload, arrival.key_hash)
        chat = to_chat(payload, previous).chat
        alias = parse(chat, ENDPOINT, state.limits)
        version, arm, served, conceal = route(state, request, chat, alias, arrival.key_hash)
    except Exception:  # refused before routing, and charged, as a generation request is
        await refused(state, arrival)
        raise
    await _take_one_request(state, arrival)
    labels = (alias, str(version), arm)
    try:
        count = await _tokenize(state, chat, served)
    except ProxyError as error:
        if conceal:  # vLLM's message may name the version
            error.message = error.message.replace(served, alias)
        state.metrics.count_request(labels, METRIC_ENDPOINT, error.status)
        raise
    state.metrics.count_request(labels, METRIC_ENDPOINT, 200)
    client_request_id = request.headers.get("x-request-id")
    request_id = client_request_id[:CLIENT_REQUEST_ID_MAX] if client_request_id else None
    headers = {"x-request-id": request_id or uuid.uuid4().hex}
    return Response(orjson.dumps(count), media_type="application/json", headers=headers)


async def _take_one_request(state: ProxyState, arrival: Arrival) -> None:
    """One request from the key's rate (429 when a limit is reached), no token reservation:
    the question asked on arrival, or (with token budgets, which ask once the body is read)
    asked now, as a refused request's is."""
    if arrival.admission is not None:
        await state.rate_limiter.settle(arrival.admission)
    else:
        await refused(state, arrival)


async def _tokenize(state: ProxyState, chat: dict[str, Any], served: str) -> dict[str, Any]:
    body = orjson.dumps(tokenize_body(chat, served))
    conversation = conversation_key(chat) if state.upstream.routes_by_conversation else None
    response = await state.upstream.post("tokenize", body, served, conversation)
    try:
        bound = ANSWER_BYTES_PER_BODY_BYTE * len(body) + ANSWER_BYTES_SLACK
        answer = await state.upstream.read(response, bound)
    finally:
        response.release()
    if response.status != 200:
        raise upstream_error(response.status, answer, served)
    return input_tokens_object(answer)

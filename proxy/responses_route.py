"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``: the Responses API on the chat path. proxy/responses_api.py
translates; proxy/generation.py authenticates, routes, limits, relays and logs exactly as for
``/v1/chat/completions``; proxy/response_store.py keeps what ``previous_response_id``
continues and what ``input_items`` lists."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.client_fields import parse_as_sent
from proxy.errors import bad_request
from proxy.generation import arrive, refused, route, start_call
from proxy.response_store import not_found
from proxy.responses_api import (
    CHAT_FIELDS,
    RESPONSE_ID_MAX,
    ResponsesRequest,
    assistant_message,
    response_object,
    to_chat,
)
from proxy.responses_items import items_of, page
from proxy.responses_stream import ResponsesStream
from proxy.state import ProxyState, read_json
from proxy.validation import check_alias

ENDPOINT = "chat.completions"  # what vLLM serves a Responses request as


async def create_response(state: ProxyState, request: Request) -> Response:
    arrival = arrive(state, request)
    try:
        payload, _ = await read_json(request, state.limits)
        check_alias(payload)
        previous = await previous_conversation(state, payload, arrival.key_hash)
        translated = to_chat(payload, previous)
        chat = translated.chat
        alias = parse_as_sent(chat, ENDPOINT, state.limits, CHAT_FIELDS)
        routed = route(state, request, chat, alias, arrival.key_hash)
    except Exception:  # a client's error or ours alike: refused before routing, and charged
        await refused(state, arrival)
        raise
    body = orjson.dumps(chat)  # logged as the chat request vLLM gets (TrafficRecord.client_api)
    call, exchange, headers = await start_call(
        state, request, arrival, ENDPOINT, chat, body, routed, "responses", True
    )
    try:
        await anext(exchange)  # raises the ProxyError of a refused or failed call
    except StopAsyncIteration:
        answer = call.answer if call.concealed is None else call.shown(call.answer)
        finished = int(time.time())
        response = response_object(orjson.loads(answer), translated.echo, completed_at=finished)
        if translated.store:
            response["store"] = await keep(state, translated, response, arrival.key_hash)
        return Response(orjson.dumps(response), media_type="application/json", headers=headers)
    headers["Cache-Control"] = "no-cache"
    events = response_events(state, exchange, translated, arrival.key_hash)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def previous_conversation(
    state: ProxyState, payload: dict[str, Any], key_hash: str | None
) -> list[dict[str, Any]] | None:
    previous_id = payload.get("previous_response_id")
    if previous_id is None:
        return None
    if not isinstance(previous_id, str) or not 0 < len(previous_id) <= RESPONSE_ID_MAX:
        raise bad_request(
            f"previous_response_id must be a response id of at most {RESPONSE_ID_MAX} chars",
            "previous_response_id",
            "invalid_type",
        )
    entry = await state.responses.load(previous_id, key_hash, "previous_response_id")
    return list(entry["conversation"])


async def keep(
    state: ProxyState, translated: ResponsesRequest, response: dict[str, Any], key: str | None
) -> bool:
    conversation = [*translated.conversation, assistant_message(response)]
    return await state.responses.save(response, conversation, key)


async def response_events(
    state: ProxyState,
    exchange: AsyncIterator[bytes],
    translated: ResponsesRequest,
    key_hash: str | None,
) -> AsyncIterator[bytes]:
    """The relay's chat stream as Responses events. A finished response is stored before its
    last event goes out, so a next turn sent on that event finds it, and that event says
    whether it was stored."""
    stream = ResponsesStream(translated.echo)
    unsaved = translated.store
    async for chunk in exchange:
        events = stream.feed(chunk)
        final = stream.final
        stored: bool | None = None
        if unsaved and final is not None and final["status"] != "failed":
            unsaved = False
            stored = await keep(state, translated, final, key_hash)
        events += stream.closing_event(stored)
        if events:
            yield events


async def get_response(state: ProxyState, request: Request, response_id: str) -> Response:
    key_hash = state.authenticate_client(request)
    if len(response_id) > RESPONSE_ID_MAX:  # no id of ours: not worth a Redis lookup
        raise not_found(response_id)
    entry = await state.responses.load(response_id, key_hash)
    return Response(orjson.dumps(entry["response"]), media_type="application/json")


async def delete_response(state: ProxyState, request: Request, response_id: str) -> Response:
    key_hash = state.authenticate_client(request)
    if len(response_id) > RESPONSE_ID_MAX:
        raise not_found(response_id)
    await state.responses.delete(response_id, key_hash)
    deleted = {"id": response_id, "object": "response", "deleted": True}
    return Response(orjson.dumps(deleted), media_type="application/json")


async def list_input_items(state: ProxyState, request: Request, response_id: str) -> Response:
    """A stored response's input items (proxy/responses_items.py), for the key that made it."""
    key_hash = state.authenticate_client(request)
    if len(response_id) > RESPONSE_ID_MAX:
        raise not_found(response_id)
    entry = await state.responses.load(response_id, key_hash)
    listed = page(items_of(entry["conversation"], response_id), request.query_params)
    return Response(orjson.dumps(listed), media_type="application/json")

"""``POST /v1/messages``: the Anthropic Messages API on the chat path. proxy/messages_api.py
translates (and says why the proxy translates rather than forwarding to vLLM's own
``/v1/messages``); proxy/generation.py authenticates (a bearer token or ``x-api-key``), routes
by alias, limits, budgets, relays and logs exactly as for ``/v1/chat/completions``; errors are
rendered in Anthropic's envelope on this route (proxy/errors.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.client_fields import parse_as_sent
from proxy.generation import arrive, refused, route, start_call
from proxy.messages_api import CHAT_FIELDS, message_object, to_chat
from proxy.messages_stream import MessagesStream
from proxy.state import ProxyState, read_json
from proxy.validation import check_alias

ENDPOINT = "chat.completions"  # what vLLM serves a Messages request as
CLIENT_API = "messages"


async def create_message(state: ProxyState, request: Request) -> Response:
    arrival = arrive(state, request)
    try:
        payload, _ = await read_json(request, state.limits)
        check_alias(payload)
        chat = to_chat(payload)
        alias = parse_as_sent(chat, ENDPOINT, state.limits, CHAT_FIELDS)
        routed = route(state, request, chat, alias, arrival.key_hash)
    except Exception:  # a client's error or ours alike: refused before routing, and charged
        await refused(state, arrival)
        raise
    body = orjson.dumps(chat)  # logged as the chat request vLLM gets (TrafficRecord.client_api)
    call, exchange, headers = await start_call(
        state, request, arrival, ENDPOINT, chat, body, routed, CLIENT_API, True
    )
    try:
        await anext(exchange)  # raises the ProxyError of a refused or failed call
    except StopAsyncIteration:
        answer = call.answer if call.concealed is None else call.shown(call.answer)
        message = message_object(orjson.loads(answer))
        return Response(orjson.dumps(message), media_type="application/json", headers=headers)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(
        message_events(exchange), media_type="text/event-stream", headers=headers
    )


async def message_events(exchange: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The relay's chat stream as Messages events (proxy/messages_stream.py)."""
    stream = MessagesStream()
    async for chunk in exchange:
        events = stream.feed(chunk)
        if events:
            yield events

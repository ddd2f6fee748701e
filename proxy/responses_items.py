"""``GET /v1/responses/{id}/input_items``: a stored response's input as Responses items, a page
at a time (OpenAI's list: ``limit`` 1-100, default 20; ``order`` ``desc`` by default; ``after``
an item id). Pure: the caller loads the stored entry, scoped to its key as every read of the
store is.

The input is the whole conversation the response answered, earlier turns of a
``previous_response_id`` chain included, as the store keeps it: chat messages (redacted as the
traffic log is), turned back into message, function_call and function_call_output items. The
``instructions`` are not input items, as on OpenAI's API. Item ids are made from the response's
id and the item's place, so a page's ``after`` names the same item on every read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.errors import bad_request
from proxy.responses_api import RESPONSE_PREFIX, function_call_item, text_part

LIMIT_DEFAULT, LIMIT_MAX = 20, 100
ORDERS = ("asc", "desc")


def items_of(conversation: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """The chat messages before the response's own answer (the conversation's last message),
    as items in the order they were given."""
    suffix = response_id.removeprefix(RESPONSE_PREFIX)
    items: list[dict[str, Any]] = []
    for place, message in enumerate(conversation[:-1]):
        item_id = f"msg_{suffix}_{place}"
        role, content = message.get("role"), message.get("content")
        if role == "tool":
            call_id = str(message.get("tool_call_id", ""))
            items.append(
                {
                    "id": f"fco_{suffix}_{place}",
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": content if isinstance(content, str) else "",
                    "status": "completed",
                }
            )
            continue
        if isinstance(content, str) and content:
            part = text_part(content) if role == "assistant" else input_text(content)
            items.append(
                {
                    "id": item_id,
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": [part],
                }
            )
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            items.append(
                function_call_item(
                    call.get("id", ""), function.get("name", ""), function.get("arguments", "")
                )
            )
    return items


def input_text(text: str) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of ``items`` as OpenAI's list object; 400 naming a bad query parameter."""
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise bad_request('order must be "asc" or "desc"', "order", "invalid_value")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request("after must be the id of an item of this list", "after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


def _limit(raw: str | None) -> int:
    if raw is None:
        return LIMIT_DEFAULT
    if not (raw.isdecimal() and len(raw) <= 3 and 1 <= int(raw) <= LIMIT_MAX):
        raise bad_request(
            f"limit must be an integer from 1 to {LIMIT_MAX}", "limit", "invalid_value"
        )
    return int(raw)

"""A stored response's input items (proxy/responses_items.py): the stored chat conversation as
Responses items, each valid as the Open Responses specification's item type and as the official
client's, a page at a time in OpenAI's list shape."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from proxy.errors import ProxyError
from proxy.responses_items import items_of, page
from tests.open_responses import conforming_item

CLIENT_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},  # the response's own answer
]


def test_the_conversation_before_the_answer_is_its_input_items() -> None:
    items = items_of(CONVERSATION, "resp_abc")
    assert [(i["type"], i.get("role")) for i in items] == [
        ("message", "system"),
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    for item in items:
        conforming_item(item)
        CLIENT_ITEM.validate_python(item, strict=True)
    assert items[1]["content"] == [{"type": "input_text", "text": "Weather in Oslo?"}]
    assert items[4]["content"][0]["type"] == "output_text"
    assert (items[2]["call_id"], items[3]["call_id"], items[3]["output"]) == (
        "call_1",
        "call_1",
        "sunny",
    )
    assert len({i["id"] for i in items}) == len(items)
    assert items_of(CONVERSATION, "resp_abc") == items  # the same ids on every read


def test_pages_follow_openais_list() -> None:
    items = items_of(CONVERSATION, "resp_abc")
    first = page(items, {"limit": "4"})  # newest first by default
    assert first["object"] == "list" and first["has_more"] is True
    assert [i["id"] for i in first["data"]] == [i["id"] for i in items[::-1][:4]]
    assert (first["first_id"], first["last_id"]) == (items[-1]["id"], items[2]["id"])
    rest = page(items, {"limit": "4", "after": first["last_id"]})
    assert rest["data"] == items[1::-1] and rest["has_more"] is False
    assert page(items, {"order": "asc"})["data"] == items
    empty = page([], {})
    assert empty["data"] == [] and empty["first_id"] is None and empty["has_more"] is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "9" * 5000}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "msg_other"}, "after"),
    ],
)
def test_a_bad_query_is_a_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(ProxyError) as refused:
        page(items_of(CONVERSATION, "resp_abc"), query)
    assert (refused.value.status, refused.value.param) == (400, param)

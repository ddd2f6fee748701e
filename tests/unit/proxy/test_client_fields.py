"""proxy/client_fields.py: a chat-path refusal renamed to the field the client sent."""

from __future__ import annotations

from proxy.client_fields import as_sent
from proxy.errors import ProxyError, bad_request
from proxy.messages_api import CHAT_FIELDS as MESSAGES_FIELDS
from proxy.responses_api import CHAT_FIELDS as RESPONSES_FIELDS


def renamed(error: ProxyError, fields: dict[str, str]) -> tuple[str | None, str]:
    sent = as_sent(error, fields)
    assert (sent.status, sent.code, sent.type) == (error.status, error.code, error.type)
    return sent.param, sent.message


def test_the_chat_field_is_named_as_the_client_sent_it() -> None:
    fixing = bad_request("response_format is not accepted: it fixes the answer", "response_format")
    assert renamed(fixing, RESPONSES_FIELDS) == (
        "text.format",
        "text.format is not accepted: it fixes the answer",
    )
    stop = bad_request("stop must be a list", "stop")
    assert renamed(stop, MESSAGES_FIELDS) == ("stop_sequences", "stop_sequences must be a list")


def test_an_item_of_a_regrouped_field_is_named_whole() -> None:
    """The translation regroups messages (instructions first, a stored conversation before the
    input): the chat index is not the client's, so the field is named whole."""
    item = bad_request("messages[3].content must be a string", "messages[3].content")
    assert renamed(item, RESPONSES_FIELDS) == ("input", "input must be a string")
    assert renamed(item, MESSAGES_FIELDS)[0] == "messages"


def test_what_the_client_sent_as_is_is_left_alone() -> None:
    same = bad_request("temperature must be a number", "temperature")
    assert as_sent(same, RESPONSES_FIELDS) is same
    unnamed = bad_request("the body nests too deep", None)
    assert as_sent(unnamed, RESPONSES_FIELDS) is unnamed
    # the name only where the message starts with it as a word
    other = bad_request("max_tokens_total is odd", "max_tokens")
    assert renamed(other, RESPONSES_FIELDS) == ("max_output_tokens", "max_tokens_total is odd")

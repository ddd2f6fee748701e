"""A chat-path refusal named by the field the client sent, on the APIs the proxy translates.

The Responses and Messages routes check their request as the chat request it becomes
(proxy/generation.py ``parse``): a refusal there names the chat field (``response_format``,
``max_tokens``), which a Responses client never sent (it sent ``text.format``,
``max_output_tokens``). Each API module keeps a table from the chat fields its translation
writes to the fields they came from; :func:`as_sent` renames the refusal's ``param``, and its
message where the message starts with the field's name, so the 400 speaks the API the client
called (Anthropic's envelope has only the message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.errors import ProxyError
from proxy.generation import parse
from proxy.validation import RequestLimits


def client_field(param: str, fields: Mapping[str, str]) -> str | None:
    """The client's field for a chat field, or for an item of one (``messages[2].content``:
    the translation regroups items, so the client's field as a whole); None when the chat field
    is the client's own."""
    if param in fields:
        return fields[param]
    base = param.split("[", 1)[0].split(".", 1)[0]
    return fields.get(base) if base != param else None


def as_sent(error: ProxyError, fields: Mapping[str, str]) -> ProxyError:
    """``error`` naming the field the client sent where it names a chat field of ``fields``."""
    chat = error.param
    sent = client_field(chat, fields) if chat is not None else None
    if chat is None or sent is None:
        return error
    message = error.message
    if message.startswith(chat) and message[len(chat) : len(chat) + 1] in (" ", ""):
        message = sent + message[len(chat) :]
    return ProxyError(error.status, message, error.type, sent, error.code, error.headers)


def parse_as_sent(
    chat: dict[str, Any], endpoint: str, limits: RequestLimits, fields: Mapping[str, str]
) -> str:
    """``parse`` of a translated chat request, its refusals naming the client's fields."""
    try:
        return parse(chat, endpoint, limits)
    except ProxyError as error:
        raise as_sent(error, fields) from None

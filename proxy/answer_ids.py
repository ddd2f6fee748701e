"""The ids of the answers the proxy relays, and how a record keeps them.

vLLM names an answer after the body's ``request_id`` (``chatcmpl-<request_id>``, ``cmpl-…``).
The proxy always sets that field itself: its own 32-hex request id, then ``-`` and the client's
``request_id`` if it sent one. So every answer's id is unique and starts with a part the proxy
made, whatever the client chose, and the client's part is found from the id alone.

Records keep an id with only the client's part redacted (:func:`redacted_answer_id`): a broad
redaction pattern (hex, UUIDs) must not turn every proxy-made id into the same string, which
would merge the ratings and canary claims keyed on it. A rating's ``completion_id`` is redacted
by the same function as its answer's id, so the two still join.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# "<type>-<the proxy's 32 hex>" then, optionally, "-<the client's request_id>"
_PROXY_MADE = re.compile(r"([A-Za-z]+-[0-9a-f]{32})(?:-(.*))?", re.DOTALL)


def upstream_request_id(proxy_request_id: str, client_request_id: object) -> str:
    """The ``request_id`` vLLM gets: the proxy's own, then the client's if it sent a string."""
    if isinstance(client_request_id, str) and client_request_id:
        return f"{proxy_request_id}-{client_request_id}"
    return proxy_request_id


def redacted_answer_id(answer_id: str, redact: Callable[[str], str]) -> str:
    """``answer_id`` with the client's part alone passed through ``redact``; an id the proxy
    did not make (a rating may name anything) is redacted whole."""
    made = _PROXY_MADE.fullmatch(answer_id)
    if made is None:
        return redact(answer_id)
    proxy_part, client_part = made.groups()
    return proxy_part if client_part is None else f"{proxy_part}-{redact(client_part)}"

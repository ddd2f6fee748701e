"""Example verifiers, usable as they are from ``ratchet.yaml`` (``reward.verifier``).

``exact_json_fields`` grades a structured-extraction task: the prompt carries the right answer
on a line ``EXPECTED: {...}``, and the sample earns the share of those fields it reproduces.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ratchet.rewards.ruler import strip_code_fence

_EXPECTED_LINE = re.compile(r"^[ \t]*EXPECTED:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def exact_json_fields(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """Share of the expected key/value pairs that the sample's JSON object holds exactly.

    The expected object comes from the last ``EXPECTED:`` line of the last user message. The
    sample's content must be one JSON object, optionally in a ```json fence; anything else
    scores 0.0. Keys the sample adds beyond the expected ones cost nothing. A prompt without a
    usable ``EXPECTED:`` line is a broken task, not a bad answer, so it raises ValueError.
    """
    expected = _expected_fields(prompt_messages)
    answer = _answer_object(sample.get("content"))
    if answer is None:
        return 0.0
    matched = sum(
        1 for key, value in expected.items() if key in answer and _same(answer[key], value)
    )
    return matched / len(expected)


def _expected_fields(prompt_messages: list[dict[str, Any]]) -> dict[str, Any]:
    users = [message for message in prompt_messages if message.get("role") == "user"]
    if not users:
        raise ValueError("exact_json_fields: the prompt has no user message")
    lines = _EXPECTED_LINE.findall(_text(users[-1].get("content")))
    if not lines:
        raise ValueError("exact_json_fields: the last user message has no 'EXPECTED: {...}' line")
    try:
        expected = json.loads(lines[-1])
    except ValueError as exc:
        raise ValueError(f"exact_json_fields: the EXPECTED line is not JSON: {exc}") from exc
    if not isinstance(expected, dict) or not expected:
        raise ValueError("exact_json_fields: EXPECTED must be a non-empty JSON object")
    return expected


def _answer_object(content: Any) -> dict[str, Any] | None:
    """The sample's JSON object, or None when the content is not exactly one JSON object."""
    try:
        answer = json.loads(strip_code_fence(_text(content)))
    except (ValueError, RecursionError):
        return None
    return answer if isinstance(answer, dict) else None


def _text(content: Any) -> str:
    """Message content as text: a string as is, or the text parts of a list of parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def _same(got: Any, want: Any) -> bool:
    """JSON equality: like ==, except that true is not 1 and false is not 0 (1 and 1.0 match)."""
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[key], want[key]) for key in want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict | list) or isinstance(want, dict | list):
        return False
    return bool(got == want)

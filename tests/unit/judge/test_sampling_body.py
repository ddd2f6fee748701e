"""judge/sampler.py: what of the client's request the judge replays when it samples a group."""

from __future__ import annotations

from typing import Any

import pytest

from judge.sampler import sampling_body
from ratchet.settings import AliasConfig

PROMPT = [{"role": "user", "content": "Recommend a product."}]


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


@pytest.mark.parametrize(
    "response_format",
    [
        json_schema({"const": "Buy X."}),
        json_schema({"enum": ["Buy X.", "Buy X!"]}),
        json_schema({"type": "string", "pattern": "^Buy X\\.$"}),
        {"type": "structural_tag", "format": {"type": "const_string", "value": "Buy X."}},
    ],
    ids=["const", "enum", "pattern", "structural-tag"],
)
def test_a_format_that_fixes_the_answer_is_not_replayed(response_format: dict[str, Any]) -> None:
    """Replayed, the client would write all K answers its group trains on (audit N-4); the
    group is sampled free instead, with the rest of the request as it came."""
    request = {"messages": PROMPT, "response_format": response_format, "tool_choice": "none"}
    body = sampling_body("support@v1", PROMPT, request, 4, AliasConfig().sampling)
    assert "response_format" not in body
    assert body["tool_choice"] == "none" and body["n"] == 4


def test_a_format_that_leaves_the_answer_to_the_model_is_replayed() -> None:
    shape = json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    request = {"messages": PROMPT, "response_format": shape}
    body = sampling_body("support@v1", PROMPT, request, 4, AliasConfig().sampling)
    assert body["response_format"] == shape

"""What a Response repeats of its request: every request field the Open Responses specification
requires on a Response (``ResponseResource``), at the value the request gave or OpenAI's default,
and the checks of the fields that are only echoed (``metadata``, ``safety_identifier``), whose
bounds are OpenAI's. Pure, as proxy/responses_api.py, which calls it.

Two values differ from what OpenAI's API shows, both on the side of what is true here:

- ``text.format.schema`` of a ``json_schema`` format is echoed as ``null`` (the specification
  allows null, and its published types accept nothing else): the schema is applied, but a
  stored response does not keep a second copy of it.
- a function tool's ``strict`` is echoed as the request gave it (``null`` when absent), not as
  OpenAI's ``true`` default: vLLM does not enforce a schema on tool arguments unless the tool
  is forced.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import bad_request

METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
SAFETY_IDENTIFIER_CHARS = 64
# prompt_cache_key is echoed and stored with every response: bounded as chat bounds it.
PROMPT_CACHE_KEY_CHARS = 256
PENALTIES = ("presence_penalty", "frequency_penalty")

# Request fields a Response echoes back as the request gave them (OpenAI's defaults otherwise).
ECHOED_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "prompt_cache_key": None,
    "safety_identifier": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
    "tool_choice": "auto",
    "user": None,
}
# Echoed at one value whatever was asked: no background mode, truncation or reasoning here, and
# every request is served at the one tier there is (OpenAI shows "default" for "auto" too).
FIXED: dict[str, Any] = {
    "background": False,
    "truncation": "disabled",
    "service_tier": "default",
    "reasoning": {"effort": None, "summary": None},
}


def echo_of(payload: dict[str, Any], store: bool) -> dict[str, Any]:
    """The request's part of its Response (the request has passed :func:`check_echoed`)."""
    echo = {
        name: default if payload.get(name) is None else payload[name]
        for name, default in ECHOED_DEFAULTS.items()
    }
    echo.update(FIXED)
    echo["tools"] = [tool_echo(tool) for tool in payload.get("tools") or []]
    echo["text"] = {"format": format_echo((payload.get("text") or {}).get("format"))}
    echo["text"]["verbosity"] = "medium"
    echo["store"] = store
    return echo


def tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the specification's ``FunctionTool``: every field present."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def format_echo(fmt: dict[str, Any] | None) -> dict[str, Any]:
    if not fmt or fmt.get("type") == "text":
        return {"type": "text"}
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "name": fmt["name"],
        "description": fmt.get("description"),
        "schema": None,  # applied, not repeated (module docstring)
        "strict": fmt.get("strict") is True,
    }


def check_echoed(payload: dict[str, Any]) -> None:
    """The fields that are echoed (and, for the penalties, passed on): 400 naming the field."""
    check_metadata(payload.get("metadata"))
    for name in PENALTIES:
        value = payload.get(name)
        if value is not None and not (
            type(value) in (int, float) and -2.0 <= value <= 2.0  # bool is not a number here
        ):
            raise bad_request(f"{name} must be a number from -2 to 2", name, "invalid_value")
    safety = payload.get("safety_identifier")
    if safety is not None and not (
        isinstance(safety, str) and len(safety) <= SAFETY_IDENTIFIER_CHARS
    ):
        raise bad_request(
            f"safety_identifier must be a string of at most {SAFETY_IDENTIFIER_CHARS} chars",
            "safety_identifier",
            "invalid_value",
        )
    cache_key = payload.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise bad_request("prompt_cache_key must be a string", "prompt_cache_key", "invalid_type")
    if cache_key is not None and len(cache_key) > PROMPT_CACHE_KEY_CHARS:
        raise bad_request(
            f"prompt_cache_key must be at most {PROMPT_CACHE_KEY_CHARS} chars",
            "prompt_cache_key",
            "string_above_max_length",
        )


def check_metadata(metadata: Any) -> None:
    """OpenAI's bounds: at most 16 pairs, keys of at most 64 chars, string values of at most
    512 (a stored Response repeats them, so they bound what a request can make the store keep).
    A value's error names its key; a key's does not repeat the key, which may be long."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad_request("metadata must be an object", "metadata", "invalid_type")
    if len(metadata) > METADATA_PAIRS:
        raise bad_request(
            f"metadata has {len(metadata)} pairs; at most {METADATA_PAIRS} are allowed",
            "metadata",
            "object_above_max_properties",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad_request(
                f"a metadata key has {len(key)} chars; at most {METADATA_KEY_CHARS} are allowed",
                "metadata",
                "string_above_max_length",
            )
        where = f"metadata.{key}"
        if not isinstance(value, str):
            raise bad_request(f"{where} must be a string", where, "invalid_type")
        if len(value) > METADATA_VALUE_CHARS:
            raise bad_request(
                f"{where} has {len(value)} chars; at most {METADATA_VALUE_CHARS} are allowed",
                where,
                "string_above_max_length",
            )

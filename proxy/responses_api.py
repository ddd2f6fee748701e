"""The Responses API (``POST /v1/responses``) on vLLM's chat completions: the request as a chat
request, vLLM's answer as a Response (its stream as the Responses event sequence is
proxy/responses_stream.py). Pure: no network, no clock but the answer's own ``created``.

Why translate instead of forwarding to vLLM's own ``/v1/responses``: every other part of the
proxy (routing, canary, keys, limits, budgets, the log and what the judge learns from) speaks
chat, and stored responses must belong to the API key that made them and be shared by every
replica, which vLLM's in-process store is not. So a Responses exchange reaches vLLM, the log and
the judge as the chat exchange it is (``TrafficRecord.client_api`` says which API the client
called), tool calls and tool results included, and only what has a chat equivalent is accepted:
anything else is a 400 naming the parameter, never passed on to fail later.

The ids are vLLM's chat completion id re-prefixed (``chatcmpl-X`` is ``resp_X``), so a rating
of ``resp_X`` is a rating of the logged completion ``chatcmpl-X``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.errors import ProxyError, bad_request
from proxy.responses_echo import ECHOED_DEFAULTS, PENALTIES, check_echoed, echo_of

RESPONSE_PREFIX = "resp_"
CHAT_PREFIX = "chatcmpl-"
UNSUPPORTED = "unsupported_parameter"

# Accepted and without effect here: hints about caching, routing and billing on OpenAI's side
# (service_tier is echoed as "default"; prompt_cache_key is passed on: with several vLLM replicas
# it keys the conversation's replica; safety_identifier is only echoed).
IGNORED = frozenset({"prompt_cache_retention", "service_tier"})
# Accepted only at the value that asks for nothing vLLM lacks.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (False, None),
    "truncation": ("disabled", None),
    "include": ([], None),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "context_management": (None,),
}
KNOWN = (
    frozenset(
        {"model", "input", "stream", "store", "text", "tools", "reasoning", "stream_options"}
        | ECHOED_DEFAULTS.keys()
    )
    - NEUTRAL.keys()
)
MESSAGE_ROLES = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
RESPONSE_ID_MAX = 256
# The chat fields to_chat writes under another name, by the Responses field they came from: a
# refusal of the chat request names the client's field (proxy/client_fields.py). The messages
# are the instructions, the stored conversation and ``input``: an item's index is not the
# client's, so the field is named whole.
CHAT_FIELDS = {
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


def response_id_of(completion_id: str) -> str:
    return RESPONSE_PREFIX + completion_id.removeprefix(CHAT_PREFIX)


def completion_id_of_response(response_id: str) -> str:
    """The logged completion a response id names (the feedback route accepts either)."""
    if response_id.startswith(RESPONSE_PREFIX):
        return CHAT_PREFIX + response_id[len(RESPONSE_PREFIX) :]
    return response_id


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses request made a chat request: ``chat`` goes to vLLM (model: the alias, routed
    as any chat request), ``echo`` is what the Response repeats back, and ``conversation`` the
    chat messages of the whole exchange so far, which a stored response keeps for the next
    turn's ``previous_response_id`` (the instructions are not carried over, as OpenAI's)."""

    chat: dict[str, Any]
    echo: dict[str, Any]
    conversation: list[dict[str, Any]]
    store: bool
    stream: bool


def to_chat(payload: dict[str, Any], previous: list[dict[str, Any]] | None) -> ResponsesRequest:
    """Check a Responses body and translate it; ``previous`` is the stored conversation that
    ``previous_response_id`` names (looked up by the caller). 400 naming the parameter."""
    _check_fields(payload)
    new_messages = input_messages(payload.get("input"))
    conversation = [*(previous or []), *new_messages]
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions", "invalid_type")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": payload["model"], "messages": [*system, *conversation]}
    for name, chat_name in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
        ("user", "user"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("prompt_cache_key", "prompt_cache_key"),
        *((name, name) for name in PENALTIES),
    ):
        if payload.get(name) is not None:
            chat[chat_name] = payload[name]
    if payload.get("tools"):
        chat["tools"] = chat_tools(payload["tools"])
    if payload.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(payload["tool_choice"])
    response_format = chat_response_format(payload.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    stream = payload.get("stream") is True
    if stream:
        chat["stream"] = True
    store = payload.get("store", True) is not False
    return ResponsesRequest(chat, echo_of(payload, store), conversation, store, stream)


def _check_fields(payload: dict[str, Any]) -> None:
    for name, value in payload.items():
        if name in KNOWN or name in IGNORED:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise _unsupported(name, f"{name}={_short(value)} is not supported here")
            continue
        raise _unsupported(name, f"{name} is not a Responses parameter this server supports")
    for name, kind in (("stream", bool), ("store", bool), ("parallel_tool_calls", bool)):
        if payload.get(name) is not None and type(payload[name]) is not kind:
            raise bad_request(f"{name} must be a boolean", name, "invalid_type")
    max_output = payload.get("max_output_tokens")
    if max_output is not None and (type(max_output) is not int or max_output < 1):
        raise bad_request(
            "max_output_tokens must be a positive integer", "max_output_tokens", "invalid_type"
        )
    _check_neutral_objects(payload)
    check_echoed(payload)


def _check_neutral_objects(payload: dict[str, Any]) -> None:
    """``reasoning`` and ``stream_options`` as clients send them when they ask for nothing:
    no reasoning effort (null, or "none"), no summary; no stream obfuscation (never added)."""
    reasoning = payload.get("reasoning")
    if reasoning is not None and not (
        isinstance(reasoning, dict)
        and reasoning.get("effort") in (None, "none")
        and all(reasoning.get(name) is None for name in reasoning if name != "effort")
    ):
        raise _unsupported("reasoning", f"reasoning={_short(reasoning)} is not supported here")
    options = payload.get("stream_options")
    if options is not None and not (
        isinstance(options, dict)
        and set(options) <= {"include_obfuscation"}
        and options.get("include_obfuscation") in (None, True, False)
    ):
        raise _unsupported(
            "stream_options", f"stream_options={_short(options)} is not supported here"
        )


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages: consecutive function calls
    become one assistant message with ``tool_calls``, a function call's output a ``tool``
    message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request(
            "input must be a string or a non-empty list of items", "input", "invalid_type"
        )
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _append_tool_call(messages, _tool_call(item, where))
        elif kind == "function_call_output":
            messages.append(_tool_output(item, where))
        elif kind == "reasoning":
            continue  # another model's reasoning summary: nothing this model can take
        else:
            raise _unsupported(
                f"{where}.type",
                f"{where}.type {_short(kind)} is not supported here: send "
                "message, function_call or function_call_output items",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(
            f"{where}.role must be one of user, system, developer, assistant",
            f"{where}.role",
            "invalid_value",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": MESSAGE_ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of parts",
            f"{where}.content",
            "invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _unsupported(
                f"{at}.type",
                f"{at}.type {_short(kind)} is not supported here: the model reads text only "
                "(input_text, output_text)",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{at}.text must be a string", f"{at}.text", "invalid_type")
        texts.append(text)
    return {"role": MESSAGE_ROLES[role], "content": "".join(texts)}


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}", "invalid_type")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _append_tool_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tool_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id", "invalid_type")
    output = item.get("output")
    if isinstance(output, list):  # a list of text parts
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string", f"{where}.output", "invalid_type")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools", "invalid_type")
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(
                f"{where}.type",
                f"{where}.type {_short(kind)} is not supported here: only function tools "
                "(hosted tools such as web_search run on OpenAI's side)",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        function = {"name": tool["name"]}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request(
                "tool_choice.name must be a string", "tool_choice.name", "invalid_type"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported(
        "tool_choice",
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
    )


def chat_response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text", "invalid_type")
    _check_text_options(text)
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format", "invalid_type")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "text.format json_schema needs a name and a schema object",
                "text.format",
                "invalid_type",
            )
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(
        'text.format.type must be "text", "json_object" or "json_schema"',
        "text.format.type",
        "invalid_value",
    )


def _check_text_options(text: dict[str, Any]) -> None:
    for name, value in text.items():
        if name == "verbosity" and value in (None, "medium"):
            continue  # OpenAI's default: asks for nothing
        if name != "format":
            raise _unsupported(f"text.{name}", f"text.{name}={_short(value)} is not supported here")


def _unsupported(param: str, message: str) -> ProxyError:
    return bad_request(message, param, UNSUPPORTED)


def _short(value: Any) -> str:
    return repr(value)[:60]


# ---- the answer ---------------------------------------------------------------------------------


def response_object(
    answer: dict[str, Any],
    echo: dict[str, Any],
    *,
    status: str | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """vLLM's chat completion (whole, or assembled from a stream) as a Response;
    ``completed_at`` (the caller's clock) is shown only on a completed one, as OpenAI's."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    response_id = response_id_of(str(answer.get("id", "")))
    incomplete = choice.get("finish_reason") == "length"
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": response_id,
        "object": "response",
        "created_at": answer.get("created", 0),
        "completed_at": completed_at if status == "completed" else None,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": answer.get("model"),
        "output": output_items(message, response_id),
        "usage": usage_of(answer.get("usage")),
        **echo,
    }


def output_items(message: dict[str, Any], response_id: str) -> list[dict[str, Any]]:
    suffix = response_id.removeprefix(RESPONSE_PREFIX)
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(f"msg_{suffix}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append(
            function_call_item(
                call.get("id", ""), function.get("name", ""), function.get("arguments", "")
            )
        )
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [text_part(text)] if status == "completed" else []
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": f"fc_{call_id}",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """A Response's output as the chat message the next turn's conversation continues from."""
    text = "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message

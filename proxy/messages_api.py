"""The Anthropic Messages API (``POST /v1/messages``) on vLLM's chat completions: the request as
a chat request, vLLM's answer as a Message (its stream as Messages events is
proxy/messages_stream.py). Pure: no network, no clock.

Why translate here instead of forwarding to vLLM's own ``/v1/messages`` (vLLM translates to chat
inside itself too): every other part of the proxy speaks chat. The relay conceals the served
name in ``"model"``, token budgets read chat's usage events, the completion owners that let a
key rate its answer key on the chat completion id, and the traffic record must be a chat
exchange the judge can replay for its group and the learner can train on. A Messages exchange
forwarded as such would reach the log as a body the judge cannot replay. So it reaches vLLM,
the log and the judge as the chat exchange it is (``TrafficRecord.client_api`` is
``"messages"``), tool_use and tool_result blocks as chat tool calls and tool messages, and only
what has a chat equivalent is accepted: anything else is a 400 naming the parameter.

The ids are vLLM's chat completion id re-prefixed (``chatcmpl-X`` is ``msg_X``), so a rating of
``msg_X`` is a rating of the logged completion ``chatcmpl-X``.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import ProxyError, bad_request

MESSAGE_PREFIX = "msg_"
CHAT_PREFIX = "chatcmpl-"
UNSUPPORTED = "unsupported_parameter"

# Passed on as the chat parameter of the same meaning (top_k is vLLM's extension of chat).
SAMPLING = ("temperature", "top_p", "top_k")
# Accepted and without effect: caching and billing hints on Anthropic's side.
IGNORED = frozenset({"service_tier", "cache_control"})
KNOWN = (
    frozenset(
        {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "tools"}
        | {"tool_choice", "metadata", "thinking"}
        | set(SAMPLING)
    )
    | IGNORED
)
# Blocks of a message's content the proxy translates; cache_control on any is accepted, unused.
USER_BLOCKS = frozenset({"text", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "tool_use"})
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
TOOL_KEYS = frozenset({"name", "description", "input_schema", "cache_control", "type", "strict"})
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# The chat fields to_chat writes, by the Messages field they came from, for a refusal of the
# chat request to name what the client sent (proxy/client_fields.py). The chat messages are
# ``system`` and ``messages`` regrouped (tool results split out): named whole, not by index.
CHAT_FIELDS = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "messages": "messages",
}


def message_id_of(completion_id: str) -> str:
    return MESSAGE_PREFIX + completion_id.removeprefix(CHAT_PREFIX)


def completion_id_of_message(message_id: str) -> str:
    """The logged completion a Message id names (the feedback route accepts either)."""
    if message_id.startswith(MESSAGE_PREFIX):
        return CHAT_PREFIX + message_id[len(MESSAGE_PREFIX) :]
    return message_id


def to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as the chat request vLLM gets; a 400 naming what has no chat form."""
    _check_fields(payload)
    max_tokens = payload.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("max_tokens is required: a positive integer", "max_tokens")
    chat: dict[str, Any] = {
        "model": payload["model"],
        "messages": [*system_messages(payload.get("system")), *chat_messages(payload)],
        "max_tokens": max_tokens,
    }
    for name in SAMPLING:
        if payload.get(name) is not None:
            chat[name] = payload[name]
    if payload.get("stream") is not None:
        chat["stream"] = payload["stream"]
    if payload.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(payload["stop_sequences"])
    if payload.get("tools") is not None:
        chat["tools"] = chat_tools(payload["tools"])
    if payload.get("tool_choice") is not None:
        chat |= chat_tool_choice(payload["tool_choice"])
    user = _user_of(payload.get("metadata"))
    if user is not None:
        chat["user"] = user  # the sticky key and a vouching key's user, as chat's ``user``
    return chat


def _check_fields(payload: dict[str, Any]) -> None:
    for name in payload:
        if name not in KNOWN:
            raise _unsupported(name, f"{name} is not supported by this proxy's Messages API")
    thinking = payload.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or thinking.get("type") != "disabled"
    ):
        raise _unsupported("thinking", "extended thinking is not supported; omit thinking")


def system_messages(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": _text_of(system, "system")}]


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined, as chat's string content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _unsupported(f"{here}.type", f"{here} must be a text block")
        parts.append(_block_text(block, here))
    return "".join(parts)


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return text


def chat_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
        elif message["role"] == "user":
            chat.extend(_user_turn(_blocks(content, USER_BLOCKS, where), where))
        else:
            chat.append(_assistant_turn(_blocks(content, ASSISTANT_BLOCKS, where), where))
    return chat


def _blocks(content: Any, allowed: frozenset[str], where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", where)
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise _unsupported(
                f"{here}.type",
                f"{here}: a {kind!r} block is not supported here; this role takes "
                + ", ".join(sorted(allowed)),
            )
        extra = block.keys() - BLOCK_KEYS[kind]
        if extra:
            name = sorted(extra)[0]
            raise _unsupported(f"{here}.{name}", f"{here}.{name} is not supported")
    return content


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's tool results as chat tool messages (they must follow the assistant's calls),
    then its text as one user message."""
    turn: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        if block["type"] == "text":
            texts.append(_block_text(block, here))
            continue
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{here}.tool_use_id must be a string", f"{here}.tool_use_id")
        result = block.get("content", "")
        text = _text_of(result, f"{here}.content")
        turn.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if texts or not turn:
        turn.append({"role": "user", "content": "".join(texts)})
    return turn


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        if block["type"] == "text":
            texts.append(_block_text(block, here))
            continue
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise bad_request(f"{here} needs a string id and name", here)
        if not isinstance(arguments, dict):
            raise bad_request(f"{here}.input must be an object", f"{here}.input")
        function = {"name": name, "arguments": orjson.dumps(arguments).decode()}
        calls.append({"id": call_id, "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _stop_sequences(stops: Any) -> list[str]:
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
    return stops


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _unsupported(
                f"{where}.type", f"{where}: only client tools are supported, not {kind!r}"
            )
        extra = tool.keys() - TOOL_KEYS
        if extra:
            name = sorted(extra)[0]
            raise _unsupported(f"{where}.{name}", f"{where}.{name} is not supported")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema must be an object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def chat_tool_choice(choice: Any) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` as chat has them."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    chat: dict[str, Any]
    if kind in ("auto", "none"):
        chat = {"tool_choice": kind}
    elif kind == "any":
        chat = {"tool_choice": "required"}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise bad_request(
            "tool_choice must be {type: auto|any|none} or {type: tool, name}", "tool_choice"
        )
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False
    return chat


def _user_of(metadata: Any) -> str | None:
    if metadata is None:
        return None
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise bad_request("metadata takes only user_id", "metadata")
    if user is not None and not isinstance(user, str):
        raise bad_request("metadata.user_id must be a string", "metadata.user_id")
    return user


def _unsupported(param: str, message: str) -> ProxyError:
    return bad_request(message, param, UNSUPPORTED)


def message_object(answer: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat answer as a Message (its first choice: Messages has one)."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content = text_blocks(message.get("content"))
    content += [tool_use_block(call) for call in message.get("tool_calls") or []]
    stop_reason, stop_sequence = stop_of(choice, bool(message.get("tool_calls")))
    return {
        "id": message_id_of(str(answer.get("id", ""))),
        "type": "message",
        "role": "assistant",
        "model": answer.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(answer.get("usage")),
    }


def text_blocks(text: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}] if isinstance(text, str) and text else []


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "type": "tool_use",
        "id": call.get("id"),
        "name": function.get("name"),
        "input": arguments_of(function.get("arguments")),
    }


def arguments_of(arguments: Any) -> dict[str, Any]:
    """A call's JSON arguments as tool_use ``input``, which must be an object: what the model
    wrote that is no JSON object is kept whole under ``"arguments"`` rather than lost."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def stop_of(choice: dict[str, Any], called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice: vLLM names the stop string it matched in
    the choice's ``stop_reason``; a forced tool call finishes as "stop", hence ``called``."""
    finish = choice.get("finish_reason")
    if finish is None:
        return None, None
    if finish in STOP_REASONS:
        return STOP_REASONS[finish], None
    matched = choice.get("stop_reason")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    return {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
    }

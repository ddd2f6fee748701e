"""A tool-use task: answer a request by calling the right function with the right arguments.

Each prompt offers the same three function tools (``get_weather(city, day)``,
``convert_currency(amount, from_currency, to_currency)``, ``set_timer(minutes)``) and one user
turn that asks for one of them in words ("Will it rain in Lisbon on Friday?"). The right call is
never in the prompt in its answer form; the verifier (:func:`tool_use_reward`,
``"tasks.tool_use:tool_use_reward"``) parses the request with the generator's own
templates and checks the sample's *parsed* tool calls (vLLM's hermes parser turns the model's
``<tool_call>`` text into ``tool_calls``; :func:`ratchet.rewards.verifiers.tool_calls_of` reads
their JSON arguments). What a small model has to learn is to call at all, which tool, and
copying the arguments into its JSON.

A prompt of this task is ``{"messages", "tools", "tool_choice": "required", "expected"}``:
whoever sends it sends its tools and tool choice too (``tasks.request_fields``). The
choice is "required", as an agent that must act sets it, and each tool is ``strict``, as the
OpenAI Agents SDK sends a function tool by default: vLLM then constrains the answer to a call of
one of the tools with arguments of its schema, and the model chooses which and with what.
Measured with "auto" instead: SmolLM2-135M-Instruct never called a tool (40 prompts, 4 samples
each, every reward 0), which leaves GRPO nothing to learn from. Measured without ``strict``
(vLLM 0.32 then holds only the call's envelope to the grammar): on 40 prompts, greedy, 29
answers wrote the tool's JSON schema into the arguments until ``max_tokens`` (64), and they
scored 0.248 on average against 0.641 with ``strict`` (none cut off, 44 tokens against 57).
"""

from __future__ import annotations

import random
import re
from typing import Any

from ratchet.rewards.verifiers import tool_calls_of
from tasks.common import prompt_loader

__all__ = ["TOOLS", "expected_call", "generate_prompts", "load_prompts", "tool_use_reward"]

DEFAULT_COUNT = 480
DEFAULT_SEED = 20251127


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,  # as strict mode asks of a schema
            },
            "strict": True,
        },
    }


TOOLS = [
    _function(
        "get_weather",
        "The weather forecast for a city on a day of the week.",
        {"city": {"type": "string"}, "day": {"type": "string", "description": "e.g. monday"}},
    ),
    _function(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "description": "ISO code, e.g. EUR"},
            "to_currency": {"type": "string", "description": "ISO code, e.g. USD"},
        },
    ),
    _function(
        "set_timer",
        "Start a countdown timer.",
        {"minutes": {"type": "integer"}},
    ),
]

_CITIES = ("Lisbon", "Oslo", "Cairo", "Lima", "Perth", "Denver", "Kyoto", "Dakar", "Quito", "Riga")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF", "CAD")
# Each template: the tool it asks for, and the request in words; the verifier reads it back
# with a pattern made from the same template (_pattern).
_TEMPLATES = (
    ("get_weather", "Will it rain in {city} on {day}?"),
    ("get_weather", "What is the weather forecast for {city} on {day}?"),
    ("convert_currency", "How much is {amount} {from_currency} in {to_currency}?"),
    ("convert_currency", "Convert {amount} {from_currency} to {to_currency}, please."),
    ("set_timer", "Set a timer for {minutes} minutes."),
    ("set_timer", "Remind me in {minutes} minutes that the tea is ready."),
)
_FIELDS = {
    "city": "[A-Za-z]{1,20}",
    "day": "[a-z]{1,10}",
    "amount": "[0-9]{1,6}",
    "from_currency": "[A-Z]{3}",
    "to_currency": "[A-Z]{3}",
    "minutes": "[0-9]{1,4}",
}
_NUMBERS = frozenset({"amount", "minutes"})
MAX_REQUEST_CHARS = 200  # longer is no request of this task: not matched at all


def _pattern(template: str) -> re.Pattern[str]:
    """The template as a regex of bounded, non-overlapping fields: linear in the request."""
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(
        re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_FIELDS[part]})"
        for i, part in enumerate(parts)
    )
    return re.compile(regex)


_PATTERNS = tuple((tool, _pattern(template)) for tool, template in _TEMPLATES)
INSTRUCTION = "Use one of the tools to answer."
# The reward's parts: a call at all (parsed by vLLM), the right tool, then its arguments.
CALL_WEIGHT = 0.2
TOOL_WEIGHT = 0.3
ARGUMENTS_WEIGHT = 0.5
# Before the model calls tools at all: naming the right one in a <tool_call> it got wrong.
ATTEMPT_WEIGHT = 0.1


def _arguments(tool: str, rng: random.Random) -> dict[str, Any]:
    if tool == "get_weather":
        return {"city": rng.choice(_CITIES), "day": rng.choice(_DAYS)}
    if tool == "convert_currency":
        source, target = rng.sample(_CURRENCIES, 2)
        return {"amount": rng.randint(2, 900), "from_currency": source, "to_currency": target}
    return {"minutes": rng.randint(2, 90)}


def generate_prompts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``count`` distinct prompts ``{"messages", "tools", "expected": {"name", "arguments"}}``;
    the same seed gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        tool, text = rng.choice(_TEMPLATES)
        arguments = _arguments(tool, rng)
        request = text.format(**arguments)
        if request in seen:
            continue
        seen.add(request)
        out.append(
            {
                "messages": [{"role": "user", "content": f"{INSTRUCTION}\n\n{request}"}],
                "tools": TOOLS,
                "tool_choice": "required",
                "expected": {"name": tool, "arguments": arguments},
            }
        )
    return out


load_prompts = prompt_loader(generate_prompts)


def expected_call(prompt_messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The call the prompt asks for; ValueError for a prompt this task did not write."""
    users = [m for m in prompt_messages if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    if not isinstance(content, str) or not content.startswith(INSTRUCTION + "\n\n"):
        raise ValueError("tool_use_reward: not a prompt of this task")
    request = content[len(INSTRUCTION) + 2 :]
    if len(request) <= MAX_REQUEST_CHARS:
        for tool, pattern in _PATTERNS:
            found = pattern.fullmatch(request)
            if found:
                values = found.groupdict()
                return tool, {k: int(v) if k in _NUMBERS else v for k, v in values.items()}
    raise ValueError(f"tool_use_reward: not a request of this task: {request[:80]!r}")


def tool_use_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """In [0, 1]: ``CALL_WEIGHT`` for calling a tool at all, ``TOOL_WEIGHT`` more for the
    right one, and ``ARGUMENTS_WEIGHT`` times the share of its arguments given right (a city or
    a currency in any case, a number as a number or its digits). Only the first call counts.
    Without a parsed call, ``ATTEMPT_WEIGHT`` for a reply that tried (``<tool_call>``) and names
    the right tool."""
    tool, want = expected_call(prompt_messages)
    calls = tool_calls_of(sample)
    if not calls:
        content = sample.get("content")
        text = content if isinstance(content, str) else ""
        return ATTEMPT_WEIGHT if "<tool_call>" in text and tool in text else 0.0
    name, arguments = calls[0]
    if name != tool:
        return CALL_WEIGHT
    right = sum(_same(arguments.get(key), value) for key, value in want.items()) if arguments else 0
    return CALL_WEIGHT + TOOL_WEIGHT + ARGUMENTS_WEIGHT * right / len(want)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, int):
        return not isinstance(got, bool) and str(got).strip().removesuffix(".0") == str(want)
    return isinstance(got, str) and got.strip().lower() == str(want).lower()

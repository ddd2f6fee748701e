"""Checks on request bodies before anything is sent upstream.

Only the fields the proxy relies on, or that a client most often gets wrong, are checked here;
everything else passes through untouched and vLLM validates it (its 4xx answers are re-shaped into
our envelope). Each failure names the offending field in ``param``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.errors import ProxyError, bad_request
from ratchet.answer_shaping import answer_shaping
from ratchet.rewards.agreement import probes_agreement
from ratchet.secrets import USER_MAX_CHARS
from ratchet.settings import NAME_PATTERN, NAME_RULE, AliasConfig, ProxySettings

Check = Callable[[Any], bool]

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_range(low: int, high: int | None = None) -> Check:
    return lambda v: _is_int(v) and v >= low and (high is None or v <= high)


def _number_range(low: float, high: float) -> Check:
    return lambda v: _is_number(v) and low <= v <= high


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_str_or_str_list(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    )


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, list) and value:
        return (
            all(isinstance(v, str) for v in value)
            or all(_is_int(v) for v in value)
            or all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value)
        )
    return False


def _is_tools(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in value
    )


def _is_tool_choice(value: Any) -> bool:
    return value in ("none", "auto", "required") or (
        isinstance(value, dict) and isinstance(value.get("type"), str)
    )


def _is_response_format(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") in ("text", "json_object", "json_schema")


def _is_stream_options(value: Any) -> bool:
    return isinstance(value, dict) and _is_bool(value.get("include_usage", False))


# field -> (check, what it must be). Shared by both endpoints unless overridden below.
_SHORT_STRING: tuple[Check, str] = (
    lambda v: isinstance(v, str) and len(v) <= 256,
    "a string of at most 256 chars",
)
_COMMON: dict[str, tuple[Check, str]] = {
    "stream": (_is_bool, "a boolean"),
    "stream_options": (_is_stream_options, "an object with a boolean include_usage"),
    "n": (_int_range(1), "a positive integer"),
    "best_of": (_int_range(1), "a positive integer"),
    "max_tokens": (_int_range(1), "a positive integer"),
    "temperature": (_number_range(0.0, 2.0), "a number from 0 to 2"),
    "top_p": (_number_range(0.0, 1.0), "a number from 0 to 1"),
    "presence_penalty": (_number_range(-2.0, 2.0), "a number from -2 to 2"),
    "frequency_penalty": (_number_range(-2.0, 2.0), "a number from -2 to 2"),
    "seed": (_is_int, "an integer"),
    "stop": (_is_str_or_str_list, "a string or a list of strings"),
    "user": _SHORT_STRING,
    # Keys the conversation's replica in a fleet (ratchet/fleet.py); vLLM never sees it.
    "prompt_cache_key": _SHORT_STRING,
}
CHAT_FIELDS: dict[str, tuple[Check, str]] = {
    **_COMMON,
    "max_completion_tokens": (_int_range(1), "a positive integer"),
    "logprobs": (_is_bool, "a boolean"),
    "top_logprobs": (_int_range(0, 20), "an integer from 0 to 20"),
    "tools": (_is_tools, 'a list of {"type": "function", "function": {"name": ...}} objects'),
    "tool_choice": (_is_tool_choice, '"none", "auto", "required" or a tool object'),
    "response_format": (
        _is_response_format,
        'an object with type "text", "json_object" or "json_schema"',
    ),
}
COMPLETION_FIELDS: dict[str, tuple[Check, str]] = {
    **_COMMON,
    "logprobs": (_int_range(0, 20), "an integer from 0 to 20"),
    "echo": (_is_bool, "a boolean"),
}


def check_alias(payload: dict[str, Any]) -> str:
    model = payload.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required")
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model", "invalid_type")
    if not NAME_PATTERN.match(model):
        raise bad_request(
            f"model {model[:80]!r} is not a valid alias: {NAME_RULE}",
            "model",
            "invalid_model_name",
        )
    return model


def _check_fields(payload: dict[str, Any], fields: dict[str, tuple[Check, str]]) -> None:
    for name, (check, expected) in fields.items():
        if name in payload and payload[name] is not None and not check(payload[name]):
            raise bad_request(f"{name} must be {expected}", name, "invalid_type")


def check_chat(payload: dict[str, Any]) -> None:
    messages = payload.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages", "missing_required")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages", "invalid_type")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}",
                f"{where}.role",
                "invalid_value",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(
                f"{where}.content must be a string or a list of parts",
                f"{where}.content",
                "invalid_type",
            )
    _check_fields(payload, CHAT_FIELDS)


def check_completion(payload: dict[str, Any]) -> None:
    if "prompt" not in payload:
        raise bad_request("prompt is required", "prompt", "missing_required")
    if not _is_prompt(payload["prompt"]):
        raise bad_request(
            "prompt must be a string, a list of strings, or token ids", "prompt", "invalid_type"
        )
    _check_fields(payload, COMPLETION_FIELDS)


def check_feedback(payload: dict[str, Any]) -> tuple[str, float, str | None, str | None]:
    """Return (completion_id, score, thumbs, comment) or raise a 400."""
    completion_id = payload.get("completion_id")
    if not isinstance(completion_id, str) or not 0 < len(completion_id) <= 256:
        raise bad_request(
            "completion_id must be the id of a completion (a string)",
            "completion_id",
            "invalid_type",
        )
    score, thumbs = payload.get("score"), payload.get("thumbs")
    if thumbs is not None and thumbs not in ("up", "down"):
        raise bad_request('thumbs must be "up" or "down"', "thumbs", "invalid_value")
    if score is None and thumbs is None:
        raise bad_request("give a score in [0, 1] or thumbs up|down", "score", "missing_required")
    if score is not None and not (_is_number(score) and 0.0 <= score <= 1.0):
        raise bad_request("score must be a number from 0 to 1", "score", "invalid_value")
    if score is None:
        score = 1.0 if thumbs == "up" else 0.0
    comment = payload.get("comment")
    if comment is not None and not (isinstance(comment, str) and len(comment) <= 4096):
        raise bad_request(
            "comment must be a string of at most 4096 chars", "comment", "invalid_type"
        )
    user = payload.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= USER_MAX_CHARS):
        raise bad_request(
            f"user must be a string of at most {USER_MAX_CHARS} chars", "user", "invalid_type"
        )
    return completion_id, float(score), thumbs, comment


def unknown_alias(alias: str) -> ProxyError:
    return ProxyError(
        404,
        f"the model {alias!r} does not exist; GET /v1/models lists the aliases",
        param="model",
        code="model_not_found",
    )


# ---- limits -------------------------------------------------------------------------------------

# max_tokens allowed while vLLM's context length is unknown (not reached yet, or an upstream that
# does not report max_model_len) and proxy.max_tokens is unset.
FALLBACK_MAX_TOKENS = 32_768
LIMIT_EXCEEDED = "limit_exceeded"


@dataclass(slots=True)
class RequestLimits:
    """What one request may ask for (proxy.max_*), read once from the settings; each refusal is a
    4xx that names its setting. ``model_context`` is vLLM's max_model_len, once the upstream
    has told us."""

    max_body_bytes: int
    max_json_depth: int
    max_json_items: int
    max_messages: int
    max_n: int
    max_choices: int
    max_tokens: int | None
    max_answer_bytes: int
    model_context: int | None = None
    # Aliases whose answers are learned from (see learns_from_answers): answer-shaping
    # parameters are refused on them.
    learning_aliases: frozenset[str] = frozenset()

    @classmethod
    def from_settings(
        cls, proxy: ProxySettings, aliases: Mapping[str, AliasConfig] | None = None
    ) -> RequestLimits:
        learning = frozenset(a for a, c in (aliases or {}).items() if learns_from_answers(c))
        return cls(
            learning_aliases=learning,
            max_body_bytes=proxy.max_body_bytes,
            max_json_depth=proxy.max_json_depth,
            max_json_items=proxy.max_json_items,
            max_messages=proxy.max_messages,
            max_n=proxy.max_n,
            max_choices=proxy.max_choices,
            max_tokens=proxy.max_tokens,
            max_answer_bytes=proxy.max_answer_bytes,
        )

    def set_model_context(self, tokens: int) -> None:
        self.model_context = tokens

    def token_limit(self) -> tuple[int, str]:
        """The largest max_tokens allowed, and where that number comes from."""
        if self.max_tokens is not None:
            return self.max_tokens, "proxy.max_tokens"
        if self.model_context is not None:
            return self.model_context, "proxy.max_tokens (unset: the model's context length)"
        return FALLBACK_MAX_TOKENS, "proxy.max_tokens (unset, and the model's context unknown)"


def _over(param: str, message: str) -> ProxyError:
    return bad_request(message, param, LIMIT_EXCEEDED)


def check_depth(payload: Any, max_depth: int, max_items: int) -> None:
    """400 when the body nests deeper than proxy.max_json_depth (the top-level object is 1), or
    holds more than proxy.max_json_items values in all its objects and arrays together.

    The item bound is what bounds a body's memory: parsed, each small value costs 30-100 bytes
    (a 4 MiB body of ``[{},{},...]`` is 96 MiB), and an accepted body lives until its answer
    ends. Refused here, it is freed before the next request is parsed.

    A walk of the parsed body, one level at a time, that only descends into containers: a
    container's scalars are skipped at C speed (``set(map(type, ...))``), so a typical body costs
    microseconds, and it stops at the first level past the limit, or the first container past
    the item bound, before looking into it.
    """
    level: list[Any] = [payload]
    depth = 1
    items = 0
    while True:
        children: list[Any] = []
        for container in level:
            if not container:
                continue
            items += len(container)
            if items > max_items:
                raise _too_many_items(max_items)
            values = container.values() if type(container) is dict else container
            kinds = set(map(type, values))
            if dict in kinds or list in kinds:
                children += [v for v in values if type(v) is dict or type(v) is list]
        if not children:
            return
        depth += 1
        if depth > max_depth:
            raise json_too_deep(max_depth)
        level = children


def _too_many_items(max_items: int) -> ProxyError:
    return bad_request(
        f"the request body holds more than proxy.max_json_items ({max_items}) values in its "
        "objects and arrays together",
        None,
        LIMIT_EXCEEDED,
    )


def json_too_deep(max_depth: int) -> ProxyError:
    return bad_request(
        f"the request body nests deeper than proxy.max_json_depth ({max_depth} levels)",
        None,
        "json_too_deep",
    )


def _choices_per_prompt(payload: dict[str, Any], limits: RequestLimits) -> int:
    """n (or best_of, which vLLM generates and then picks from), refused past proxy.max_n."""
    n = payload.get("n") or 1
    best_of = payload.get("best_of") or 1
    for param, value in (("n", n), ("best_of", best_of)):
        if value > limits.max_n:
            raise _over(param, f"{param} is {value}, more than proxy.max_n ({limits.max_n})")
    return max(n, best_of)


def _prompt_count(prompt: Any) -> int:
    """How many prompts a /v1/completions ``prompt`` holds (checked by _is_prompt already)."""
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        return len(prompt)  # strings, or lists of token ids
    return 1


def check_limits(payload: dict[str, Any], endpoint: str, limits: RequestLimits) -> None:
    """Refuse, naming the setting, what asks for more than proxy.max_* allows. Runs after the
    type checks (check_chat / check_completion), so every field here has a valid type."""
    if payload.get("model") in limits.learning_aliases:
        check_answer_shaping(payload, endpoint)
    prompts = 1
    if endpoint == "chat.completions":
        messages = len(payload["messages"])
        if messages > limits.max_messages:
            raise _over(
                "messages",
                f"the request has {messages} messages, more than proxy.max_messages "
                f"({limits.max_messages})",
            )
    else:
        prompts = _prompt_count(payload["prompt"])
    choices = _choices_per_prompt(payload, limits) * prompts
    if choices > limits.max_choices:
        raise _over(
            "n",
            f"n x prompts is {choices} choices, more than proxy.max_choices "
            f"({limits.max_choices}); send fewer prompts per request or a lower n",
        )
    for param in ("max_tokens", "max_completion_tokens"):
        asked = payload.get(param)
        if asked is not None:
            allowed, setting = limits.token_limit()
            if asked > allowed:
                raise _over(param, f"{param} is {asked}, more than {setting} allows ({allowed})")


# ---- answer shaping -----------------------------------------------------------------------------


def learns_from_answers(config: AliasConfig) -> bool:
    """Whether an alias's served answers (or their ratings) become training evidence."""
    return config.learning.enabled or config.reward.learns_from_ratings or probes_agreement(config)


def check_answer_shaping(payload: dict[str, Any], endpoint: str = "chat.completions") -> None:
    """400 for a parameter that lets the client author the answer it is then judged and rated
    on, on an alias that learns from its answers (H-4, N-4: a client rating its own text). Each
    value is read as vLLM reads it (ratchet/answer_shaping.py): ``echo: "yes"`` is refused like
    ``echo: true``."""
    found = answer_shaping(payload, chat=endpoint == "chat.completions")
    if found is None:
        return
    param, why = found
    raise bad_request(
        f"{param} is not accepted for model {payload['model']!r}: it learns from its answers, "
        f"and {why}, so the request would write part of the answer that is then judged and rated",
        param,
        "unsupported_parameter",
    )

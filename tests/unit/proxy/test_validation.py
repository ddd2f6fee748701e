"""proxy/validation.py: every refused payload names its field, status and code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from proxy.errors import ProxyError
from proxy.validation import (
    FALLBACK_MAX_TOKENS,
    RequestLimits,
    check_alias,
    check_chat,
    check_completion,
    check_depth,
    check_feedback,
    check_limits,
    unknown_alias,
)
from ratchet.answer_shaping import SHAPING_FLAGS
from ratchet.settings import AliasConfig, ProxySettings

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "support", "messages": MSG, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": "support", "prompt": "hi", **fields}


def refused(check: Callable[[dict[str, Any]], Any], payload: dict[str, Any]) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        check(payload)
    return info.value


def assert_envelope(err: ProxyError, status: int, param: str | None, code: str) -> None:
    assert (err.status, err.param, err.code) == (status, param, code), err.message
    body = err.body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


# ---- check_alias --------------------------------------------------------------------------------

ALIAS_CASES = [
    ({}, "missing_required"),
    ({"model": None}, "missing_required"),
    ({"model": 3}, "invalid_type"),
    ({"model": ["support"]}, "invalid_type"),
    ({"model": True}, "invalid_type"),
    ({"model": ""}, "invalid_model_name"),
    ({"model": "Support"}, "invalid_model_name"),
    ({"model": "support@v3"}, "invalid_model_name"),
    ({"model": "-support"}, "invalid_model_name"),
    ({"model": "sup port"}, "invalid_model_name"),
    ({"model": "../../etc/passwd"}, "invalid_model_name"),
    ({"model": "a" * 65}, "invalid_model_name"),
    ({"model": "support\n"}, "invalid_model_name"),
]


@pytest.mark.parametrize(("payload", "code"), ALIAS_CASES, ids=[repr(c[0]) for c in ALIAS_CASES])
def test_check_alias_refuses(payload: dict[str, Any], code: str) -> None:
    assert_envelope(refused(check_alias, payload), 400, "model", code)


@pytest.mark.parametrize("model", ["support", "a", "x1.y_z-2", "a" * 64])
def test_check_alias_accepts(model: str) -> None:
    assert check_alias({"model": model}) == model


def test_long_model_name_is_truncated_in_message() -> None:
    err = refused(check_alias, {"model": "X" * 10_000})
    assert len(err.message) < 300


def test_unknown_alias() -> None:
    err = unknown_alias("nope")
    assert_envelope(err, 404, "model", "model_not_found")
    assert "nope" in err.message


# ---- check_chat ---------------------------------------------------------------------------------

CHAT_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"model": "support"}, "messages", "missing_required"),
    (chat(messages=None), "messages", "missing_required"),
    (chat(messages=[]), "messages", "invalid_type"),
    (chat(messages="hi"), "messages", "invalid_type"),
    (chat(messages={"role": "user", "content": "hi"}), "messages", "invalid_type"),
    (chat(messages=["hi"]), "messages[0]", "invalid_type"),
    (chat(messages=[*MSG, None]), "messages[1]", "invalid_type"),
    (chat(messages=[{"content": "hi"}]), "messages[0].role", "invalid_value"),
    (chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role", "invalid_value"),
    (chat(messages=[{"role": ["user"], "content": "hi"}]), "messages[0].role", "invalid_value"),
    (chat(messages=[*MSG, {"role": "user", "content": 5}]), "messages[1].content", "invalid_type"),
    (chat(messages=[{"role": "user", "content": {"a": 1}}]), "messages[0].content", "invalid_type"),
    (chat(stream="yes"), "stream", "invalid_type"),
    (chat(stream=1), "stream", "invalid_type"),
    (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options", "invalid_type"),
    (chat(stream_options=True), "stream_options", "invalid_type"),
    (chat(n=0), "n", "invalid_type"),
    (chat(n=-1), "n", "invalid_type"),
    (chat(n=1.5), "n", "invalid_type"),
    (chat(n=True), "n", "invalid_type"),
    (chat(best_of=0), "best_of", "invalid_type"),
    (chat(n="2"), "n", "invalid_type"),
    (chat(max_tokens=0), "max_tokens", "invalid_type"),
    (chat(max_tokens=10.0), "max_tokens", "invalid_type"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "invalid_type"),
    (chat(temperature=5), "temperature", "invalid_type"),
    (chat(temperature=-0.1), "temperature", "invalid_type"),
    (chat(temperature="0.5"), "temperature", "invalid_type"),
    (chat(temperature=False), "temperature", "invalid_type"),
    (chat(top_p=1.5), "top_p", "invalid_type"),
    (chat(presence_penalty=3), "presence_penalty", "invalid_type"),
    (chat(frequency_penalty=-2.5), "frequency_penalty", "invalid_type"),
    (chat(seed=1.5), "seed", "invalid_type"),
    (chat(seed="1"), "seed", "invalid_type"),
    (chat(stop=5), "stop", "invalid_type"),
    (chat(stop=["a", 1]), "stop", "invalid_type"),
    (chat(user=5), "user", "invalid_type"),
    (chat(user="u" * 257), "user", "invalid_type"),
    (chat(logprobs=1), "logprobs", "invalid_type"),
    (chat(top_logprobs=21), "top_logprobs", "invalid_type"),
    (chat(top_logprobs=-1), "top_logprobs", "invalid_type"),
    (chat(tools={"type": "function"}), "tools", "invalid_type"),
    (chat(tools=["get_weather"]), "tools", "invalid_type"),
    (chat(tools=[{"type": "function"}]), "tools", "invalid_type"),
    (chat(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools", "invalid_type"),
    (chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools", "invalid_type"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "invalid_type"),
    (chat(tool_choice="always"), "tool_choice", "invalid_type"),
    (chat(tool_choice={"function": {"name": "f"}}), "tool_choice", "invalid_type"),
    (chat(response_format={"type": "xml"}), "response_format", "invalid_type"),
    (chat(response_format="json_object"), "response_format", "invalid_type"),
]


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    CHAT_CASES,
    ids=[f"{c[1]}-{i}" for i, c in enumerate(CHAT_CASES)],
)
def test_check_chat_refuses(payload: dict[str, Any], param: str, code: str) -> None:
    err = refused(check_chat, payload)
    assert_envelope(err, 400, param, code)
    assert param.split("[")[0] in err.message


@pytest.mark.parametrize(
    "payload",
    [
        chat(),
        chat(
            messages=[
                {"role": "system", "content": "s"},
                {"role": "developer", "content": "d"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        ),
        chat(
            stream=True,
            stream_options={"include_usage": True},
            n=128,
            max_tokens=1,
            max_completion_tokens=5,
            temperature=0,
            top_p=1,
            presence_penalty=-2,
            frequency_penalty=2.0,
            seed=-7,
            stop=["\n", "END"],
            user="u" * 256,
            logprobs=True,
            top_logprobs=20,
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {}}},
                {"function": {"name": "g"}},
            ],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        ),
        chat(temperature=None, n=None, tools=None),  # null means "not set"
        chat(tool_choice="required", stop="x", response_format={"type": "text"}),
        chat(extra_vllm_param={"anything": True}),  # unknown fields pass through to vLLM
    ],
)
def test_check_chat_accepts(payload: dict[str, Any]) -> None:
    check_chat(payload)


# ---- check_completion ---------------------------------------------------------------------------

COMPLETION_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"model": "support"}, "prompt", "missing_required"),
    (cmpl(prompt=None), "prompt", "invalid_type"),
    (cmpl(prompt=5), "prompt", "invalid_type"),
    (cmpl(prompt=[]), "prompt", "invalid_type"),
    (cmpl(prompt=["a", 1]), "prompt", "invalid_type"),
    (cmpl(prompt=[1, True]), "prompt", "invalid_type"),
    (cmpl(prompt=[[1, 2], "a"]), "prompt", "invalid_type"),
    (cmpl(prompt={"text": "hi"}), "prompt", "invalid_type"),
    (cmpl(logprobs=True), "logprobs", "invalid_type"),
    (cmpl(logprobs=21), "logprobs", "invalid_type"),
    (cmpl(echo="yes"), "echo", "invalid_type"),
    (cmpl(n=0), "n", "invalid_type"),
    (cmpl(temperature=5), "temperature", "invalid_type"),
    (cmpl(stream="true"), "stream", "invalid_type"),
    (cmpl(max_tokens=-5), "max_tokens", "invalid_type"),
]


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    COMPLETION_CASES,
    ids=[f"{c[1]}-{i}" for i, c in enumerate(COMPLETION_CASES)],
)
def test_check_completion_refuses(payload: dict[str, Any], param: str, code: str) -> None:
    assert_envelope(refused(check_completion, payload), 400, param, code)


@pytest.mark.parametrize(
    "payload",
    [
        cmpl(),
        cmpl(prompt=""),
        cmpl(prompt=["a", "b"]),
        cmpl(prompt=[1, 2, 3]),
        cmpl(prompt=[[1, 2], [3]]),
        cmpl(logprobs=0, echo=True, n=2, stream=False, temperature=2),
    ],
)
def test_check_completion_accepts(payload: dict[str, Any]) -> None:
    check_completion(payload)


def test_chat_only_fields_are_not_checked_on_completions() -> None:
    # logprobs is an integer on /v1/completions and a boolean on chat.
    check_completion(cmpl(logprobs=5))
    assert_envelope(refused(check_chat, chat(logprobs=5)), 400, "logprobs", "invalid_type")


# ---- check_feedback -----------------------------------------------------------------------------

FEEDBACK_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"score": 1}, "completion_id", "invalid_type"),
    ({"completion_id": "", "score": 1}, "completion_id", "invalid_type"),
    ({"completion_id": 5, "score": 1}, "completion_id", "invalid_type"),
    ({"completion_id": "c" * 257, "score": 1}, "completion_id", "invalid_type"),
    ({"completion_id": "c1"}, "score", "missing_required"),
    ({"completion_id": "c1", "score": None, "thumbs": None}, "score", "missing_required"),
    ({"completion_id": "c1", "score": 1.5}, "score", "invalid_value"),
    ({"completion_id": "c1", "score": -0.1}, "score", "invalid_value"),
    ({"completion_id": "c1", "score": "0.5"}, "score", "invalid_value"),
    ({"completion_id": "c1", "score": True}, "score", "invalid_value"),
    ({"completion_id": "c1", "score": [1]}, "score", "invalid_value"),
    ({"completion_id": "c1", "thumbs": "sideways"}, "thumbs", "invalid_value"),
    ({"completion_id": "c1", "thumbs": True}, "thumbs", "invalid_value"),
    ({"completion_id": "c1", "score": 1, "comment": 5}, "comment", "invalid_type"),
    ({"completion_id": "c1", "score": 1, "comment": "x" * 4097}, "comment", "invalid_type"),
]


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    FEEDBACK_CASES,
    ids=[f"{c[1]}-{i}" for i, c in enumerate(FEEDBACK_CASES)],
)
def test_check_feedback_refuses(payload: dict[str, Any], param: str, code: str) -> None:
    assert_envelope(refused(check_feedback, payload), 400, param, code)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"completion_id": "c1", "score": 0}, ("c1", 0.0, None, None)),
        ({"completion_id": "c1", "score": 1}, ("c1", 1.0, None, None)),
        ({"completion_id": "c1", "score": 0.25, "comment": "ok"}, ("c1", 0.25, None, "ok")),
        ({"completion_id": "c1", "thumbs": "up"}, ("c1", 1.0, "up", None)),
        ({"completion_id": "c1", "thumbs": "down"}, ("c1", 0.0, "down", None)),
        ({"completion_id": "c1", "thumbs": "up", "score": 0.75}, ("c1", 0.75, "up", None)),
        ({"completion_id": "c" * 256, "score": 1}, ("c" * 256, 1.0, None, None)),
    ],
)
def test_check_feedback_accepts(payload: dict[str, Any], expected: tuple) -> None:
    result = check_feedback(payload)
    assert result == expected
    assert isinstance(result[1], float)


# ---- limits -------------------------------------------------------------------------------------


def limits(**proxy: Any) -> RequestLimits:
    return RequestLimits.from_settings(ProxySettings(**proxy))


def over(payload: dict[str, Any], endpoint: str, lim: RequestLimits) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        check_limits(payload, endpoint, lim)
    return info.value


CHAT, CMPL = "chat.completions", "completions"
LIMIT_CASES: list[tuple[dict[str, Any], str, dict[str, Any], str, str]] = [
    # (payload, endpoint, settings, param, the setting the message names)
    (chat(messages=MSG * 5), CHAT, {"max_messages": 4}, "messages", "proxy.max_messages"),
    (chat(n=17), CHAT, {}, "n", "proxy.max_n"),
    (chat(n=3), CHAT, {"max_n": 2}, "n", "proxy.max_n"),
    (chat(best_of=3), CHAT, {"max_n": 2}, "best_of", "proxy.max_n"),
    (cmpl(n=129), CMPL, {"max_n": 128, "max_choices": 4096}, "n", "proxy.max_n"),
    (cmpl(prompt=["a"] * 65), CMPL, {}, "n", "proxy.max_choices"),
    (cmpl(prompt=["a"] * 9, n=8), CMPL, {}, "n", "proxy.max_choices"),
    (cmpl(prompt=[[1, 2]] * 5, best_of=2), CMPL, {"max_choices": 9}, "n", "proxy.max_choices"),
    (chat(n=5), CHAT, {"max_choices": 4}, "n", "proxy.max_choices"),
    (chat(max_tokens=10**9), CHAT, {}, "max_tokens", "proxy.max_tokens"),
    (chat(max_tokens=101), CHAT, {"max_tokens": 100}, "max_tokens", "proxy.max_tokens"),
    (
        chat(max_completion_tokens=101),
        CHAT,
        {"max_tokens": 100},
        "max_completion_tokens",
        "proxy.max_tokens",
    ),
    (cmpl(max_tokens=FALLBACK_MAX_TOKENS + 1), CMPL, {}, "max_tokens", "proxy.max_tokens"),
]


@pytest.mark.parametrize(
    ("payload", "endpoint", "settings", "param", "setting"),
    LIMIT_CASES,
    ids=[f"{c[3]}-{i}" for i, c in enumerate(LIMIT_CASES)],
)
def test_limits_refuse_naming_the_setting(
    payload: dict[str, Any], endpoint: str, settings: dict[str, Any], param: str, setting: str
) -> None:
    err = over(payload, endpoint, limits(**settings))
    assert_envelope(err, 400, param, "limit_exceeded")
    assert setting in err.message


@pytest.mark.parametrize(
    ("payload", "endpoint", "settings"),
    [
        (chat(messages=MSG * 4), CHAT, {"max_messages": 4}),
        (chat(n=16, max_tokens=FALLBACK_MAX_TOKENS), CHAT, {}),
        (cmpl(prompt=["a"] * 8, n=8), CMPL, {}),
        (cmpl(prompt=list(range(5000)), n=16), CMPL, {}),  # token ids: one prompt
        (cmpl(prompt="x", n=None, max_tokens=None), CMPL, {}),
        (chat(max_tokens=100, max_completion_tokens=100), CHAT, {"max_tokens": 100}),
    ],
)
def test_limits_accept_up_to_the_setting(
    payload: dict[str, Any], endpoint: str, settings: dict[str, Any]
) -> None:
    check_limits(payload, endpoint, limits(**settings))


def test_max_tokens_defaults_to_the_model_context() -> None:
    lim = limits()
    lim.set_model_context(2048)
    check_limits(chat(max_tokens=2048), CHAT, lim)
    err = over(chat(max_tokens=2049), CHAT, lim)
    assert "2048" in err.message and "context" in err.message
    # A configured limit wins over the model's context.
    lim = limits(max_tokens=4096)
    lim.set_model_context(2048)
    check_limits(chat(max_tokens=4096), CHAT, lim)


ITEMS = 262_144  # proxy.max_json_items's default


def nested(depth: int) -> dict[str, Any]:
    """A body whose deepest container is at `depth` (the body itself is depth 1)."""
    inner: Any = []
    for _ in range(depth - 2):
        inner = [inner]
    return {"model": "support", "x": inner} if depth > 1 else {}


@pytest.mark.parametrize("depth", [1, 2, 3, 10, 64])
def test_depth_at_the_limit_passes(depth: int) -> None:
    check_depth(nested(depth), 64, ITEMS)


@pytest.mark.parametrize("depth", [65, 200, 1000])
def test_depth_past_the_limit_is_refused(depth: int) -> None:
    with pytest.raises(ProxyError) as info:
        check_depth(nested(depth), 64, ITEMS)
    assert_envelope(info.value, 400, None, "json_too_deep")
    assert "proxy.max_json_depth" in info.value.message


def test_depth_counts_every_branch_and_dicts() -> None:
    wide = {"a": [1, "s", None, {"b": [{"c": {}}]}], "z": 1.5}  # depth 6 on one branch
    check_depth(wide, 6, ITEMS)
    with pytest.raises(ProxyError):
        check_depth(wide, 5, ITEMS)


def test_items_are_counted_in_every_container() -> None:
    # 3 top-level values, 9 in "x", 2 in each dict, 1 in each [0]: 39 values in all.
    body = {"model": "support", "messages": [], "x": [{"a": 1, "b": [0]} for _ in range(9)]}
    check_depth(body, 64, 39)
    with pytest.raises(ProxyError):
        check_depth(body, 64, 38)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "support", "x": [{}] * 100},  # many small containers: 24x their JSON in memory
        {"model": "support", "x": ["a"] * 100},  # many small strings: 18x
        {"model": "support", "x": [{"y": 1}] * 40},  # a value per container, under 100 containers
    ],
    ids=["empty-objects", "short-strings", "values-in-objects"],
)
def test_items_past_the_limit_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ProxyError) as info:
        check_depth(body, 64, 60)
    assert_envelope(info.value, 400, None, "limit_exceeded")
    assert "proxy.max_json_items" in info.value.message


# ---- answer shaping -----------------------------------------------------------------------------

ASSISTANT_LAST = [*MSG, {"role": "assistant", "content": "Mention X: it is the best answer."}]


@pytest.mark.parametrize(
    ("payload", "endpoint", "param"),
    [
        (chat(messages=ASSISTANT_LAST, echo=True), CHAT, "echo"),
        (
            chat(messages=ASSISTANT_LAST, continue_final_message=True),
            CHAT,
            "continue_final_message",
        ),
        (
            chat(messages=ASSISTANT_LAST, add_generation_prompt=False),
            CHAT,
            "add_generation_prompt",
        ),
        (cmpl(echo=True), CMPL, "echo"),
    ],
)
def test_answer_shaping_is_refused_on_an_alias_that_learns(
    payload: dict[str, Any], endpoint: str, param: str
) -> None:
    """With these a client writes the answer it then rates (or the judge scores): refused with
    a 400 naming the parameter on an alias that learns, passed on to vLLM on one that does not."""
    from ratchet.settings import AliasConfig

    frozen = AliasConfig(learning={"enabled": False}, feedback={"judge_agreement": False})
    aliases = {"support": AliasConfig(), "frozen": frozen}
    lim = RequestLimits.from_settings(ProxySettings(), aliases)
    error = over(payload, endpoint, lim)
    assert (error.status, error.param, error.code) == (400, param, "unsupported_parameter")
    assert param in error.message and "'support'" in error.message
    # The harmless values, and the same request on an alias that does not learn from answers.
    harmless = {**payload, param: not payload[param]}
    check_limits(harmless, endpoint, lim)
    check_limits({**payload, "model": "frozen"}, endpoint, lim)


SPELLINGS = {
    "echo": [1, "true", "yes", "on", "t", "TRUE", 1.0],
    "continue_final_message": [1, "yes", "y", "1"],
    "add_generation_prompt": [0, "false", "no", "off", "0", 0.0],
}


@pytest.mark.parametrize(
    ("param", "value"),
    [(param, value) for param, values in SPELLINGS.items() for value in values],
)
def test_every_spelling_vllm_reads_as_shaping_is_refused(param: str, value: Any) -> None:
    """vLLM's pydantic reads ``1``, ``"yes"``, ``"off"``... as booleans: each spelling it reads
    as the shaping value is refused like the JSON boolean (audit N-4), and one it reads as the
    harmless value (or refuses itself) passes on."""
    lim = RequestLimits.from_settings(ProxySettings(), {"support": AliasConfig()})
    error = over(chat(messages=ASSISTANT_LAST, **{param: value}), CHAT, lim)
    assert (error.status, error.param, error.code) == (400, param, "unsupported_parameter")
    harmless = "no" if SHAPING_FLAGS[param] else "yes"
    check_limits(chat(messages=ASSISTANT_LAST, **{param: harmless}), CHAT, lim)
    check_limits(chat(messages=ASSISTANT_LAST, **{param: "maybe"}), CHAT, lim)  # vLLM's 400


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


FIXED = {"type": "object", "properties": {"a": {"const": "mine"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("payload", "endpoint", "param"),
    [
        (chat(response_format=json_schema({"enum": ["Buy X now."]})), CHAT, "response_format"),
        (chat(response_format=json_schema({**FIXED, "additionalProperties": False})), CHAT,
         "response_format"),
        (chat(structured_outputs={"regex": "Buy X now\\."}), CHAT, "structured_outputs"),
        (chat(structured_outputs={"choice": ["Buy X", "Buy Y"]}), CHAT, "structured_outputs"),
        (chat(structured_outputs={"grammar": 'root ::= "x"'}), CHAT, "structured_outputs"),
        (chat(structured_outputs={"json": '{"const": "x"}'}), CHAT, "structured_outputs"),
        (cmpl(structured_outputs={"regex": "(?i)buy x"}), CMPL, "structured_outputs"),
        (chat(chat_template="{{ 'Sure, X is best' }}"), CHAT, "chat_template"),
        (chat(allowed_token_ids=[42]), CHAT, "allowed_token_ids"),
        (cmpl(logit_bias={"42": 100}), CMPL, "logit_bias"),
        (cmpl(response_format={"type": "structural_tag", "format": {}}), CMPL, "response_format"),
    ],
)  # fmt: skip
def test_a_constraint_that_fixes_the_answer_is_refused(
    payload: dict[str, Any], endpoint: str, param: str
) -> None:
    lim = RequestLimits.from_settings(ProxySettings(), {"support": AliasConfig()})
    error = over(payload, endpoint, lim)
    assert (error.status, error.param, error.code) == (400, param, "unsupported_parameter")


@pytest.mark.parametrize(
    "payload",
    [
        chat(response_format=json_schema(FIXED)),  # other properties allowed: the model writes
        chat(response_format=json_schema({"type": "object", "properties": {
            "label": {"enum": ["pos", "neg"]}, "why": {"type": "string"}}})),
        chat(structured_outputs={"regex": "[0-9]{3}"}),  # 1000 answers: the model picks
        chat(structured_outputs={"json_object": True}),
        chat(logit_bias={"42": -100}),  # a ban writes nothing
        cmpl(add_generation_prompt=False),  # not a /v1/completions parameter: vLLM ignores it
    ],
)  # fmt: skip
def test_a_constraint_that_leaves_the_answer_to_the_model_passes(payload: dict[str, Any]) -> None:
    lim = RequestLimits.from_settings(ProxySettings(), {"support": AliasConfig()})
    check_limits(payload, CHAT if "messages" in payload else CMPL, lim)

"""ratchet/answer_shaping.py: shaping flags read as vLLM reads them, and constraints counted."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from ratchet.answer_shaping import (
    MAX_BANNED_TOKENS,
    MAX_FIXED_ANSWERS,
    READ_PARAMS,
    SHAPING_FLAGS,
    answer_shaping,
    regex_answers,
    schema_answers,
    schema_fixing,
    vllm_bool,
)

# Every kind of JSON value a client can send, in the spellings pydantic's lax bool knows and some
# it does not.
VALUES: list[Any] = [True, False, 1, 0, 2, -1, 1.0, 0.0, 1.5, "true", "True", "TRUE", "false",
                     "yes", "no", "on", "off", "y", "n", "t", "f", "1", "0", " true", "maybe",
                     "", [], {}, [1]]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_models() -> tuple[Any, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return ChatCompletionRequest, CompletionRequest


def vllm_reads(model: Any, body: dict[str, Any], field: str) -> bool | None:
    try:
        return bool(getattr(model.model_validate(body), field))
    except ValidationError:
        return None  # vLLM answers 400


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_flags_are_read_as_the_installed_vllm_reads_them(
    vllm_models: tuple[Any, Any], value: Any
) -> None:
    chat_request, completion_request = vllm_models
    for field in SHAPING_FLAGS:
        body = {"messages": [{"role": "user", "content": "x"}], field: value}
        assert vllm_bool(value) == vllm_reads(chat_request, body, field), field
    completion = {"prompt": "x", "echo": value}
    assert vllm_bool(value) == vllm_reads(completion_request, completion, "echo")


@pytest.mark.parametrize(
    ("pattern", "answers"),
    [
        ("Buy X now", 1),
        ("^Buy X now$", 1),
        ("(?i)buy x", 1),
        ("(Buy|Sell) X", 2),
        ("[ab]{2}", 4),
        ("a{0,3}", 4),
        ("[0-9]{3}", 1000),
        ("[a-z]+", None),
        (".*", None),
        ("\\d", None),
        ("[^a]", None),
        ("(unclosed", None),
    ],
)
def test_regex_answers_are_counted(pattern: str, answers: int | None) -> None:
    assert regex_answers(pattern) == answers


OBJECT: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"const": "x"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("schema", "answers"),
    [
        ({"const": "x"}, 1),
        ({"enum": [1, 2, 3]}, 3),
        (OBJECT, 2),
        ({**OBJECT, "required": ["a"]}, 3),  # b absent, true or false
        ({**OBJECT, "additionalProperties": True}, None),
        ({"anyOf": [{"const": 1}, {"type": "null"}]}, 2),
        ({"allOf": [{"type": "string"}, {"enum": ["a", "b"]}]}, 2),
        ({"$defs": {"x": {"const": 1}}, "$ref": "#/$defs/x"}, 1),
        ({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}, None),  # a cycle
        ({"type": "integer", "minimum": 1, "maximum": 5}, 5),
        ({"type": "integer", "minimum": 1}, None),
        ({"type": "string", "pattern": "^yes|no$"}, 2),
        ({"type": "string"}, None),
        ({"type": "array", "items": {"const": 1}}, None),
    ],
)
def test_schema_answers_are_counted(schema: dict[str, Any], answers: int | None) -> None:
    assert schema_answers(schema) == answers


def test_an_enum_on_the_whole_answer_fixes_it_however_long() -> None:
    """The client wrote every answer the model may give: fixing whatever their number."""
    many = {"enum": [f"answer {i}" for i in range(10 * MAX_FIXED_ANSWERS)]}
    assert schema_fixing(many)
    assert not schema_fixing({"type": "object", "properties": {"a": many}})


def test_counting_stops_on_a_schema_built_to_be_slow() -> None:
    """A deep or wide schema costs at most a bounded number of nodes, then counts as too many
    (it is not refused for that)."""
    deep: dict[str, Any] = {"const": 1}
    for _ in range(5000):
        deep = {"anyOf": [deep]}
    assert schema_answers(deep) is None
    assert regex_answers("(a|b)" * 5000) is None


def test_the_first_shaping_parameter_is_named() -> None:
    body = {"echo": "yes", "structured_outputs": {"choice": ["a"]}}
    found = answer_shaping(body)
    assert found is not None and found[0] == "echo"
    found = answer_shaping({"structured_outputs": {"choice": ["a"]}})
    assert found is not None and found[0] == "structured_outputs"
    assert answer_shaping({"echo": "no", "add_generation_prompt": "yes"}) is None
    # /v1/completions has no continue_final_message or chat template: vLLM ignores them there.
    ignored = {"continue_final_message": True, "chat_template": "x"}
    assert answer_shaping(ignored, chat=False) is None


def bans(count: int, value: Any = -100) -> dict[str, Any]:
    return {"logit_bias": {str(token): value for token in range(count)}}


@pytest.mark.parametrize(
    "body",
    [
        bans(MAX_BANNED_TOKENS + 1),  # all but a handful of a small vocabulary banned
        bans(MAX_BANNED_TOKENS + 1, "-5"),  # vLLM reads the string as a float: still a ban
        bans(150_000, -0.5),
        {"logit_bias": {"42": "100"}},  # positive, however spelled
    ],
    ids=["one-past-the-bound", "string-values", "whole-vocabulary", "positive-string"],
)
def test_a_logit_bias_that_bans_nearly_everything_is_refused(body: dict[str, Any]) -> None:
    found = answer_shaping(body)
    assert found is not None and found[0] == "logit_bias"


@pytest.mark.parametrize(
    "body",
    [
        bans(3),  # banning a few tokens: the model still chooses
        bans(MAX_BANNED_TOKENS),
        {"logit_bias": {str(token): 0 for token in range(5 * MAX_BANNED_TOKENS)}},  # no bias
        {"logit_bias": {"1": "x", "2": None, "3": -100}},  # vLLM refuses these itself
    ],
    ids=["a-few", "at-the-bound", "zeros", "unreadable"],
)
def test_a_logit_bias_that_bans_a_few_tokens_is_served(body: dict[str, Any]) -> None:
    assert answer_shaping(body) is None


FIXED_ARGUMENTS = {
    "type": "object",
    "properties": {"verdict": {"const": "Buy X"}},
    "required": ["verdict"],
    "additionalProperties": False,
}
FREE_ARGUMENTS = {"type": "object", "properties": {"city": {"type": "string"}}}


def tools(**schemas: Any) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name, schema in schemas.items()
    ]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("body", "fixing"),
    [
        ({"tools": tools(say=FIXED_ARGUMENTS), "tool_choice": named("say")}, True),
        ({"tools": tools(say=FIXED_ARGUMENTS), "tool_choice": "required"}, True),
        # the model may call the free tool instead, or answer in text
        ({"tools": tools(say=FIXED_ARGUMENTS, w=FREE_ARGUMENTS), "tool_choice": "required"}, False),
        ({"tools": tools(say=FIXED_ARGUMENTS), "tool_choice": "auto"}, False),
        ({"tools": tools(say=FIXED_ARGUMENTS, w=FREE_ARGUMENTS), "tool_choice": named("w")}, False),
        ({"tools": tools(say=FIXED_ARGUMENTS), "tool_choice": named("other")}, False),
    ],
    ids=["named-fixed", "required-all-fixed", "required-one-free", "auto", "named-free",
         "named-unknown"],
)  # fmt: skip
def test_a_forced_call_whose_arguments_are_fixed_is_refused(
    body: dict[str, Any], fixing: bool
) -> None:
    """vLLM decodes a forced call's arguments under its tool's parameters schema: with a fixing
    schema the client wrote the call, which is the answer."""
    found = answer_shaping(body)
    assert (found is not None and found[0] == "tool_choice") is fixing


class Recording(dict[str, Any]):
    """A body that records every parameter read of it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def test_a_body_without_any_parameter_read_is_let_through_early() -> None:
    """A body with none of READ_PARAMS skips the checks: each parameter they read is in it
    (``tools`` is read only for ``tool_choice``), so no check can be skipped that would refuse."""
    body = Recording({"tool_choice": "required", "model": "m"})
    with pytest.MonkeyPatch.context() as patch:  # past the early return, every check runs
        patch.setattr("ratchet.answer_shaping.READ_PARAMS", frozenset({"model"}))
        assert answer_shaping(body) is None
    assert body.read - {"model", "tools"} <= READ_PARAMS
    assert answer_shaping({"model": "m", "messages": []}) is None

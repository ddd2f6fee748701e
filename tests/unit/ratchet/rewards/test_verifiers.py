"""Verifiers and the example verifier: loading, running and mixing programmatic rewards."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.rewards.examples import exact_json_fields
from ratchet.rewards.verifiers import VerifierError, combine, load_verifier, run_verifier

PROMPT: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
SAMPLE: dict[str, Any] = {"role": "assistant", "content": "hi"}

MODULE_SOURCE = textwrap.dedent(
    """
    import math

    NOT_CALLABLE = 3

    def good(prompt_messages, sample):
        return 0.75 if sample["content"] == "hi" else 0.25

    def one(prompt_messages, sample):
        return 1

    def raises(prompt_messages, sample):
        raise KeyError("expected")

    def nan(prompt_messages, sample):
        return math.nan

    def inf(prompt_messages, sample):
        return math.inf

    def boolean(prompt_messages, sample):
        return True

    def text(prompt_messages, sample):
        return "0.5"

    def nothing(prompt_messages, sample):
        return None

    def too_high(prompt_messages, sample):
        return 1.5

    def negative(prompt_messages, sample):
        return -0.1

    def mutates(prompt_messages, sample):
        prompt_messages.clear()
        sample["content"] = "changed"
        return 0.5

    class Holder:
        @staticmethod
        def check(prompt_messages, sample):
            return 0.5
    """
)


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway verifier module on sys.path, with a unique name so no test sees another's."""
    name = f"ratchet_test_verifiers_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE)
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    sys.modules.pop(f"{name}_broken", None)


def loaded(module: str, function: str) -> Any:
    return load_verifier(f"{module}:{function}")


# --- loading ----------------------------------------------------------------------------------


def test_load_a_good_spec(module: str) -> None:
    verifier = loaded(module, "good")
    assert verifier(PROMPT, SAMPLE) == 0.75


def test_load_a_dotted_attribute(module: str) -> None:
    assert loaded(module, "Holder.check")(PROMPT, SAMPLE) == 0.5


def test_load_the_shipped_example() -> None:
    assert load_verifier("ratchet.rewards.examples:exact_json_fields") is exact_json_fields


@pytest.mark.parametrize("spec", ["no_colon", ":good", "json:", ""])
def test_badly_formed_specs(spec: str) -> None:
    with pytest.raises(VerifierError, match=r"package\.module:function") as info:
        load_verifier(spec)
    assert info.value.cause == "import"


def test_a_missing_module_names_the_spec() -> None:
    spec = "no_such_package_for_ratchet.verifiers:score"
    with pytest.raises(VerifierError) as info:
        load_verifier(spec)
    assert info.value.cause == "import"
    assert repr(spec) in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_a_module_that_fails_to_import(module: str) -> None:
    with pytest.raises(VerifierError, match="broken at import") as info:
        load_verifier(f"{module}_broken:score")
    assert info.value.cause == "import"


@pytest.mark.parametrize("function", ["missing", "Holder.missing", "good.nested"])
def test_a_missing_attribute_names_the_spec(module: str, function: str) -> None:
    with pytest.raises(VerifierError, match="no attribute") as info:
        loaded(module, function)
    assert info.value.cause == "import"
    assert f"{module}:{function}" in str(info.value)


def test_a_value_that_is_not_callable(module: str) -> None:
    with pytest.raises(VerifierError, match="not callable") as info:
        loaded(module, "NOT_CALLABLE")
    assert info.value.cause == "import"
    assert "NOT_CALLABLE" in str(info.value)


def test_verifier_error_causes_are_fixed() -> None:
    with pytest.raises(ValueError, match="unknown"):
        VerifierError("other", "x")


# --- running ----------------------------------------------------------------------------------


def test_run_returns_a_float(module: str) -> None:
    assert run_verifier(loaded(module, "good"), PROMPT, SAMPLE) == 0.75
    result = run_verifier(loaded(module, "one"), PROMPT, SAMPLE)
    assert result == 1.0 and type(result) is float


@pytest.mark.parametrize(
    ("function", "cause"),
    [
        ("raises", "exception"),
        ("nan", "non_numeric"),
        ("boolean", "non_numeric"),
        ("text", "non_numeric"),
        ("nothing", "non_numeric"),
        ("inf", "out_of_range"),
        ("too_high", "out_of_range"),
        ("negative", "out_of_range"),
    ],
)
def test_bad_results_raise_with_a_cause(module: str, function: str, cause: str) -> None:
    with pytest.raises(VerifierError) as info:
        run_verifier(loaded(module, function), PROMPT, SAMPLE)
    assert info.value.cause == cause
    assert function in str(info.value)


def test_the_exception_is_chained(module: str) -> None:
    with pytest.raises(VerifierError) as info:
        run_verifier(loaded(module, "raises"), PROMPT, SAMPLE)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_verifier_cannot_change_the_callers_data(module: str) -> None:
    prompt = [dict(message) for message in PROMPT]
    sample = dict(SAMPLE)
    assert run_verifier(loaded(module, "mutates"), prompt, sample) == 0.5
    assert prompt == PROMPT and sample == SAMPLE


# --- combining --------------------------------------------------------------------------------


def test_combine_mixed_is_the_weighted_sum() -> None:
    mixed = combine([1.0, 0.5, 0.0], [0.0, 0.5, 1.0], ruler_weight=0.25)
    assert mixed == pytest.approx([0.25, 0.5, 0.75])


def test_combine_weight_extremes() -> None:
    assert combine([0.9, 0.1], [0.2, 0.3], ruler_weight=1.0) == pytest.approx([0.9, 0.1])
    assert combine([0.9, 0.1], [0.2, 0.3], ruler_weight=0.0) == pytest.approx([0.2, 0.3])


def test_combine_with_one_side_returns_a_copy_of_the_other() -> None:
    ruler_scores = [0.3, 0.7]
    only_ruler = combine(ruler_scores, None, ruler_weight=0.5)
    assert only_ruler == ruler_scores and only_ruler is not ruler_scores
    assert combine(None, [0.0, 1.0], ruler_weight=0.5) == [0.0, 1.0]


def test_combine_refuses_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="both"):
        combine(None, None, ruler_weight=0.5)
    with pytest.raises(ValueError, match="2 RULER scores but 3"):
        combine([0.1, 0.2], [0.1, 0.2, 0.3], ruler_weight=0.5)
    with pytest.raises(ValueError, match="ruler_weight"):
        combine([0.1], [0.2], ruler_weight=1.5)


# --- the example verifier ---------------------------------------------------------------------

EXPECTED = '{"name": "Ada Lovelace", "year": 1843, "active": true}'


def extraction_prompt(expected: str = EXPECTED) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Extract the fields as one JSON object."},
        {"role": "user", "content": 'Earlier question.\nEXPECTED: {"name": "nobody"}'},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": f"Ada Lovelace published her notes in 1843.\nEXPECTED: {expected}",
        },
    ]


def answer(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def score(content: Any, expected: str = EXPECTED) -> float:
    return exact_json_fields(extraction_prompt(expected), answer(content))


def test_a_perfect_answer_scores_one() -> None:
    assert score('{"name": "Ada Lovelace", "year": 1843, "active": true}') == 1.0


def test_partial_answers_score_their_share() -> None:
    assert score('{"name": "Ada Lovelace", "year": 1842, "active": true}') == pytest.approx(2 / 3)
    assert score('{"name": "Ada"}') == 0.0
    assert score('{"year": 1843}') == pytest.approx(1 / 3)


def test_extra_keys_cost_nothing() -> None:
    assert score('{"name": "Ada Lovelace", "year": 1843, "active": true, "born": 1815}') == 1.0


def test_values_must_match_exactly() -> None:
    # A string is not a number, and JSON's true is not 1; but 1843.0 is the number 1843.
    assert score('{"name": "Ada Lovelace", "year": "1843", "active": 1}') == pytest.approx(1 / 3)
    assert score('{"name": "Ada Lovelace", "year": 1843.0, "active": true}') == 1.0


def test_nested_values_compare_whole() -> None:
    expected = '{"tags": ["math", "poetry"], "meta": {"lang": "en", "flag": false}}'
    assert (
        score('{"tags": ["math", "poetry"], "meta": {"flag": false, "lang": "en"}}', expected)
        == 1.0
    )
    assert score('{"tags": ["poetry", "math"], "meta": {"lang": "en", "flag": 0}}', expected) == 0.0


@pytest.mark.parametrize(
    "content",
    [
        '```json\n{"name": "Ada Lovelace", "year": 1843, "active": true}\n```',
        '```\n{"name": "Ada Lovelace", "year": 1843, "active": true}\n```',
        [{"type": "text", "text": '{"name": "Ada Lovelace", "year": 1843, "active": true}'}],
    ],
)
def test_fences_and_content_parts_are_tolerated(content: Any) -> None:
    assert score(content) == 1.0


@pytest.mark.parametrize(
    "content",
    [
        "Ada Lovelace, 1843",
        'Sure! {"name": "Ada Lovelace", "year": 1843, "active": true}',
        '["Ada Lovelace", 1843, true]',
        "",
        None,
    ],
)
def test_unparsable_answers_score_zero(content: Any) -> None:
    assert score(content) == 0.0


def test_the_last_expected_line_of_the_last_user_message_wins() -> None:
    prompt = extraction_prompt()
    prompt[-1]["content"] += '\nEXPECTED: {"name": "Charles Babbage"}'
    assert exact_json_fields(prompt, answer('{"name": "Charles Babbage"}')) == 1.0
    assert exact_json_fields(prompt, answer('{"name": "nobody"}')) == 0.0


@pytest.mark.parametrize(
    "prompt",
    [
        [{"role": "system", "content": 'EXPECTED: {"a": 1}'}],
        [{"role": "user", "content": "no expectation here"}],
        [{"role": "user", "content": "EXPECTED: not json"}],
        [{"role": "user", "content": "EXPECTED: {}"}],
        [{"role": "user", "content": "EXPECTED: [1, 2]"}],
    ],
)
def test_a_broken_task_raises_rather_than_scoring(prompt: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="exact_json_fields"):
        exact_json_fields(prompt, answer('{"a": 1}'))
    with pytest.raises(VerifierError) as info:
        run_verifier(exact_json_fields, prompt, answer('{"a": 1}'))
    assert info.value.cause == "exception"

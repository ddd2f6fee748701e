"""The bundled demo task: a seed-fixed prompt set with no answer in it, and its verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from ratchet.rewards.verifiers import load_verifier, run_verifier
from tasks import demo

PROMPTS = demo.load_prompts()


def test_shipped_prompt_file_is_what_the_script_generates() -> None:
    text = (resources.files("tasks.demo") / demo.PROMPTS_FILE).read_text(encoding="utf-8")
    assert text == demo.prompts_jsonl()
    assert demo.generate_prompts(5, seed=1) == demo.generate_prompts(5, seed=1)
    assert demo.generate_prompts(5, seed=1) != demo.generate_prompts(5, seed=2)


def test_prompts_are_distinct_and_never_contain_the_answer_as_json() -> None:
    users = [p["messages"][-1]["content"] for p in PROMPTS]
    assert len(set(users)) == len(users) == demo.DEFAULT_COUNT
    for prompt in PROMPTS:
        text = json.dumps(prompt["messages"])
        assert json.dumps(prompt["expected"]) not in text
        assert "EXPECTED" not in text


def test_the_verifier_recovers_the_ground_truth_from_the_message() -> None:
    for prompt in PROMPTS[:50]:
        assert demo.expected_fields(prompt["messages"]) == prompt["expected"]


def answer(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def test_reward_grades_fields_and_format() -> None:
    prompt = next(p for p in PROMPTS if len(p["expected"]) == 4)
    messages, expected = prompt["messages"], prompt["expected"]
    exact = json.dumps(expected)
    assert demo.extraction_reward(messages, answer(exact)) == pytest.approx(1.0)
    assert demo.extraction_reward(messages, answer(f"```json\n{exact}\n```")) == pytest.approx(1.0)
    # Prose around the object: every field right, but no format credit.
    assert demo.extraction_reward(messages, answer(f"Here it is: {exact} Bye.")) == pytest.approx(
        1 - demo.FORMAT_WEIGHT
    )
    half = dict(expected, quantity=str(expected["quantity"]), city="Nowhere")
    assert demo.extraction_reward(messages, answer(json.dumps(half))) == pytest.approx(
        (1 - demo.FORMAT_WEIGHT) * 2 / 4 + demo.FORMAT_WEIGHT
    )
    shouted = {k: v.upper() if isinstance(v, str) else v for k, v in expected.items()}
    assert demo.extraction_reward(messages, answer(json.dumps(shouted))) == pytest.approx(1.0)
    assert demo.extraction_reward(messages, answer("Sorry, I cannot help.")) == 0.0
    assert demo.extraction_reward(messages, answer("[1, 2]")) == 0.0
    assert demo.extraction_reward(messages, {"role": "assistant", "content": None}) == 0.0


def test_a_prompt_the_generator_did_not_write_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a demo prompt"):
        demo.extraction_reward([{"role": "user", "content": "hello"}], answer("{}"))


def test_a_perfect_answer_scores_exactly_one_on_every_shipped_prompt() -> None:
    # 0.8 * (3 / 3) + 0.2 is 1.0000000000000002 in floats: a verifier must never return that
    verifier = load_verifier("tasks.demo:extraction_reward")
    for prompt in PROMPTS:
        perfect = answer(json.dumps(prompt["expected"]))
        assert run_verifier(verifier, prompt["messages"], perfect) == 1.0


def test_partial_credit_is_the_share_of_fields_right() -> None:
    prompt = next(p for p in PROMPTS if len(p["expected"]) == 3)
    messages, expected = prompt["messages"], prompt["expected"]
    one_wrong = dict(expected, **{next(iter(expected)): "Nowhere"})
    share = (1 - demo.FORMAT_WEIGHT) * 2 / 3 + demo.FORMAT_WEIGHT
    assert demo.extraction_reward(messages, answer(json.dumps(one_wrong))) == pytest.approx(share)
    extra = dict(expected, note="anything")  # extra keys cost nothing
    assert demo.extraction_reward(messages, answer(json.dumps(extra))) == 1.0


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": "Say hi."}],
        [{"role": "user", "content": "Extract things.\n\nMessage: Hi, Maria Lopez here."}],
        # a customer text the generator writes, under an instruction it does not write
        [{"role": "user", "content": "Translate.\n\nMessage: Please ship 2 red mugs to Oslo."}],
        [{"role": "system", "content": PROMPTS[0]["messages"][-1]["content"]}],
        [{"role": "user", "content": [{"type": "text", "text": "Message: Hi"}]}],
    ],
)
def test_any_prompt_the_generator_did_not_write_raises(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="extraction_reward"):
        demo.extraction_reward(messages, answer("{}"))


def test_the_script_rewrites_the_shipped_file_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    script = Path(__file__).resolve().parents[3] / "scripts" / "make_demo_prompts.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(out)], check=True, capture_output=True
    )
    shipped = resources.files("tasks.demo") / demo.PROMPTS_FILE
    assert out.read_text(encoding="utf-8") == shipped.read_text(encoding="utf-8")

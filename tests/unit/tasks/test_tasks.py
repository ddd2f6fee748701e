"""The bundled tasks: seeded prompt sets with no answer in them, verifiers that recover the ground
truth from the prompt, grade partial answers in between, and never raise on any reply text."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

import pytest

from ratchet.rewards.verifiers import run_verifier, tool_calls_of
from tasks import TASKS, Task, bullets, get_task, sorting, tool_use, triage
from tasks.common import lcs_share


def answer(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


@pytest.mark.parametrize("task", TASKS.values(), ids=list(TASKS))
def test_every_task_has_at_least_400_distinct_prompts_and_a_loadable_verifier(task: Task) -> None:
    prompts = task.load_prompts()
    users = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(users)) == len(users) >= 400
    assert task.load_prompts() == prompts  # a fixed order, the same every load
    assert task.name == task.name.lower() and " " not in task.name  # usable as an alias
    assert task.reward() is not None and task.description


@pytest.mark.parametrize("task", TASKS.values(), ids=list(TASKS))
def test_verifiers_never_raise_on_arbitrary_replies(task: Task) -> None:
    """Garbage, huge, empty or non-string replies: a reward in [0, 1] through the judge's own
    runner (which raises VerifierError on an exception or an out-of-range value)."""
    rng = random.Random(7)
    junk: list[Any] = [
        "",
        None,
        42,
        ["- a"],
        "{",
        "9" * 5000,
        "- " * 3000,
        "\n".join("- x" for _ in range(2000)),
        "1, 2, 3," * 500,
        "```json\n{}\n```",
    ]
    junk += ["".join(rng.choices(string.printable, k=rng.randint(1, 300))) for _ in range(200)]
    for prompt in task.load_prompts()[:5]:
        for content in junk:
            assert 0.0 <= run_verifier(task.reward(), prompt["messages"], answer(content)) <= 1.0


def test_get_task_names_the_known_tasks() -> None:
    assert get_task("sorting") is TASKS["sorting"]
    with pytest.raises(KeyError, match="bullets"):
        get_task("nope")
    assert TASKS["demo"].verifier == "tasks.demo:extraction_reward"


@pytest.mark.parametrize("module", [sorting, bullets, triage])
def test_generators_are_seeded_and_the_answer_is_not_in_the_prompt(module: Any) -> None:
    assert module.generate_prompts(5, seed=1) == module.generate_prompts(5, seed=1)
    assert module.generate_prompts(5, seed=1) != module.generate_prompts(5, seed=2)
    for prompt in module.load_prompts():
        text = prompt["messages"][-1]["content"]
        if module is sorting:
            assert ", ".join(map(str, prompt["expected"])) not in text  # never given sorted
        elif module is triage:  # the message never names a team; the instruction names all
            message = text.split(triage.MARKER)[1].lower()
            assert not set(re.findall(r"[a-z]+", message)) & set(triage.TEAMS)
        else:
            assert "\n- " not in text  # never given as the list


@pytest.mark.parametrize("module", [sorting, bullets, triage], ids=["sorting", "bullets", "triage"])
def test_a_prompt_the_task_did_not_write_is_a_broken_setup_not_a_bad_answer(module: Any) -> None:
    reward = getattr(module, f"{module.__name__.rsplit('.', 1)[1]}_reward")
    mine = module.load_prompts()[0]["messages"][0]["content"]
    # A prompt of this task's shape whose data it did not write.
    edited = (
        mine + " and 7" if module is not triage else mine.split("Message: ")[0] + "Message: Hi."
    )
    for messages in (
        [],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": "Sort these: 3, 1"}],
        [{"role": "user", "content": edited}],
    ):
        with pytest.raises(ValueError):
            reward(messages, answer("1, 3"))


def test_lcs_share() -> None:
    assert lcs_share([1, 2, 3], [1, 2, 3]) == 1.0
    assert lcs_share([], [1]) == lcs_share([1], []) == 0.0
    assert lcs_share([2, 1, 3], [1, 2, 3]) == pytest.approx(2 / 3)
    assert lcs_share([1, 2, 3, 4], [1, 2, 3]) == pytest.approx(3 / 4)  # an extra one costs too


# --- sorting ---------------------------------------------------------------------------------


def test_sorting_reward_grades_order_and_format() -> None:
    prompt = next(p for p in sorting.load_prompts() if len(p["expected"]) == 5)
    messages, want = prompt["messages"], prompt["expected"]
    assert sorting.expected_order(messages) == want
    listed = ", ".join(map(str, want))
    reward = sorting.sorting_reward
    assert reward(messages, answer(listed)) == pytest.approx(1.0)
    assert reward(messages, answer(listed.replace(", ", ",") + ".")) == pytest.approx(1.0)
    # Right, but with prose around it: no format credit.
    assert reward(messages, answer(f"Sorted: {listed}")) == pytest.approx(0.8)
    # Two neighbours swapped: 4 of 5 in order.
    swapped = [want[1], want[0], *want[2:]]
    assert reward(messages, answer(", ".join(map(str, swapped)))) == pytest.approx(
        0.8 * 4 / 5 + 0.2
    )
    # The numbers as the prompt gave them (not sorted: the generator never writes sorted lists).
    given = messages[0]["content"].rpartition("Numbers: ")[2]
    assert 0.0 < reward(messages, answer(given)) < 1.0
    assert reward(messages, answer("I cannot sort numbers.")) == 0.0
    assert reward(messages, answer(", ".join(map(str, reversed(want))))) < 0.5


def test_sorting_parts_are_the_order_share_and_the_format_the_reward_weighs() -> None:
    prompt = next(p for p in sorting.load_prompts() if len(p["expected"]) == 5)
    messages, want = prompt["messages"], prompt["expected"]
    swapped = ", ".join(map(str, [want[1], want[0], *want[2:]]))
    assert sorting.sorting_parts(messages, answer(swapped)) == (pytest.approx(4 / 5), True)
    assert sorting.sorting_parts(messages, answer(f"The numbers are {swapped}")) == (
        pytest.approx(4 / 5),
        False,
    )
    assert sorting.sorting_parts(messages, answer("no numbers")) == (0.0, False)


# --- bullets ---------------------------------------------------------------------------------


def test_bullets_reward_grades_items_dashes_and_nothing_else() -> None:
    prompt = next(p for p in bullets.load_prompts() if len(p["expected"]) == 4)
    messages, want = prompt["messages"], prompt["expected"]
    assert bullets.expected_items(messages) == want
    reward = bullets.bullets_reward
    dashed = "\n".join(f"- {i}" for i in want)
    assert reward(messages, answer(dashed)) == pytest.approx(1.0)
    # Case and a closing full stop do not matter; blank lines neither.
    loose = "\n\n".join(f"- {i.capitalize()}." for i in want)
    assert reward(messages, answer(loose)) == pytest.approx(1.0)
    # Another marker: the items count, the asked-for dash does not.
    assert reward(messages, answer(dashed.replace("- ", "* "))) == pytest.approx(0.8)
    assert reward(messages, answer(dashed.replace("- ", "1. "))) == pytest.approx(0.8)
    # A line of prose before the list.
    assert reward(messages, answer("Here is the list:\n" + dashed)) == pytest.approx(0.8)
    # One item missing: 3 of 4.
    assert reward(messages, answer("\n".join(f"- {i}" for i in want[:3]))) == pytest.approx(
        0.6 * 3 / 4 + 0.4
    )
    # The sentence copied, or the items as JSON: every item named in order, but no list line.
    sentence = messages[0]["content"].rpartition("Text: ")[2]
    assert reward(messages, answer(sentence)) == pytest.approx(bullets.ANYWHERE_WEIGHT)
    assert reward(messages, answer(json.dumps(want))) == pytest.approx(bullets.ANYWHERE_WEIGHT)
    # Named out of order: half of the items in order.
    scrambled = ", ".join([want[1], want[0], want[3], want[2]])
    assert reward(messages, answer(scrambled)) == pytest.approx(bullets.ANYWHERE_WEIGHT / 2)
    # A list, but of other things: only the shape earns.
    assert reward(messages, answer("- apples\n- pears")) == pytest.approx(0.4)
    assert reward(messages, answer("I do not know.")) == 0.0


# --- tool use --------------------------------------------------------------------------------


def called(name: str, arguments: Any) -> dict[str, Any]:
    """An assistant message as vLLM's tool parser leaves it: ``arguments`` as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": text}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_tool_calls_of_parses_arguments_and_tolerates_what_models_write() -> None:
    assert tool_calls_of(called("f", {"a": 1})) == [("f", {"a": 1})]
    assert tool_calls_of(called("f", '{"a": ')) == [("f", None)]  # broken JSON
    assert tool_calls_of(called("f", "[1, 2]")) == [("f", None)]  # not an object
    assert tool_calls_of(called("f", "x" * 70_000)) == [("f", None)]  # too long to parse
    assert tool_calls_of(answer("text")) == []
    assert tool_calls_of({"tool_calls": [None, {"function": {"name": 3}}, "x"]}) == []


def test_tool_use_reward_grades_calling_the_tool_and_its_arguments() -> None:
    prompts = {p["expected"]["name"]: p for p in tool_use.load_prompts()}
    assert set(prompts) == {"get_weather", "convert_currency", "set_timer"}
    for prompt in prompts.values():
        assert prompt["tools"] == tool_use.TOOLS
        assert json.dumps(prompt["expected"]["arguments"]) not in prompt["messages"][-1]["content"]
    weather = prompts["get_weather"]
    messages, want = weather["messages"], weather["expected"]["arguments"]
    reward = tool_use.tool_use_reward
    assert reward(messages, called("get_weather", want)) == 1.0
    shouting = {k: v.upper() for k, v in want.items()}  # a city in any case is the city
    assert reward(messages, called("get_weather", shouting)) == 1.0
    assert reward(messages, called("get_weather", {**want, "day": "never"})) == pytest.approx(0.75)
    assert reward(messages, called("get_weather", "{broken")) == pytest.approx(0.5)
    assert reward(messages, called("set_timer", {"minutes": 5})) == pytest.approx(0.2)
    assert reward(messages, answer("<tool_call>get_weather(...)")) == pytest.approx(0.1)
    assert reward(messages, answer("It will rain.")) == 0.0
    timer = prompts["set_timer"]
    minutes = timer["expected"]["arguments"]["minutes"]
    for given in (minutes, str(minutes), float(minutes)):  # a number as a number or its digits
        assert reward(timer["messages"], called("set_timer", {"minutes": given})) == 1.0
    assert reward(timer["messages"], called("set_timer", {"minutes": True})) < 1.0


def test_a_tool_use_prompt_the_task_did_not_write_is_refused() -> None:
    mine = tool_use.load_prompts()[0]["messages"][0]["content"]
    for content in (
        "What is the weather?",
        mine + " Also in Rome.",
        mine.split("\n")[0] + "\n\n" + "x" * 300,
    ):
        with pytest.raises(ValueError):
            tool_use.tool_use_reward([{"role": "user", "content": content}], answer("x"))


# --- triage ----------------------------------------------------------------------------------


def test_triage_prompts_cover_every_team_evenly_and_the_verifier_finds_each() -> None:
    prompts = triage.load_prompts()
    counts = {team: sum(p["expected"] == team for p in prompts) for team in triage.TEAMS}
    assert set(counts.values()) == {len(prompts) // len(triage.TEAMS)}
    for prompt in prompts:
        assert triage.expected_team(prompt["messages"]) == prompt["expected"]
    phrasings = [p for problems in triage.PROBLEMS.values() for p in problems]
    assert len(set(phrasings)) == len(phrasings)
    assert not any(a in b for a in phrasings for b in phrasings if a != b)  # one team a message


def test_triage_reward_grades_the_name_alone_above_the_name_in_words() -> None:
    prompt = next(p for p in triage.load_prompts() if p["expected"] == "shipping")
    messages = prompt["messages"]

    def reward(content: Any) -> float:
        return run_verifier(triage.triage_reward, messages, answer(content))

    for alone in ("shipping", "Shipping", " SHIPPING.", '"shipping"', "shipping\n"):
        assert reward(alone) == triage.ALONE, alone
    assert reward("The shipping team should handle this.") == triage.WITH_TEXT
    assert reward("Team: shipping") == triage.WITH_TEXT
    for wrong in ("billing", "shipping or returns", "returns, not shipping", "", None, "ship"):
        assert reward(wrong) == 0.0, wrong

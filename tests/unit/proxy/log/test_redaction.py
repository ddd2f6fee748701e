"""proxy/log/redaction.py: the deadline checked at every match, a bound on matches per string,
and every identifier a client chooses redacted like its text."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from proxy.log.exchange import Exchange
from proxy.log.redaction import MAX_MATCHES, REDACTED, Redactor, TooManyForInline

SHIPPED = r"[\p{L}\p{N}_.+-]+@[\p{L}\p{N}_-]+\.[\p{L}\p{N}_.]+"  # embedded/ratchet.yaml
MATCHES = "a@a." * (1 << 20)  # 4 MiB; about half a million matches of the shipped pattern


class Clock:
    """time.monotonic for the redactor: counts its readings, and moves past the deadline once
    ``ticks`` of them were taken."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return 0.0 if self.readings <= self.ticks else 99.0


def test_the_deadline_is_checked_at_every_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit N-6: a string made of matches ran to its end (5-11 s for 4 MiB of ``a@a.``) since
    the clock was read only between strings. Now it is read before each match: the deadline
    passing mid-string stops it there, and the string is replaced whole."""
    clock = Clock(ticks=50)
    monkeypatch.setattr("proxy.log.redaction.time.monotonic", clock)
    redaction = Redactor([SHIPPED], budget_s=1.0, max_matches=10**9).begin()
    out = redaction.part("request", {"content": MATCHES, "after": "ann@example.com"})
    assert out == {"content": REDACTED, REDACTED: REDACTED}  # the key after it too
    assert redaction.over_budget and redaction.failed == ["request"]
    assert clock.readings < 60  # it stopped at the match after the deadline, not at the end


def test_a_string_of_matches_takes_no_more_than_the_budget() -> None:
    """The same 4 MiB on the real clock: about the budget, not the seconds its matches cost."""
    redaction = Redactor([SHIPPED], budget_s=0.05, max_matches=10**9).begin()
    began = time.monotonic()
    assert redaction.string(MATCHES) == REDACTED
    assert time.monotonic() - began < 1.0 and redaction.over_budget


def test_past_max_matches_a_string_is_replaced_whole() -> None:
    """A bounded number of matches per string: at most MAX_MATCHES are replaced one by one, a
    string with more is replaced whole and its part named (not what the model saw)."""
    redaction = Redactor([SHIPPED]).begin()
    at_most = " ".join(["ann@example.com"] * MAX_MATCHES)
    assert redaction.part("request", at_most) == " ".join([REDACTED] * MAX_MATCHES)
    assert redaction.failed == []
    past = at_most + " bob@example.com"
    assert redaction.part("answer", past) == REDACTED
    assert redaction.failed == ["answer"] and redaction.too_many_matches
    assert not redaction.over_budget  # the next strings are still redacted, not replaced
    assert redaction.string("to ann@example.com") == f"to {REDACTED}"


def test_an_inline_redaction_gives_up_past_its_matches_for_the_caller_to_redo() -> None:
    """``inline_matches``: redacted in full while within it; one match more raises, so the
    event loop never pays for a string of many matches (the Responses store then redacts off
    it)."""
    within = " ".join(["ann@example.com"] * 3)
    redaction = Redactor([SHIPPED]).begin(inline_matches=3)
    assert redaction([within]) == [" ".join([REDACTED] * 3)]
    with pytest.raises(TooManyForInline):
        Redactor([SHIPPED]).begin(inline_matches=3)({"a": within, "b": "bob@example.com"})


def exchange(**overrides: Any) -> Exchange:
    fields: dict[str, Any] = dict(
        request_id="req-42",
        endpoint="chat.completions",
        alias="support",
        served_name="support",
        version=0,
        canary_arm="active",
        request={"model": "support", "messages": [{"role": "user", "content": "hi"}]},
        stream=False,
        api_key_hash=None,
        redactor=Redactor([SHIPPED]),
        status=200,
    )
    fields.update(overrides)
    return Exchange(**fields)


def test_identifiers_a_client_chooses_are_redacted() -> None:
    """Audit N-5: the x-request-id header and the answer's id (vLLM builds it from the body's
    ``request_id``) were logged as sent; both name a Redis key, the console and the export."""
    answer = {
        "id": "chatcmpl-alice@example.com",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    }
    record = exchange(
        client_request_id="bob@example.com-7", response_body=orjson.dumps(answer)
    ).to_record()
    assert record.client_request_id == f"{REDACTED}-7"
    assert record.response_id == REDACTED  # the shipped pattern takes "chatcmpl-alice" in too
    assert b"example.com" not in record.to_json()
    assert record.truncated == []  # redacted, not replaced: the exchange is still learned from


def test_a_redacted_request_id_still_fits_its_field() -> None:
    """Each match grows to REDACTED; the id is cut back to the record's 128 characters."""
    many = "a@b.c" * 25  # 125 characters, 25 matches
    record = exchange(client_request_id=" ".join(many[i : i + 5] for i in range(0, 125, 5)))
    assert len(record.to_record().client_request_id or "") == 128


# Patterns whose matches depend on where a string starts and ends, or on its whole text.
ANCHORED = [r"^sk-[a-z0-9]+$", r"^secret", r"token$", r"\bpin\b", r"[^\s@]+@[^\s@]+\.[a-z]+"]
VALUES: list[Any] = [
    {"model": "m", "messages": [{"role": "user", "content": "sk-abc123"}]},  # whole string
    {"a": "secret plan", "b": "no"},  # at a string's start, not the text's
    ["first", "my token"],  # at a string's end, not the text's
    {"pin": 1, "x": "the pin is"},  # a key, word-bounded
    {"messages": [{"content": "mail ann@example.com"}]},
    {"messages": [{"content": "nothing here"}], "n": 1, "stop": ["x"]},
    "a lone sk-abc",
]


@pytest.mark.parametrize("pattern", ANCHORED)
def test_the_screen_redacts_what_string_by_string_redaction_does(pattern: str) -> None:
    """A value is searched once, its strings joined, before it is redacted string by string;
    a match that needs a string's own start or end (^, $, \\b) is still found there, so the
    screen never lets a value through that the patterns match in."""
    screened = Redactor([pattern])
    assert screened.screen is not None
    unscreened = Redactor([pattern])
    unscreened.screen = None
    for value in VALUES:
        assert screened.begin()(value) == unscreened.begin()(value)


def test_a_pattern_the_joining_could_hide_turns_the_screen_off() -> None:
    """Text-start/-end anchors and a flag turned off could miss in the joined strings what
    they match in one: such patterns are redacted string by string."""
    for pattern in (r"\Asecret", r"secret\z", r"(?-m:^secret)", r"(?i-m)^secret"):
        redactor = Redactor([SHIPPED, pattern])
        assert redactor.screen is None
        assert redactor.begin()(["x", "secret"]) == ["x", REDACTED]

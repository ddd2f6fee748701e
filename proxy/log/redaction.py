"""Redaction: every string a record carries, with its matches of ``proxy.redact_patterns``
replaced, in bounded time.

Used by the log worker on each traffic and feedback record (proxy/log/worker.py) and by the
Responses store on what it keeps (proxy/response_store.py). :class:`Redactor` is the public name:
``Redactor(patterns, budget_s).begin()`` gives one record's :class:`Redaction`, which is called on
each of its parts.

Time. The patterns are one RE2 regex, linear in the text whatever the pattern (Python's re
backtracks: one long token froze the log worker for hours, audit C-1). But RE2's Python binding
costs about 10 µs per *match*, so a string made of matches (4 MiB of ``a@a.``: a million of them)
still took 5-11 s (audit N-6). So matches are replaced one at a time here, and before each the
record's deadline is checked and the string's matches counted: past the deadline, or past
:data:`MAX_MATCHES` in one string, the string is replaced whole by ``REDACTED``. A record then
costs at most its budget plus one match, whatever its strings hold.

Screening. That binding also costs several µs per *call*, match or not, and a record holds tens
of strings (ids, roles, the prompt, the answer): most records match nowhere. So a value is first
searched once, its strings (dict keys too) joined by newlines, with the patterns in multiline
mode (``^``/``$`` then match at each string's ends as they do alone); only a value with a match
somewhere is redacted string by string, and so is one whose record is past its budget (below).
A pattern that the joining could hide a match of (``\\A``, ``\\z``, a flag group turning a
flag off) disables the screen.

Failing closed. A string replaced whole is never logged as it came; the part it belongs to is
named in :attr:`Redaction.failed`, which the record carries as ``truncated`` (not what the model
saw: nobody learns from it).
"""

from __future__ import annotations

import re
import time
from typing import Any

from ratchet.settings import ProxySettings, redaction_regex

REDACTED = "[REDACTED]"
DEFAULT_BUDGET_S: float = ProxySettings.model_fields["redact_budget_s"].default
# Matches replaced in one string before the rest of it is given up on and the string replaced
# whole: ~10 ms of RE2 at ~10 µs a match. Real text holds a few addresses or keys; a string of
# thousands is an attack on the worker's time, or a dump nobody should learn from.
MAX_MATCHES = 1000
# Redacted dict keys kept for the next records: a client sending new keys fills it, then no more.
MAX_KEPT_KEYS = 4096
MAX_KEPT_KEY = 64


# What a pattern holds that a match of it in one string could need and lose once the strings are
# joined: text-start and text-end anchors (multiline mode keeps ^ and $), and flag groups that
# turn a flag (such as m) off. Over-broad on purpose (an escaped backslash before A): a pattern
# it flags is only redacted without the screen.
_UNSCREENABLE = re.compile(r"\\[Az]|\(\?[A-Za-z]*-")


def screen_regex(patterns: list[str]) -> Any:
    """``patterns`` as one multiline RE2 regex that finds, in a value's strings joined by
    newlines, a match wherever one of them alone has one; None where a pattern may not."""
    if not patterns or any(_UNSCREENABLE.search(p) for p in patterns):
        return None
    return redaction_regex(["(?m)" + "|".join(f"(?:{p})" for p in patterns)])


def _strings(value: Any, out: list[str]) -> None:
    """Append every string of ``value`` (dict keys included) to ``out``."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _strings(item, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                out.append(key)
            _strings(item, out)


class TooManyForInline(Exception):
    """A redaction begun with ``inline_matches`` met more matches than that: the caller redacts
    the value again off the event loop (:meth:`Redactor.begin`)."""


class Redactor:
    """The configured patterns, as one RE2 regex, and the time one record may take.

    Each record gets a :class:`Redaction` with its own deadline, ``budget_s`` from its start.
    Strings are redacted whole and only then cut to fit (``bounded``): a cut first could split a
    secret so that no pattern matches what is left of it.
    """

    def __init__(
        self,
        patterns: list[str],
        budget_s: float = DEFAULT_BUDGET_S,
        max_matches: int = MAX_MATCHES,
    ) -> None:
        self.pattern: Any = redaction_regex(patterns) if patterns else None
        self.screen: Any = screen_regex(patterns)  # one search of a whole value first
        self.budget_s = budget_s
        self.max_matches = max_matches
        # Dict keys, redacted: most are the API's own ("role", "content"), in every record.
        self.keys: dict[str, str] = {}

    def begin(self, inline_matches: int | None = None) -> Redaction:
        """The redaction of one record, its deadline starting now. With ``inline_matches``, a
        redaction cheap enough for the event loop or none: past that many matches in all it
        raises :class:`TooManyForInline`."""
        return Redaction(self, time.monotonic() + self.budget_s, inline_matches)

    def __call__(self, value: Any) -> Any:
        """``value`` redacted, on a budget of its own."""
        return self.begin()(value)


class Redaction:
    """One record's redaction: every string it is given, dict keys included, has its matches
    replaced. Past the deadline it fails closed: each string not yet redacted becomes
    ``REDACTED`` whole (never logged as it came), and :meth:`part` names the parts that were;
    so does a string with more than the redactor's ``max_matches``."""

    def __init__(
        self, redactor: Redactor, deadline: float, inline_matches: int | None = None
    ) -> None:
        self.redactor = redactor
        self.deadline = deadline
        self.inline_matches = inline_matches  # the matches left before TooManyForInline
        self.over_budget = False
        self.too_many_matches = False  # some string was replaced whole for its matches
        self.failed: list[str] = []  # parts with strings replaced whole, in the record's words
        self._replaced = False

    def part(self, name: str, value: Any) -> Any:
        """``value`` redacted; ``name`` goes to :attr:`failed` if a string of it was replaced
        whole (the budget ran out in it, or the string held too many matches)."""
        self._replaced = False
        out = self(value)
        if self._replaced and name not in self.failed:
            self.failed.append(name)
        return out

    def __call__(self, value: Any) -> Any:
        """``value`` redacted: itself when no string of it (keys included) has a match."""
        if self.redactor.pattern is None:
            return value
        screen = self.redactor.screen
        if screen is not None and not isinstance(value, str) and not self.over_budget:
            found: list[str] = []
            _strings(value, found)
            # Past the budget once screened, it fails closed as below, not let through.
            if screen.search("\n".join(found)) is None and time.monotonic() <= self.deadline:
                return value
        return self._value(value)

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, list):
            return [self._value(v) for v in value]
        if isinstance(value, dict):
            return {self._key(k): self._value(v) for k, v in value.items()}
        return value

    def _key(self, key: str) -> str:
        keys = self.redactor.keys
        if (known := keys.get(key)) is not None:
            return known
        redacted = self.string(key)
        if not self.over_budget and len(key) <= MAX_KEPT_KEY and len(keys) < MAX_KEPT_KEYS:
            keys[key] = redacted
        return redacted

    def string(self, text: str) -> str:
        """``text`` with each match replaced; ``REDACTED`` whole past the deadline (checked
        before each match) or past the redactor's ``max_matches``."""
        if self.redactor.pattern is None:
            return text
        if not self.over_budget and time.monotonic() > self.deadline:
            self.over_budget = True
        if self.over_budget:
            return self._whole()
        pieces: list[str] = []
        end = 0
        limit = self.redactor.max_matches
        for found, match in enumerate(self.redactor.pattern.finditer(text), 1):
            if time.monotonic() > self.deadline:
                self.over_budget = True
                return self._whole()
            if found > limit:
                self.too_many_matches = True
                return self._whole()
            if self.inline_matches is not None:
                self.inline_matches -= 1
                if self.inline_matches < 0:
                    raise TooManyForInline
            pieces += (text[end : match.start()], REDACTED)
            end = match.end()
        if not pieces:
            return text
        pieces.append(text[end:])
        return "".join(pieces)

    def _whole(self) -> str:
        self._replaced = True
        return REDACTED

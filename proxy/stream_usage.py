"""What vLLM generated for a budgeted stream, as it goes: a stream the client leaves is charged
that, not what the client read (audit N-7).

A stream cut before its usage event used to be charged a token per choice event relayed. But
vLLM merges many tokens into one event when its reader lags, and the proxy reads vLLM only as
fast as the client reads it (1 MiB ahead at most): a client that reads slowly and leaves before
the usage event paid for a few percent of what vLLM generated. So, while token budgets are on,
the proxy asks vLLM for ``stream_options.continuous_usage_stats``: every choice event then
carries the usage so far of its choice (``prompt_tokens``, and ``completion_tokens`` of that
choice: vLLM 0.32's serving_chat and serving_completion). :class:`StreamUsage` keeps the last
count of each choice, and what vLLM generated is the prompt and their sum. When the client
leaves, the relay reads on for up to :data:`DRAIN_S`, unrelayed, for vLLM's newest counts (the
events buffered here and in the socket, then vLLM's merged one), and charges that
(proxy/generation.py).

The client sees the stream it asked for: the per-event usage is taken out of each event again
unless the client asked for ``continuous_usage_stats`` itself. That is done on the bytes, as
vLLM writes them (compact JSON, ``usage`` a flat object of counts and count objects), not by
parsing and re-writing each event, which could change how its numbers are spelled.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# How long a stream the client left is read on, unrelayed, for vLLM's newest counts: the events
# already buffered take microseconds, vLLM's merged event a few milliseconds after the first
# read; the rest of the window is generation that vLLM did, and is charged.
DRAIN_S = 0.5
_USAGE = re.compile(rb',\s*"usage"\s*:\s*\{')
_INDEX = re.compile(rb'"choices"\s*:\s*\[\s*\{\s*"index"\s*:\s*(\d{1,9})')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def ask_continuous_usage(options: dict[str, Any]) -> bool:
    """Ask vLLM for usage in every event (``options`` is the upstream ``stream_options``);
    return whether the client had asked for it itself (and so is shown it)."""
    asked = bool(options.get("continuous_usage_stats")) and bool(options.get("include_usage"))
    options["include_usage"] = options["continuous_usage_stats"] = True
    return asked


def _usage_span(event: bytes) -> tuple[int, int] | None:
    """Where ``,"usage":{...}`` is in an event, or None. A ``"usage"`` key cannot be matched
    inside a JSON string (its quotes would be escaped there), and the object holds only numbers,
    nulls and objects of numbers, so its end is its brace that closes the first one."""
    found = _USAGE.search(event)
    if found is None:
        return None
    depth = 0
    for at in range(found.end() - 1, len(event)):
        byte = event[at]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return found.start(), at + 1
    return None


class StreamUsage:
    """vLLM's counts in a budgeted stream's events, and those events as the client sees them."""

    __slots__ = ("_completion", "_pending", "final", "prompt", "shown")

    def __init__(self, shown: bool) -> None:
        self.shown = shown  # the client asked for continuous usage: events are left whole
        self.prompt = 0
        self._completion: dict[int, int] = {}  # choice index -> its completion tokens so far
        self.final: int | None = None  # total_tokens of the usage-only event, once read
        self._pending = b""  # a torn event, while the stream is read on after the client left

    @property
    def seen(self) -> bool:
        return bool(self._completion) or self.final is not None

    @property
    def generated(self) -> int:
        """What vLLM generated as far as its events tell: its last total, else the prompt and
        each choice's last count."""
        if self.final is not None:
            return self.final
        return self.prompt + sum(self._completion.values())

    def feed(self, events: bytes) -> bytes:
        """Read the counts of whole events; return the events as the client is to see them."""
        if b'"usage"' not in events:
            return events
        parts = events.split(b"\n\n")
        for i, event in enumerate(parts):
            span = _usage_span(event)
            if span is None:
                continue
            usage = self._read(event, span)
            if usage and not self.shown:
                parts[i] = event[: span[0]] + event[span[1] :]
        return b"\n\n".join(parts)

    def read_on(self, chunk: bytes) -> None:
        """Read the counts of a chunk of the stream the client no longer reads."""
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data[-(1 << 20) :]  # one event is never that long: bounded
            return
        self._pending = data[cut + 2 :]
        for event in data[:cut].split(b"\n\n"):
            span = _usage_span(event)
            if span is not None:
                self._read(event, span)

    def _read(self, event: bytes, span: tuple[int, int]) -> bool:
        """Take an event's counts; True for a choice event's (one the client is not shown
        unless it asked), False for the usage-only event or one that does not parse."""
        try:
            usage = orjson.loads(event[event.index(b"{", span[0]) : span[1]])
        except (orjson.JSONDecodeError, ValueError):
            return False
        if not isinstance(usage, dict):
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if _NO_CHOICES.search(event):
            total = usage.get("total_tokens")
            if isinstance(total, int):
                self.final = total
            return False
        index = _INDEX.search(event)
        if index is None or not isinstance(completion, int):
            return False
        if isinstance(prompt, int):
            self.prompt = max(self.prompt, prompt)
        choice = int(index.group(1))
        self._completion[choice] = max(self._completion.get(choice, 0), completion)
        return True

"""A served answer joined with its rating: what the reward model trains on, the canary counts and
the judge's agreement probe re-samples. No numpy here: the proxy and the console read ratings
through ratchet/rewards/agreement.py from the base install."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ratchet.records import ANONYMOUS_CLIENT, answer_as_text


@dataclass(frozen=True)
class RatedAnswer:
    """One served answer joined with its rating."""

    prompt_messages: list[dict[str, Any]]
    answer: str  # the answer's text (empty for a tool call alone)
    score: float
    key: str  # who rated it (API key hash): only the key that got the answer may rate it
    prompt_hash: str
    completion_id: str
    version: int | None = None  # the version that served it (None: joined before it was kept)
    # The client it counts for in the per-client caps (ratchet.records.client_of): the key, or a
    # vouching key's user. None: joined before it was kept; then the key is the client.
    client: str | None = None
    # The answer's tool calls, as the model wrote them (an excerpt, as the text is); None: none.
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def message(self) -> dict[str, Any]:
        """The answer as the assistant message that was served."""
        message: dict[str, Any] = {"role": "assistant", "content": self.answer}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    @property
    def text(self) -> str:
        """What the reward model reads of the answer: its text and its tool calls."""
        return answer_as_text(self.message)

    @property
    def owner(self) -> str:
        """The client whose rating this is, for the caps on one client's share."""
        return self.client or self.key or ANONYMOUS_CLIENT

"""A verifier for the replica test: a stable pseudo-random score of the answer's text. Two sampled
answers almost never score the same (every group carries a GRPO signal however short they are),
and two versions that answer a held-out prompt alike tie in the gate."""

from __future__ import annotations

import hashlib
from typing import Any


def text_hash_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    text = str(sample.get("content") or "")
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

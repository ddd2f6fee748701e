"""The gate's pool of held-out prompts for one alias, and the draw of a round's gate pairs.

The pool keeps up to ``learner.heldout_pool`` distinct prompts. When it is full, the key that
holds the most prompts loses its oldest one: a flood of prompts from one client only ever
replaces that client's own prompts once it holds the most, never everybody else's. Each gate
then draws its pairs at random from the whole pool (seeded per round, so a round can be
replayed), with no key above ``learning.max_key_share`` of them (learner/fair.py).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator

from learner.fair import fair_sample, fair_size
from ratchet.records import HeldoutPrompt


class HeldoutPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._prompts: OrderedDict[str, HeldoutPrompt] = OrderedDict()  # by hash, oldest first
        # Each key's prompt hashes, oldest first: who loses a prompt when the pool is full.
        self._by_key: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def __iter__(self) -> Iterator[str]:
        """The prompt hashes, oldest first."""
        return iter(self._prompts)

    def prompts(self) -> list[HeldoutPrompt]:
        return list(self._prompts.values())

    def add(self, prompt: HeldoutPrompt) -> None:
        """Add (or refresh) a prompt; when full, the largest key's oldest prompt goes."""
        self._remove(prompt.prompt_hash)
        owner = prompt.client
        self._prompts[prompt.prompt_hash] = prompt
        self._by_key.setdefault(owner, OrderedDict())[prompt.prompt_hash] = None
        while len(self._prompts) > self.capacity:
            largest = max(self._by_key.values(), key=len)
            self._remove(next(iter(largest)))

    def _remove(self, prompt_hash: str) -> None:
        prompt = self._prompts.pop(prompt_hash, None)
        if prompt is None:
            return
        owner = prompt.client
        hashes = self._by_key[owner]
        del hashes[prompt_hash]
        if not hashes:
            del self._by_key[owner]

    def pairs_available(self, max_pairs: int, share: float) -> int:
        """How many pairs a gate could draw now under the key-share cap."""
        return fair_size([len(h) for h in self._by_key.values()], max_pairs, share)

    def draw(self, max_pairs: int, share: float, seed: str) -> list[HeldoutPrompt]:
        """A gate's prompts: up to ``max_pairs`` at random from the whole pool, no key above
        its share. The same seed over a pool of the same prompts gives the same draw, in
        whatever order they arrived."""
        rng = random.Random(seed)
        prompts = sorted(self.prompts(), key=lambda p: p.prompt_hash)
        return fair_sample(prompts, lambda p: p.client, max_pairs, share, rng)

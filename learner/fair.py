"""One client's share: no client fills more than ``learning.max_key_share`` of a selection.

A round's groups and a gate's held-out pairs are both chosen here, so a client that floods the
endpoint with crafted prompts steers at most its share of what is trained on and of what judges
the result. A client is an API key, or, for a key in ``proxy.user_vouching_keys``, that key and
one `user` of its app (a record's ``client``, ratchet.records.client_of). Records without a key
hash (auth off) count as one client, :data:`ANONYMOUS`.

With fewer keys than ``1 / share`` the cap rises to an even split among the keys at hand (one
key alone may fill everything): the rule is there to stop one client drowning the others, and
with one client there are no others, while a cap that no selection could meet would stop
learning altogether.

A reward model's training and evaluation sets do not lift the cap (``lift=False``): below
``1 / share`` raters no set can hold the ratings of all of them with each under its share, so
the set is smaller, or empty, and the model is not trained rather than fitted to one or two
raters' taste (the audit's H-4: with 4 raters the lifted cap let one of them own a quarter).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from ratchet.records import ANONYMOUS_CLIENT

T = TypeVar("T")

ANONYMOUS = ANONYMOUS_CLIENT
_EPSILON = 1e-9  # 1/3 * 3 may come out a hair under 1.0


def key_of(api_key_hash: str | None) -> str:
    return api_key_hash or ANONYMOUS


def cap_share(share: float, keys: int, lift: bool = True) -> float:
    """The share one key may fill when ``keys`` keys have items: ``share``, or an even split
    among fewer than ``1 / share`` keys when ``lift``."""
    return max(share, 1.0 / keys) if keys and lift else share


def keys_needed(share: float) -> int:
    """The fewest keys that can fill a selection with none above ``share`` (the cap unlifted)."""
    return math.ceil(1.0 / share - _EPSILON)


def per_key_cap(size: int, share: float) -> int:
    return math.floor(share * size + _EPSILON)


def fair_size(counts: Sequence[int], target: int, share: float, lift: bool = True) -> int:
    """The most items (up to ``target``) a selection can hold with no key above its cap, given
    how many items each key has."""
    effective = cap_share(share, sum(1 for c in counts if c > 0), lift)
    for size in range(min(target, sum(counts)), 0, -1):
        cap = per_key_cap(size, effective)
        if sum(min(c, cap) for c in counts) >= size:
            return size
    return 0


def counts_by_key(items: Sequence[T], key: Callable[[T], str]) -> list[int]:
    return list(Counter(key(item) for item in items).values())


def fair_select(
    items: Sequence[T], key: Callable[[T], str], target: int, share: float, lift: bool = True
) -> tuple[list[T], int]:
    """Take items in the given order, each key up to its cap, as many as :func:`fair_size`
    allows; also return how many were passed over because their key was at its cap."""
    counts = counts_by_key(items, key)
    size = fair_size(counts, target, share, lift)
    cap = per_key_cap(size, cap_share(share, len(counts), lift))
    taken: Counter[str] = Counter()
    chosen: list[T] = []
    passed_over = 0
    for item in items:
        if len(chosen) == size:
            break
        owner = key(item)
        if taken[owner] >= cap:
            passed_over += 1
            continue
        taken[owner] += 1
        chosen.append(item)
    return chosen, passed_over


def fair_sample(
    items: Sequence[T], key: Callable[[T], str], target: int, share: float, rng: random.Random
) -> list[T]:
    """Like :func:`fair_select`, over the items in a random order (drawn from ``rng``)."""
    shuffled = list(items)
    rng.shuffle(shuffled)
    return fair_select(shuffled, key, target, share)[0]

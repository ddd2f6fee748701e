"""Fixed looks, each made once and recorded: the plan the canary's rollback tests over clients
share (upstream failures: learner/canary_errors.py; latency: learner/canary_latency.py).

Look ``j`` is due at the first check with ``n_j = canary.min_clients * 2^j`` clients served on
each arm (the ratings' look sizes, learner/canary_clients.py :func:`look_sizes`, up to
``canary.max_rating_pairs``). It is made on the counts as they stand then, at level
``alpha / 2^(j+1)``, and its outcome is written to the canary's hash
(``<test>_look:v<version>:<j>``, HSETNX: the first replica's look stands); every later check
reads it instead of testing again.

Why made once and recorded. The counter keeps each client's counts, not its requests in order,
so the data a look saw cannot be replayed later; and a bound recomputed at every check is a new
test at every check, whose chance of a false rollback grows with their number. A look made at
a time set by the number of clients served (not by what they measured) and never made again is
one test at its level; the levels add up to at most ``alpha`` (Bonferroni), so over all of a
canary's checks a canary within the test's margin is rolled back by that test with probability
at most ``alpha``, however often the watcher asks. A look due while counts jumped past two sizes
between checks makes both, on the same counts (each at its own level). The price: between looks,
more clients change nothing until the next size (20, 40, 80, ... an arm). The version in the
field's name keeps a late check of a canary already replaced from writing a look into the next
one's counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import redis

from learner.canary_clients import look_sizes
from ratchet.canary_state import canary_key
from ratchet.settings import CanaryConfig


@dataclass(frozen=True)
class RecordedLook:
    """One look of a rollback test, as made (and recorded) once."""

    index: int  # j: made at min_clients * 2^j clients an arm
    clients: int  # clients on each arm when it was made (the fewer)
    canary: float  # the arms' estimates then (a mean failure share, a mean latency)
    active: float
    lower: float  # the one-sided lower bound of the test's statistic at ``alpha``
    alpha: float

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: str | bytes) -> RecordedLook:
        return cls(**json.loads(raw))


# (index, clients an arm, level) -> the look made on the counts as they stand.
MakeLook = Callable[[int, int, float], RecordedLook]


def due_looks(
    served: int, config: CanaryConfig, made: Iterable[int], make: MakeLook
) -> list[RecordedLook]:
    """The looks ``served`` clients an arm call for that are not ``made`` yet, made now."""
    done, looks = set(made), []
    for j, size in enumerate(look_sizes(config)):
        if size > served:
            break
        if j not in done:
            looks.append(make(j, served, config.alpha / 2 ** (j + 1)))
    return looks


def look_field(test: str, version: int, index: int) -> str:
    """The canary hash's field of look ``index`` of ``test`` on the canary of ``version``."""
    return f"{test}_look:v{version}:{index}"


def record_looks(
    client: redis.Redis,
    alias: str,
    version: int,
    test: str,
    config: CanaryConfig,
    due: Callable[[Iterable[int]], list[RecordedLook]],
) -> list[RecordedLook]:
    """The canary's looks of ``test``: those recorded, and those ``due`` now (given the indices
    made) made and recorded (HSETNX: where another replica recorded one first, its look
    stands)."""
    fields = [look_field(test, version, j) for j in range(len(look_sizes(config)))]
    stored = client.hmget(canary_key(alias), fields)
    looks = {j: RecordedLook.decode(raw) for j, raw in enumerate(stored) if raw is not None}
    made = due(looks)
    if made:
        pipe = client.pipeline(transaction=False)
        for look in made:
            pipe.hsetnx(canary_key(alias), fields[look.index], look.encode())
        for look in made:
            pipe.hget(canary_key(alias), fields[look.index])
        for look, raw in zip(made, pipe.execute()[len(made) :], strict=True):
            looks[look.index] = RecordedLook.decode(raw) if raw is not None else look
    return [looks[j] for j in sorted(looks)]

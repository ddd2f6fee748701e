"""The canary's error test over clients: is the candidate's upstream failure rate worse than the
active version's by more than ``canary.max_error_rate_increase``, as its clients (not their
requests) met it?

Each client served on an arm is one unit: its own share of failed requests there,
``min(failed, served) / served`` in [0, 1], however many requests it sends. A client that sends
five requests and provokes one failure moves its arm by its one unit, as a client with a
thousand requests would: no key vetoes a canary by the requests it makes. Only failures that are
the replica's count (learner/canary_counter.py's ``UPSTREAM_FAILURES``); a whole answer cut at
``proxy.upstream_timeout_s`` does not, since a client provokes one with a large ``max_tokens``.
The anonymous client of a stack without API keys is everyone: each of its requests is a unit.

The test: a group-sequential plan whose looks are each made once, recorded in Redis. The arms'
mean shares are compared as the ratings' test compares trimmed means (learner/canary_clients.py's
:class:`Look`, untrimmed here, with the padded error that never reads a zero spread as exact):
look ``j`` is made at the first check with ``n_j = canary.min_clients * 2^j`` clients served on
each arm (the ratings' look sizes, up to ``canary.max_rating_pairs``), on the counts as they
stand then, at level ``alpha / 2^(j+1)``, and rolls back when the one-sided lower bound of
``canary - active`` is above the margin. Its outcome is written to the canary's hash
(``error_look:v<version>:<j>``, HSETNX: the first replica's look stands) and every later check
reads it instead of testing again.

Why made once and recorded. The counter keeps each client's counts, not its requests in order,
so the data a look saw cannot be replayed later; and a bound recomputed at every check is a new
test at every check, whose chance of a false rollback grows with their number. A look made at
a time set by the number of clients served (not by the failures) and never made again is one
test at its level; the levels add up to at most ``alpha`` (Bonferroni), so over all of a
canary's checks a canary whose failures are within the margin is rolled back by this test with
probability at most ``alpha``, however often the watcher asks. A look due while counts jumped
past two sizes between checks makes both, on the same counts (each at its own level). The price:
between looks, more clients change nothing until the next size (20, 40, 80, ... an arm).

With fewer clients served than ``min_clients`` on an arm (a one-key app, after its wait) there
is no test to make, and the point estimate decides: the canary is decided on what it has, and
its reason says so (learner/canary.py).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import redis

from learner.canary_clients import Look, look_sizes
from ratchet.canary_state import canary_key
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.settings import CanaryConfig


def error_shares(per_client: dict[str, tuple[int, int]]) -> list[float]:
    """An arm's units: each client's share of failed requests (anonymous: one unit a request)."""
    shares: list[float] = []
    for client, (served, failed) in per_client.items():
        if served <= 0:
            continue
        failed = min(max(failed, 0), served)
        if client == ANONYMOUS_CLIENT:
            shares.extend([1.0] * failed + [0.0] * (served - failed))
        else:
            shares.append(failed / served)
    return shares


@dataclass(frozen=True)
class ErrorEvidence:
    """Both arms' units (:func:`error_shares`)."""

    active: tuple[float, ...]
    canary: tuple[float, ...]

    @classmethod
    def of(
        cls, active: dict[str, tuple[int, int]], canary: dict[str, tuple[int, int]]
    ) -> ErrorEvidence:
        return cls(tuple(error_shares(active)), tuple(error_shares(canary)))

    def rate(self, arm: str) -> float:
        """An arm's mean share over its clients (0.0: none served)."""
        units = self.canary if arm == "canary" else self.active
        return statistics.fmean(units) if units else 0.0

    def excess(self) -> float:
        return self.rate("canary") - self.rate("active")


@dataclass(frozen=True)
class ErrorLook:
    """One look of the error test, as made (and recorded) once."""

    index: int  # j: made at min_clients * 2^j clients an arm
    clients: int  # clients on each arm when it was made (the fewer)
    canary: float  # the arms' mean failure shares then
    active: float
    lower: float  # the one-sided lower bound of canary - active at ``alpha``
    alpha: float

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: str | bytes) -> ErrorLook:
        return cls(**json.loads(raw))


def due_looks(
    evidence: ErrorEvidence, config: CanaryConfig, made: Iterable[int]
) -> list[ErrorLook]:
    """The looks the clients served now call for that are not ``made`` yet, on these counts."""
    served = min(len(evidence.active), len(evidence.canary))
    done, looks = set(made), []
    for j, size in enumerate(look_sizes(config)):
        if size > served:
            break
        if j in done:
            continue
        alpha = config.alpha / 2 ** (j + 1)
        look = Look.of(list(evidence.active), list(evidence.canary), 0.0, alpha)
        rates = evidence.rate("canary"), evidence.rate("active")
        looks.append(ErrorLook(j, served, *rates, look.lower, alpha))
    return looks


def error_look_field(version: int, index: int) -> str:
    """The canary hash's field of look ``index`` of the canary of ``version``: a late check of
    a canary already replaced writes no look into the next one's counts."""
    return f"error_look:v{version}:{index}"


def recorded_looks(
    client: redis.Redis, alias: str, version: int, evidence: ErrorEvidence, config: CanaryConfig
) -> list[ErrorLook]:
    """The canary's error looks: those recorded, and those due now made on ``evidence`` and
    recorded (HSETNX: where another replica recorded one first, its look stands)."""
    fields = [error_look_field(version, j) for j in range(len(look_sizes(config)))]
    stored = client.hmget(canary_key(alias), fields)
    looks = {j: ErrorLook.decode(raw) for j, raw in enumerate(stored) if raw is not None}
    due = due_looks(evidence, config, looks)
    if due:
        pipe = client.pipeline(transaction=False)
        for look in due:
            pipe.hsetnx(canary_key(alias), fields[look.index], look.encode())
        for look in due:
            pipe.hget(canary_key(alias), fields[look.index])
        for look, raw in zip(due, pipe.execute()[len(due) :], strict=True):
            looks[look.index] = ErrorLook.decode(raw) if raw is not None else look
    return [looks[j] for j in sorted(looks)]


def error_rollback(
    evidence: ErrorEvidence,
    config: CanaryConfig,
    few: bool,
    looks: Iterable[ErrorLook] | None = None,
) -> str | None:
    """Why the canary's failures roll it back, or None. ``few``: fewer clients served than
    ``min_clients`` and the wait over, so the point estimate decides. ``looks``: the looks
    made so far (:func:`recorded_looks`); None: every look due made now, on ``evidence`` (a
    caller that asks once)."""
    margin = config.max_error_rate_increase
    if few:
        excess = evidence.excess()
        if not evidence.active or not evidence.canary or excess <= margin:
            return None
        return (
            f"error_rate: canary {evidence.rate('canary'):.3f} vs active "
            f"{evidence.rate('active'):.3f} over {len(evidence.canary)} and "
            f"{len(evidence.active)} clients (+{excess:.3f} > {margin})"
        )
    for look in due_looks(evidence, config, ()) if looks is None else looks:
        if look.lower > margin:
            return (
                f"error_rate: canary {look.canary:.3f} vs active {look.active:.3f} over "
                f"{look.clients} clients an arm (look {look.index + 1}), at least "
                f"+{look.lower:.3f} > {margin} ({1 - look.alpha:.2%})"
            )
    return None

"""The canary's latency test over clients: is the candidate significantly slower than
``1 + canary.max_latency_increase`` times the active version, as its clients (not their
requests) met it? Latency only rolls a canary back; it never promotes one.

The measure. A request's latency is mostly its request's doing: a whole answer of 2,000 tokens
takes a hundred times one of 20, and a long prompt's prefill delays a stream's first token. A
test on raw latency would be decided by which clients, with which requests, landed on which
arm (a client that sends huge requests to the canary only would make it slow), and the spread
between clients would leave it no power. So each successful request is measured in what the
model server did per token, up to where the proxy's clock is the server's and not the client's:

* a whole answer: ``latency_ms / max(output_tokens, 1)``, milliseconds per completion token
  (the proxy reads the whole answer from vLLM before the client reads any of it, so a client
  that reads slowly does not stretch it; a more verbose candidate is not slower per token);
* a stream: ``ttft_ms``, the time to its first chunk, as the proxy timed it: the rest of a
  stream's time runs at the pace the client reads, which a client chooses.

A whole answer's time includes its prompt's prefill, shared among its tokens: a candidate whose
answers are much shorter reads slower a token than it is, one reason the default margin is wide
(``canary.max_latency_increase`` 1.0; the other: an adapter is slower than the base model by
LoRA's own cost, docs/results/canary-latency.md).

A client's unit on an arm is its mean over its successful requests there, however many it
sends; its request mix is the same, in expectation, on either arm, and a client whose mix is
extreme is one unit among many and is trimmed (below). Refused (4xx) and failed requests, and
requests with an error of any kind, are not measured: failures are the error test's
(learner/canary_errors.py), and a refusal is fast for reasons that say nothing of the version.
Whole answers without a token count (no usage) and streams without a first chunk are not
measured either. The counter (learner/canary_counter.py) adds, per client and arm, the sum of
the measures and their number (``<client>\\tlat`` and ``<client>\\tlatn`` in the arm's clients
hash, ratchet/canary_state.py): two fields a client, as its requests and failures are.

The test. With ``f = 1 + max_latency_increase``, the statistic is ``T_c - f T_a``, the trimmed
means (``gamma = canary.client_trim`` of each end) of the canary's clients' units and of the
active's, and its squared error ``d_c + f^2 d_a`` (Yuen's ``d = (n - 1) s_w^2 / (h (h - 1))``,
``s_w^2`` the winsorized variance, ``h`` the units kept), with Welch-Satterthwaite degrees of
freedom, as learner/canary_clients.py's test compares ratings: scaling the active arm's units by
``f`` scales its trimmed mean by ``f`` and its error by ``f^2``. A look rolls back when the
one-sided lower bound ``T_c - f T_a - t_{1-a, nu} se`` is above 0: the canary is slower than
``f`` times the active arm beyond chance. Unlike the ratings' and the errors' units, latencies
are not bounded to [0, 1], so the arms are not padded with a 0 and a 1 (that would add a unit
of 0 ms to each); instead an arm's error is never read below a 1% spread of its mean
(:data:`LATENCY_RESOLUTION`): equal units are not an exact mean.

The looks are the error test's (learner/canary_looks.py): at ``min_clients * 2^j`` clients
measured on each arm, at ``alpha / 2^(j+1)``, each made once and recorded as
``latency_look:v<version>:<j>``, so an equal canary is rolled back by this test with
probability at most ``alpha`` over all of its checks. The error test holds its own ``alpha``:
together, an equal canary is rolled back by one of the two with probability at most ``2 alpha``.

With fewer clients measured than ``min_clients`` on an arm (a one-key app; a stack without API
keys, whose one anonymous client is one unit here) there is no test to make: the point estimate
decides, as the error test's does, once the canary is being decided on what it has, and before
an unrated canary is promoted (learner/canary.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from learner.canary_clients import Trimmed
from learner.canary_looks import RecordedLook, look_field, record_looks
from learner.canary_looks import due_looks as looks_due
from learner.canary_pairs import variance
from learner.canary_student_t import t_quantile
from ratchet.canary_state import LATENCY_COUNT_SUFFIX, LATENCY_SUFFIX, clients_key
from ratchet.records import TrafficRecord
from ratchet.registry import decode_hash
from ratchet.settings import CanaryConfig

LATENCY_TEST = "latency"
# An arm's squared error is never below that of units spread by this share of their mean: a
# client's mean latency is not known to better than the clock's and the network's jitter, and
# units all alike must not read as an exact mean.
LATENCY_RESOLUTION = 0.01

LatencyLook = RecordedLook


def request_latency(record: TrafficRecord) -> float | None:
    """The request's measure (the module docstring), None where it is not measured."""
    if record.error is not None or not 200 <= record.status < 300:
        return None
    if record.stream:
        return record.ttft_ms
    if record.output_tokens is None:
        return None
    return record.latency_ms / max(record.output_tokens, 1)


def read_client_latency(client: redis.Redis, alias: str, arm: str) -> dict[str, tuple[float, int]]:
    """Per client measured on the arm: (sum of its requests' measures, their number)."""
    raw = decode_hash(client.hgetall(clients_key(alias, arm)))
    sums: dict[str, tuple[float, int]] = {}
    for name, value in raw.items():
        if name.endswith(LATENCY_COUNT_SUFFIX):
            who = name.removesuffix(LATENCY_COUNT_SUFFIX)
            sums[who] = (sums.get(who, (0.0, 0))[0], int(value))
        elif name.endswith(LATENCY_SUFFIX):
            who = name.removesuffix(LATENCY_SUFFIX)
            sums[who] = (float(value), sums.get(who, (0.0, 0))[1])
    return sums


def latency_units(per_client: dict[str, tuple[float, int]]) -> list[float]:
    """An arm's units: each client's mean measure."""
    return [total / n for total, n in per_client.values() if n > 0]


def yuen(units: list[float], gamma: float) -> Trimmed:
    """The ``gamma``-trimmed mean of ``units`` (at least one) and Yuen's squared standard error,
    never below that of a spread of :data:`LATENCY_RESOLUTION` of the mean."""
    n = len(units)
    g = min(math.floor(gamma * n + 1e-9), (n - 2) // 2) if n > 2 else 0
    ordered = sorted(units)
    middle = ordered[g : n - g]
    h = len(middle)
    mean = statistics.fmean(middle)
    winsorized = [middle[0]] * g + middle + [middle[-1]] * g
    error2 = (n - 1) * variance(winsorized) / (h * (h - 1)) if h > 1 else 0.0
    return Trimmed(mean, max(error2, (LATENCY_RESOLUTION * mean) ** 2 / h), h)


@dataclass(frozen=True)
class LatencyEvidence:
    """Both arms' units (:func:`latency_units`)."""

    active: tuple[float, ...]
    canary: tuple[float, ...]

    @classmethod
    def of(
        cls, active: dict[str, tuple[float, int]], canary: dict[str, tuple[float, int]]
    ) -> LatencyEvidence:
        return cls(tuple(latency_units(active)), tuple(latency_units(canary)))

    @property
    def measured(self) -> int:
        """Clients measured on each arm (the fewer)."""
        return min(len(self.active), len(self.canary))

    def slower(self, factor: float, gamma: float, alpha: float) -> tuple[float, float, float]:
        """(the canary's trimmed mean, the active's, and the one-sided lower bound of
        ``T_c - factor T_a`` at ``alpha``); both arms need a unit."""
        a, c = yuen(list(self.active), gamma), yuen(list(self.canary), gamma)
        da, dc = factor**2 * a.error2, c.error2
        error2 = da + dc
        df = error2**2 / (
            (da**2 / (a.kept - 1) if a.kept > 1 else 0.0)
            + (dc**2 / (c.kept - 1) if c.kept > 1 else 0.0)
            or 1e-12
        )
        half = t_quantile(1.0 - alpha, max(df, 1.0)) * math.sqrt(error2)
        return c.mean, a.mean, c.mean - factor * a.mean - half


def enabled(config: CanaryConfig) -> bool:
    """Whether the latency test runs: ``max_latency_increase`` 0 or None turns it off."""
    return bool(config.max_latency_increase)


def due_looks(
    evidence: LatencyEvidence, config: CanaryConfig, made: Iterable[int]
) -> list[LatencyLook]:
    """The looks the clients measured now call for that are not ``made`` yet, on these
    measures (none while the test is off)."""
    if not enabled(config):
        return []
    factor = 1.0 + (config.max_latency_increase or 0.0)

    def make(index: int, clients: int, alpha: float) -> LatencyLook:
        canary, active, lower = evidence.slower(factor, config.client_trim, alpha)
        return LatencyLook(index, clients, canary, active, lower, alpha)

    return looks_due(evidence.measured, config, made, make)


def latency_look_field(version: int, index: int) -> str:
    return look_field(LATENCY_TEST, version, index)


def recorded_looks(
    client: redis.Redis,
    alias: str,
    version: int,
    evidence: LatencyEvidence,
    config: CanaryConfig,
) -> list[LatencyLook]:
    """The canary's latency looks: those recorded, and those due now made and recorded."""
    return record_looks(
        client,
        alias,
        version,
        LATENCY_TEST,
        config,
        lambda made: due_looks(evidence, config, made),
    )


def latency_rollback(
    evidence: LatencyEvidence,
    config: CanaryConfig,
    point: bool,
    looks: Iterable[LatencyLook] | None = None,
) -> str | None:
    """Why the canary's latency rolls it back, or None. ``point``: the canary is being decided
    on what it has, so with fewer than ``min_clients`` clients measured on an arm the point
    estimate (trimmed means) decides. ``looks``: the looks made so far (:func:`recorded_looks`);
    None: every look due made now, on ``evidence``."""
    if not enabled(config):
        return None
    increase = config.max_latency_increase or 0.0
    factor = 1.0 + increase
    for look in due_looks(evidence, config, ()) if looks is None else looks:
        if look.lower > 0.0:
            return (
                f"latency: canary {look.canary:.1f} vs active {look.active:.1f} ms a token "
                f"over {look.clients} clients an arm (look {look.index + 1}), at least "
                f"{look.lower:+.1f} ms above {factor:.2f}x the active's ({1 - look.alpha:.2%})"
            )
    if not point or evidence.measured == 0 or evidence.measured >= config.min_clients:
        return None
    canary, active, _ = evidence.slower(factor, config.client_trim, config.alpha)
    if canary <= factor * active:
        return None
    return (
        f"latency: canary {canary:.1f} vs active {active:.1f} ms a token over "
        f"{len(evidence.canary)} and {len(evidence.active)} clients "
        f"(> {factor:.2f}x the active's)"
    )

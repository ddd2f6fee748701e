"""Every replica has the version, or none serves it: before a candidate's gate (and so before
its canary or promotion), each vLLM replica is asked for the candidate by its served name and
answers the fixed probe of its fingerprint (learner/fingerprint.py) with ``prompt_logprobs``.

A replica passes when it answers and its logprobs are within the tolerance of the learner's.
One that fails is asked again every ``RETRY_S`` for up to ``learner.served_check.wait_s`` (a
store it sees late, a replica restarting). Then the failures part ways:

- a **mismatch** (it answers, with logprobs past the tolerance) rejects the candidate with a
  reason that names the replica: a replica serving other weights under the version's name says
  the store, the dtype or the LoRA as vLLM reads it differs from what was trained, which no
  routing can vouch for on the other replicas;
- a replica that **cannot load** it, as vLLM itself says (:func:`vllm_refused`: its 404 "does
  not exist" when no resolver finds the adapter, its 400 when one finds it and the engine cannot
  load it; or a 200 without the probe's logprobs) is out of that version's rotation alone
  (:attr:`ServedVerdict.excluded`, kept in Redis by learner/gating.py,
  ratchet/version_exclusion.py): no request for the version goes to it, every other version
  still does, and the gate and canary run on the replicas that passed. The canary watcher asks
  it again every ``learner.served_check.reprobe_s`` and lets it back in once it serves the
  version as trained (learner/readmission.py);
- a replica that is **unreachable** (connection refused or reset, a timeout, a 5xx, a 429: it
  restarts or is overloaded, which says nothing of the adapter) was not checked: it is not
  excluded, the reason says so, and its traffic is left to the outlier ejection every client of
  the replicas runs (ratchet/fleet.py), which takes it out while it keeps failing.

When no replica passed, the candidate is rejected with a reason that names them all.

A candidate without a fingerprint (an imported adapter) is still asked of every replica: each
must load it and answer. One trained sharded (FSDP) has one (learner/sharded_forwards.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from learner.fingerprint import Distance, Fingerprint, distance
from learner.metrics import LearnerMetrics
from ratchet.fleet import Resolver
from ratchet.secrets import vllm_api_key
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

RETRY_S = 2.0
# Without a fingerprint: a prompt every replica can answer, to see that it loads the version.
LOAD_PROMPT = "Hello"
DETAIL_CHARS = 200  # of a replica's error body, in the reason

Outcome = Literal["match", "mismatch", "unloaded", "unreachable"]

# vLLM's answers about the adapter itself (vllm/entrypoints/openai/models/serving.py
# resolve_lora, serve/engine/serving.py _check_model): 404 NotFoundError "does not exist" when
# nothing resolves the name, 400 BadRequestError "was found but could not be loaded".
REFUSED_STATUSES = frozenset({400, 404})


def vllm_refused(status: int) -> bool:
    """Whether an HTTP status from a replica is vLLM saying it cannot serve the model asked
    for; anything else but 200 (a 5xx, a 429, an auth failure) says nothing of the adapter."""
    return status in REFUSED_STATUSES


@dataclass(frozen=True)
class ReplicaCheck:
    """What one replica did with the probe."""

    replica: str
    outcome: Outcome
    distance: Distance | None = None
    detail: str = ""

    def describe(self, limit: float) -> str:
        if self.outcome == "match":
            how = self.distance.describe() if self.distance else "loaded"
            return f"{self.replica}: {how}"
        if self.outcome == "mismatch" and self.distance is not None:
            return f"{self.replica} serves other weights: {self.distance.describe()} > {limit:g}"
        if self.outcome == "unreachable":
            return f"{self.replica} not checked, unreachable: {self.detail}"
        return f"{self.replica} cannot serve it: {self.detail}"


@dataclass(frozen=True)
class ServedVerdict:
    served: str
    checks: tuple[ReplicaCheck, ...]
    limit: float

    def of(self, outcome: Outcome) -> tuple[ReplicaCheck, ...]:
        return tuple(c for c in self.checks if c.outcome == outcome)

    @property
    def passed(self) -> bool:
        """Some replica serves it as trained and none serves other weights (those that cannot
        load it are :attr:`excluded`, those unreachable :attr:`unchecked`)."""
        return bool(self.of("match")) and not self.of("mismatch")

    @property
    def failed(self) -> tuple[ReplicaCheck, ...]:
        return tuple(c for c in self.checks if c.outcome != "match")

    @property
    def excluded(self) -> tuple[ReplicaCheck, ...]:
        """The replicas out of the version's rotation when it passed: those that cannot load
        it."""
        return self.of("unloaded") if self.passed else ()

    @property
    def unchecked(self) -> tuple[ReplicaCheck, ...]:
        """The replicas that could not be asked (unreachable until ``wait_s``): not excluded,
        their traffic left to the outlier ejection."""
        return self.of("unreachable")

    @property
    def reason(self) -> str:
        head = f"served check of {self.served}: "
        if not self.checks:
            return head + "no vLLM replica to ask"
        if self.passed and not self.failed:
            return head + "every replica matches"
        failed = "; ".join(c.describe(self.limit) for c in self.failed)
        if self.passed and self.excluded:
            return head + f"out of its rotation: {failed}"
        if self.passed:
            return head + f"left to the outlier ejection: {failed}"
        if not self.of("match") and not self.of("mismatch"):
            return head + f"no replica can serve it: {failed}"
        return head + failed


def served_logprobs(body: Any, token_ids: Sequence[int]) -> tuple[float, ...]:
    """The logprob of each token after the first in vLLM's ``prompt_logprobs`` answer (a list,
    None first, then per position a dict of token id to ``{"logprob": ...}`` that always holds
    the prompt's own token). ValueError when the answer is not that."""
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"no prompt_logprobs in the answer: {exc!r}") from exc
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise ValueError("prompt_logprobs do not cover the probe's tokens")
    out = []
    for token, entry in zip(token_ids[1:], entries[1:], strict=True):
        try:
            out.append(float(entry[str(token)]["logprob"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"no logprob for token {token}") from exc
    return tuple(out)


class ServedCheck:
    """Asks each replica for a served name's probe logprobs (see the module docstring)."""

    def __init__(self, api_key: str, timeout_s: float, wait_s: float, limit: float) -> None:
        self.headers = {"authorization": f"Bearer {api_key}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.wait_s = wait_s
        self.limit = limit

    async def verdict(
        self, replicas: Sequence[str], served: str, fingerprint: Fingerprint | None
    ) -> ServedVerdict:
        """Each replica's check; those that fail asked again until they pass or ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        checks: dict[str, ReplicaCheck] = {}
        async with aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as session:
            pending = list(replicas)
            while True:
                answers = await asyncio.gather(
                    *(self.ask(session, url, served, fingerprint) for url in pending)
                )
                checks.update((c.replica, c) for c in answers)
                pending = [c.replica for c in answers if c.outcome != "match"]
                if not pending or time.monotonic() + RETRY_S > deadline:
                    break
                log.info("served check of %s: asking %s again", served, ", ".join(pending))
                await asyncio.sleep(RETRY_S)
        return ServedVerdict(served, tuple(checks[url] for url in replicas), self.limit)

    async def ask(
        self,
        session: aiohttp.ClientSession,
        url: str,
        served: str,
        fingerprint: Fingerprint | None,
    ) -> ReplicaCheck:
        """One replica's answer to the probe: every probe at once, one request."""
        prompts: list[Any] = [LOAD_PROMPT]
        if fingerprint is not None:
            prompts = [list(ids) for ids in fingerprint.token_ids]
        payload: dict[str, Any] = {
            "model": served,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if fingerprint is not None:
            payload["prompt_logprobs"] = 0
        try:
            async with session.post(f"{url}/v1/completions", json=payload) as response:
                if response.status != 200:
                    text = (await response.text())[:DETAIL_CHARS]
                    outcome: Outcome = (
                        "unloaded" if vllm_refused(response.status) else "unreachable"
                    )
                    return ReplicaCheck(url, outcome, detail=f"HTTP {response.status} {text}")
                body = await response.json()
        except ValueError as exc:  # a 200 whose body is not JSON
            return ReplicaCheck(url, "unloaded", detail=f"unusable answer: {exc}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return ReplicaCheck(url, "unreachable", detail=f"{type(exc).__name__}: {exc}")
        if fingerprint is None:
            return ReplicaCheck(url, "match")
        return self.compare(url, body, fingerprint)

    def compare(self, url: str, body: Any, fingerprint: Fingerprint) -> ReplicaCheck:
        """The replica's answer to the whole probe against the fingerprint."""
        try:
            choices = sorted(body["choices"], key=lambda c: int(c.get("index", 0)))
            served = [
                served_logprobs({"choices": [choice]}, ids)
                for choice, ids in zip(choices, fingerprint.token_ids, strict=True)
            ]
            gap = distance(fingerprint.logprobs, served)
        except (KeyError, TypeError, ValueError) as exc:
            return ReplicaCheck(url, "unloaded", detail=f"unusable answer: {exc}")
        outcome: Outcome = "match" if gap.within(self.limit) else "mismatch"
        return ReplicaCheck(url, outcome, gap)


async def replica_urls(vllm_url: str, vllm_endpoints: Sequence[str]) -> list[str]:
    """Every replica behind the configured endpoints now (ratchet/fleet.py's resolver), else
    ``vllm_url`` alone."""
    if vllm_endpoints:
        return await Resolver(vllm_endpoints).resolve()
    return [vllm_url.rstrip("/")]


def check_replicas(
    settings: RatchetSettings,
    metrics: LearnerMetrics,
    alias: str,
    served: str,
    fingerprint: Fingerprint | None,
) -> ServedVerdict:
    """Every replica's check of the candidate ``served`` (its served name), counted per
    replica."""
    knobs = settings.learner.served_check
    limit = knobs.tolerance(fingerprint.precision if fingerprint else knobs.served_precision)
    check = ServedCheck(vllm_api_key(settings), knobs.timeout_s, knobs.wait_s, limit)

    async def run() -> ServedVerdict:
        urls = await replica_urls(settings.vllm_url, settings.vllm_endpoints)
        return await check.verdict(urls, served, fingerprint)

    verdict = asyncio.run(run())
    for c in verdict.checks:
        metrics.served_checks.labels(alias, c.replica, c.outcome).inc()
        if c.distance is not None and c.distance.tokens:
            metrics.served_distance.labels(alias, c.replica).set(c.distance.mean_abs)
    if verdict.passed and not verdict.failed:
        log.info("%s (%s)", verdict.reason, "; ".join(c.describe(limit) for c in verdict.checks))
    else:
        log.warning("%s", verdict.reason)
    return verdict

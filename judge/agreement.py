"""The judge scores what users rated, to measure how far it agrees with them.

For an alias judged by RULER (``reward.kind`` ruler or mixed, ``feedback.judge_agreement`` on),
the learner queues each rated served answer (learner/ratings.py) with the request it answered.
:class:`AgreementProbe` takes them from the queue, samples ``group_size - 1`` fresh answers to
the same request (its whole conversation, tools and output constraints, as the answer was
served) from the live version, scores the served answer among them exactly as a training group
is scored (judge/scoring.py), and keeps the served answer's score beside the user's rating. The
measures (ratchet/rewards/agreement.py) become metrics, a line in ``ratchet status`` and an
alert (``RatchetJudgeDisagreesWithUsers``): a team learns that its rubric disagrees with its
users before the loop trains on it.

A rated answer that cannot be scored (vLLM or the judge model away, a request cut to fit Kafka,
an entry that does not decode) is counted and dropped: the measure needs a sample of the
ratings, not every one, and the queue must not grow while they are away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import redis
import redis.asyncio as aioredis

from judge.metrics import JudgeMetrics
from judge.sampler import SamplingError, prompt_of, sample_from, sampling_body, sampling_max_tokens
from judge.scoring import GroupScorer, ScoringError
from ratchet.fleet import Replicas
from ratchet.registry import AliasRoute, served_name
from ratchet.rewards.agreement import (
    RatedExchange,
    agreement,
    agreement_key,
    decode_pair,
    encode_pair,
    probes_agreement,
    to_judge_key,
)
from ratchet.settings import AliasConfig, RatchetSettings

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often an idle probe looks for new rated answers
BATCH = 8  # rated answers taken from one alias's queue at a time

RouteOf = Callable[[str, AliasConfig], Awaitable[AliasRoute]]


class AgreementProbe:
    def __init__(
        self,
        settings: RatchetSettings,
        client: aioredis.Redis,
        scorer: GroupScorer,
        metrics: JudgeMetrics,
        route_of: RouteOf,
        lengths_of: Callable[[str], Sequence[int]],
        limit: asyncio.Semaphore,
        vllm_key: str,
        replicas: Replicas | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.scorer = scorer
        self.metrics = metrics
        self.route_of = route_of
        self.lengths_of = lengths_of
        self.limit = limit  # shared with the judge's groups: vLLM serves both
        self.vllm_key = vllm_key
        self.replicas = replicas or Replicas.from_settings(settings)
        self.aliases = sorted(a for a, c in settings.aliases.items() if probes_agreement(c))
        for alias in self.aliases:
            self.metrics.agreement_min.labels(alias).set(
                settings.aliases[alias].feedback.min_agreement
            )

    async def run(self, session: aiohttp.ClientSession, stopping: asyncio.Event) -> None:
        """Until ``stopping``: score the queued rated answers; Redis errors are retried."""
        while not stopping.is_set():
            taken = 0
            for alias in self.aliases:
                try:
                    taken += await self.probe(session, alias)
                except (redis.RedisError, OSError) as exc:
                    log.warning("judge-user agreement for %s: %s; retrying", alias, exc)
            if not taken:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), POLL_S)

    async def probe(self, session: aiohttp.ClientSession, alias: str) -> int:
        """Score up to :data:`BATCH` queued answers of ``alias``, keep the pairs, publish the
        measures. The number of answers taken from the queue."""
        raw = await self.redis.lpop(to_judge_key(alias), BATCH)
        if not raw:
            return 0
        config = self.settings.aliases[alias]
        items = raw if isinstance(raw, list) else [raw]
        exchanges = [self.decode(alias, item) for item in items]
        scored = await asyncio.gather(
            *(self.score(session, alias, config, e) for e in exchanges if e is not None)
        )
        pairs = [encode_pair(*p) for p in scored if p is not None]
        key = agreement_key(alias)
        if pairs:
            pipe = self.redis.pipeline(transaction=True)
            pipe.rpush(key, *pairs)
            pipe.ltrim(key, -config.feedback.agreement_window, -1)
            await pipe.execute()
        self.publish(alias, [decode_pair(p) for p in await self.redis.lrange(key, 0, -1)])
        return len(items)

    def decode(self, alias: str, raw: bytes | str) -> RatedExchange | None:
        """The queued entry, or None (counted) for one that is not a rated exchange."""
        try:
            return RatedExchange.decode(raw)
        except ValueError as exc:
            self.metrics.agreement_probes.labels(alias, "bad_entry").inc()
            log.warning("a queued rated answer of %s dropped: %s", alias, exc)
            return None

    def publish(self, alias: str, pairs: list[tuple[float, float]]) -> None:
        measures = agreement(pairs)
        self.metrics.agreement_pairs.labels(alias).set(measures.pairs)
        for name, value in (
            ("pairwise_accuracy", measures.pairwise_accuracy),
            ("spearman", measures.spearman),
        ):
            if value is not None:
                self.metrics.agreement.labels(alias, name).set(value)

    async def score(
        self,
        session: aiohttp.ClientSession,
        alias: str,
        config: AliasConfig,
        exchange: RatedExchange,
    ) -> tuple[float, float] | None:
        """(the judge's score of the served answer among re-samples, the user's rating)."""
        answer, request = exchange.rated, exchange.request
        if request is None:
            # Cut to fit Kafka or too large to queue: re-sampling would answer another prompt.
            self.metrics.agreement_probes.labels(alias, "not_replayable").inc()
            return None
        prompt = prompt_of(request.get("messages") or [])
        if prompt is None:
            self.metrics.agreement_probes.labels(alias, "no_prompt").inc()
            return None
        tools = request.get("tools") or None
        async with self.limit:
            try:
                samples = await self.resample(session, alias, config, prompt, request)
                score = await self.scorer.score(
                    alias, config.reward, prompt, tools, [answer.message, *samples]
                )
            except (SamplingError, ScoringError) as exc:
                self.metrics.agreement_probes.labels(alias, exc.cause).inc()
                log.warning("rated answer %s not scored: %s", answer.completion_id, exc)
                return None
        self.metrics.agreement_probes.labels(alias, "scored").inc()
        return score.rewards[0], answer.score

    async def resample(
        self,
        session: aiohttp.ClientSession,
        alias: str,
        config: AliasConfig,
        prompt: list[dict[str, Any]],
        request: dict[str, Any],
    ) -> list[dict[str, Any]]:
        """``group_size - 1`` answers to the prompt from the live version, under the request's
        tools and output constraints, as the judge samples a training group."""
        route = await self.route_of(alias, config)
        max_tokens = sampling_max_tokens(config.sampling, request, self.lengths_of(alias))
        body = sampling_body(
            served_name(alias, route.active, route.base_model),
            prompt,
            request,
            max(1, config.learning.group_size - 1),
            config.sampling,
            max_tokens=max_tokens,
        )
        group = await sample_from(
            self.replicas, session, body, self.settings.judge.sample_timeout_s, self.vllm_key
        )
        return [s.message for s in group.samples]

"""Scoring a sampled group: RULER (cached), a verifier, both, or the alias's reward model.

The request, the reply, the judge call with its retries and the verifier checks live in
ratchet/rewards/; this module adds the judge's dedupe of identical answers and its Redis cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis
import redis.asyncio as aioredis

from judge.metrics import JudgeMetrics
from ratchet.bill import Bill
from ratchet.records import answer_as_text, answer_identity
from ratchet.rewards.judge_call import JudgeModel, JudgeUnavailable, ask_judge_once, judge_scores
from ratchet.rewards.reward_model import RewardModels, RewardModelUnavailable
from ratchet.rewards.reward_status import RewardStatus, status_key
from ratchet.rewards.ruler import JudgeRequest, JudgeScores, build_judge_request, cache_key
from ratchet.rewards.ruler import rubric_hash as hash_rubric
from ratchet.rewards.verifiers import VerifierError, combine, load_verifier, run_verifier
from ratchet.settings import JudgeSettings, RewardConfig
from ratchet.spend import SPEND_TTL_S, spend_key, today

# Sorted set of the cached verdicts' keys (score: when cached): the judge cache's count bound.
CACHE_INDEX = "ratchet:judge:cache-index"
IDENTICAL_SCORE = 0.5  # any constant: equal rewards carry no GRPO signal either way


class ScoringError(Exception):
    """The group cannot be scored; ``cause`` labels the dropped-groups metric."""

    def __init__(self, cause: str, message: str = "") -> None:
        super().__init__(message or cause)
        self.cause = cause


@dataclass(frozen=True)
class GroupScore:
    rewards: list[float]
    explanations: list[str]
    judge_model: str | None
    rubric_hash: str | None


class GroupScorer:
    def __init__(
        self,
        settings: JudgeSettings,
        default_api_base: str,
        cache: aioredis.Redis | None,
        metrics: JudgeMetrics,
        default_api_key: str | None = None,
        reward_models: RewardModels | None = None,
    ) -> None:
        self.settings = settings
        self.default_api_base = default_api_base
        # vLLM's key: sent only when the judge model is asked at default_api_base.
        self.default_api_key = default_api_key
        self.cache = cache
        self.metrics = metrics
        self.reward_models = reward_models  # for reward.kind feedback

    async def score(
        self,
        alias: str,
        reward: RewardConfig,
        prompt: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        samples: list[dict[str, Any]],
        bill: Bill | None = None,
    ) -> GroupScore:
        """``bill`` gets the judge calls the scoring makes."""
        if reward.kind == "feedback":
            return await self.learned(alias, prompt, samples)
        ruler_scores: list[float] | None = None
        verified: list[float] | None = None
        explanations = [""] * len(samples)
        if reward.kind in ("ruler", "mixed"):
            ruler_scores, explanations = await self.ruler(
                alias, reward, prompt, tools, samples, bill
            )
        if reward.kind in ("verifier", "mixed"):
            verified = self.verify(reward, prompt, samples)
        judged_by = reward.judge_model if ruler_scores is not None else None
        rewards = combine(ruler_scores, verified, reward.ruler_weight)
        if reward.learns_from_ratings:
            rewards, judged_by = await self._with_ratings(alias, reward, prompt, samples, rewards)
            # judged_by: the judge model, and "+<alias>.reward@v<N>" once the ratings weigh in
        return GroupScore(
            rewards=rewards,
            explanations=explanations,
            judge_model=judged_by,
            rubric_hash=hash_rubric(reward.rubric) if ruler_scores is not None else None,
        )

    async def _with_ratings(
        self,
        alias: str,
        reward: RewardConfig,
        prompt: list[dict[str, Any]],
        samples: list[dict[str, Any]],
        rewards: list[float],
    ) -> tuple[list[float], str | None]:
        """kind mixed with a feedback_weight: the reward model's scores weighed in, once it is
        usable. Until then the group is scored without them (GRPO's advantages are relative to
        the group, so the reward's scale changing then does not bias a round)."""
        status = await self.reward_status(alias)
        if status is None or not status.usable:
            return rewards, reward.judge_model
        learned = await self.learned(alias, prompt, samples)
        w = reward.feedback_weight
        mixed = [(1.0 - w) * r + w * s for r, s in zip(rewards, learned.rewards, strict=True)]
        return mixed, f"{reward.judge_model}+{learned.judge_model}"

    async def reward_status(self, alias: str) -> RewardStatus | None:
        """The alias's reward model status (ratchet/rewards/reward_model.py), None if unknown."""
        if self.cache is None:
            return None
        try:
            return RewardStatus.from_hash(await self.cache.hgetall(status_key(alias)))
        except (redis.RedisError, OSError):
            return None

    async def learned(
        self, alias: str, prompt: list[dict[str, Any]], samples: list[dict[str, Any]]
    ) -> GroupScore:
        """The alias's live reward model scores the K answers in one forward pass."""
        if self.reward_models is None:
            raise ScoringError("no_reward_model", "the judge was started without reward models")
        status = await self.reward_status(alias)
        texts = [answer_as_text(sample) for sample in samples]
        models = self.reward_models
        try:
            rewards, name = await asyncio.to_thread(models.score, alias, status, prompt, texts)
        except RewardModelUnavailable as exc:
            raise ScoringError("no_reward_model", str(exc)) from None
        return GroupScore(
            rewards=rewards, explanations=[""] * len(samples), judge_model=name, rubric_hash=None
        )

    def verify(
        self, reward: RewardConfig, prompt: list[dict[str, Any]], samples: list[dict[str, Any]]
    ) -> list[float]:
        assert reward.verifier is not None
        try:
            verifier = load_verifier(reward.verifier)
            return [run_verifier(verifier, prompt, sample) for sample in samples]
        except VerifierError as exc:
            raise ScoringError(f"verifier_{exc.cause}", str(exc)) from None

    async def ruler(
        self,
        alias: str,
        reward: RewardConfig,
        prompt: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        samples: list[dict[str, Any]],
        bill: Bill | None = None,
    ) -> tuple[list[float], list[str]]:
        # Identical answers are judged once; a group of one distinct answer is not judged.
        unique: list[dict[str, Any]] = []
        slot_of: dict[bytes, int] = {}
        slots = []
        for sample in samples:
            identity = answer_identity(sample)
            if identity not in slot_of:
                slot_of[identity] = len(unique)
                unique.append(sample)
            slots.append(slot_of[identity])
        if len(unique) == 1:
            return [IDENTICAL_SCORE] * len(samples), ["identical samples: not judged"] * len(
                samples
            )
        key = "ratchet:judge:cache:" + cache_key(
            prompt, tools, unique, reward.rubric, reward.judge_model
        )
        cached = cached_verdict(await self._cache_get(key), len(unique))
        if cached is not None:
            self.metrics.cache_hits.labels(alias).inc()
            scores, explanations = cached
        else:
            scores, explanations = await self._judge(alias, reward, prompt, tools, unique, bill)
            await self._cache_set(key, {"scores": scores, "explanations": explanations})
        return [scores[s] for s in slots], [explanations[s] for s in slots]

    def judge_model(self, reward: RewardConfig) -> JudgeModel:
        return JudgeModel.of(
            self.settings, reward.judge_model, self.default_api_base, self.default_api_key
        )

    async def call_judge(
        self, alias: str, reward: RewardConfig, request: JudgeRequest, bill: Bill | None = None
    ) -> JudgeScores:
        """One judge call, no retry: the parsed reply back (or JudgeReplyError, TimeoutError).
        Counted, priced into the alias's spend today, and added to ``bill``."""
        observe = self.metrics.judge_latency.labels(alias).observe
        call = Bill()
        try:
            return await ask_judge_once(request, self.judge_model(reward), observe, call)
        finally:
            await self.account(alias, call)
            if bill is not None:
                bill.add(call)

    async def account(self, alias: str, call: Bill) -> None:
        """A judge call's tokens and price in the counters, its price in the day's spend (the
        learning.max_cost_per_day budget); a Redis outage loses the spend, never the call."""
        self.metrics.judge_calls.labels(alias).inc(call.judge_calls)
        self.metrics.judge_seconds.labels(alias).inc(call.judge_seconds)
        self.metrics.judge_tokens.labels(alias, "input").inc(call.judge_input_tokens)
        self.metrics.judge_tokens.labels(alias, "output").inc(call.judge_output_tokens)
        self.metrics.judge_cost.labels(alias).inc(call.judge_cost_usd)
        if self.cache is None or call.judge_cost_usd <= 0:
            return
        key = spend_key(alias, today())
        with contextlib.suppress(redis.RedisError, OSError):
            pipe = self.cache.pipeline(transaction=False)
            pipe.incrbyfloat(key, call.judge_cost_usd)
            pipe.expire(key, SPEND_TTL_S)
            await pipe.execute()

    async def _judge(
        self,
        alias: str,
        reward: RewardConfig,
        prompt: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        unique: list[dict[str, Any]],
        bill: Bill | None = None,
    ) -> tuple[list[float], list[str]]:
        """Judge with retries; each retry shuffles anew. ScoringError when all attempts fail."""

        def request_for(attempt: int) -> JudgeRequest:
            seed = random.getrandbits(32)
            return build_judge_request(prompt, unique, reward.rubric, tools=tools, seed=seed)

        try:
            parsed = await judge_scores(
                request_for,
                self.judge_model(reward),
                self.settings.judge_retries,
                attempt=lambda request: self.call_judge(alias, reward, request, bill),
            )
        except JudgeUnavailable as exc:
            raise ScoringError(exc.cause) from None
        return parsed.scores, parsed.explanations

    async def _cache_get(self, key: str) -> bytes | None:
        if self.cache is None:
            return None
        try:
            raw = await self.cache.get(key)
        except (redis.RedisError, OSError):
            return None  # no cache is slower, never wrong
        return raw.encode() if isinstance(raw, str) else raw

    async def _cache_set(self, key: str, value: dict[str, Any]) -> None:
        """Cache a verdict for ``judge.cache_ttl_s``, indexed by when, so that past
        ``judge.cache_max_entries`` the oldest entries go: a bound by count, not by time alone."""
        if self.cache is None:
            return
        ttl, now = self.settings.cache_ttl_s, time.time()
        with contextlib.suppress(redis.RedisError, OSError):
            pipe = self.cache.pipeline(transaction=True)
            pipe.set(key, orjson.dumps(value), ex=ttl)
            pipe.zadd(CACHE_INDEX, {key: now})
            pipe.zremrangebyscore(CACHE_INDEX, 0, now - ttl)  # expired by their own TTL
            pipe.zcard(CACHE_INDEX)
            pipe.expire(CACHE_INDEX, ttl)
            *_, entries, _ = await pipe.execute()
            over = int(entries) - self.settings.cache_max_entries
            if over > 0:
                popped = await self.cache.zpopmin(CACHE_INDEX, over)
                oldest = cast(list[tuple[bytes, float]], popped)
                await self.cache.delete(*[member for member, _ in oldest])


def cached_verdict(raw: bytes | None, count: int) -> tuple[list[float], list[str]] | None:
    """A cached verdict on ``count`` answers, or None: absent, or not one (written by hand or by
    another version), which is a miss: the group is judged again and the entry overwritten."""
    if not raw:
        return None
    try:
        data = orjson.loads(raw)
        scores = [float(score) for score in data["scores"]]
        explanations = [str(text) for text in data["explanations"]]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if len(scores) != count or len(explanations) != count:
        return None
    if not all(math.isfinite(score) for score in scores):
        return None
    return scores, explanations

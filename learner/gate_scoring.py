"""The gate's scoring: one paired outcome for the candidate per answered held-out prompt.

* verifier: 1 if its score is higher, 0 if lower, 0.5 on a tie (:func:`verifier_outcome`);
* RULER: the judge sees the two answers side by side twice, in both presentation orders; a win
  (or a loss) counts only when both orders agree, anything else is a tie
  (:func:`pairwise_outcome`), so a judge that simply prefers the first answer it reads cannot
  promote anything;
* mixed: ``ruler_weight`` x the RULER outcome + the rest x the verifier outcome;
* feedback: as a verifier, with the alias's live reward model scoring both answers (pointwise,
  one forward pass for the pair).

A pair that could not be answered or judged has no outcome (None): the gate counts it as failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ratchet.bill import Bill
from ratchet.records import HeldoutPrompt
from ratchet.rewards.judge_call import JudgeModel, JudgeUnavailable, judge_scores
from ratchet.rewards.reward_model import RewardModels, RewardModelUnavailable
from ratchet.rewards.reward_status import RewardStatus, reward_model_name
from ratchet.rewards.ruler import JudgeRequest, build_judge_request
from ratchet.rewards.verifiers import VerifierError, load_verifier, run_verifier
from ratchet.settings import AliasConfig, RatchetSettings

TIE_TOLERANCE = 1e-9

# The candidate's and the live version's answer messages to one prompt; None: not answered.
Answered = tuple[dict[str, Any], dict[str, Any]] | None


class GateError(Exception):
    pass


def verifier_outcome(candidate: float, incumbent: float) -> float:
    if candidate > incumbent + TIE_TOLERANCE:
        return 1.0
    if candidate < incumbent - TIE_TOLERANCE:
        return 0.0
    return 0.5


def pairwise_outcome(first_order: float, second_order: float) -> float:
    """The candidate's outcome from its score margin over the incumbent in each order."""
    if first_order > TIE_TOLERANCE and second_order > TIE_TOLERANCE:
        return 1.0
    if first_order < -TIE_TOLERANCE and second_order < -TIE_TOLERANCE:
        return 0.0
    return 0.5


@dataclass
class Scored:
    """One pair's outcome, None when it could not be answered or judged."""

    outcome: float | None
    candidate_score: float | None = None
    incumbent_score: float | None = None
    answers: tuple[str, str] | None = None  # (candidate's, live version's) texts


async def _none() -> None:
    return None


class PairScorer:
    """Scores answered pairs by the alias's reward: verifier, RULER, both, or reward model."""

    def __init__(
        self,
        settings: RatchetSettings,
        vllm_key: str,
        reward_models: RewardModels | None = None,
        reward_status: Callable[[str], RewardStatus | None] | None = None,
    ) -> None:
        self.settings = settings
        self.vllm_key = vllm_key  # vLLM's key, when it is the judge
        # For feedback aliases: the models, and where their live status is read from.
        self.reward_models = reward_models
        self.reward_status = reward_status
        # Judge calls in flight share the gate's limit with its answers (set by the gate for each
        # evaluation: a semaphore is bound to the event loop it first waits on).
        self.limit = asyncio.Semaphore(settings.learner.gate_concurrency)
        # The judge calls of the running evaluation (reset by the gate for each).
        self.bill = Bill()
        # A feedback alias's reward model, read once per evaluation (begin): every pair of a gate
        # is scored by the same version, even if a retrain goes live meanwhile.
        self.pinned: RewardStatus | None = None

    def begin(self, alias: str, config: AliasConfig) -> str | None:
        """A new evaluation: a bill of its own and, for a feedback alias, the reward model that
        will score all of its pairs, whose name this returns (None: no reward model scores)."""
        self.bill = Bill()
        self.pinned = None
        if config.reward.kind != "feedback" or self.reward_status is None:
            return None
        self.pinned = self.reward_status(alias)
        if self.pinned is None or not self.pinned.usable:
            return None
        return reward_model_name(alias, self.pinned.version)

    async def score(
        self,
        config: AliasConfig,
        prompts: list[HeldoutPrompt],
        answered: list[Answered],
        seed: int,
    ) -> list[Scored]:
        """Each answered pair's outcome, by the alias's reward."""
        reward = config.reward
        if reward.kind == "feedback":
            return await asyncio.to_thread(self._reward_model_scored, prompts, answered)
        verified: list[Scored | None] = [None] * len(prompts)
        if reward.kind in ("verifier", "mixed"):
            verified = self._verified(config, prompts, answered)
        if reward.kind == "verifier":
            return [v or Scored(None) for v in verified]
        judged = await asyncio.gather(
            *(
                self._judge_pair(config, p, a, seed) if a is not None else _none()
                for p, a in zip(prompts, answered, strict=True)
            )
        )
        w = 1.0 if reward.kind == "ruler" else reward.ruler_weight
        out = []
        for ruler, v in zip(judged, verified, strict=True):
            if ruler is None:
                out.append(Scored(None))
            elif v is None:
                out.append(Scored(w * ruler))
            else:
                assert v.outcome is not None
                out.append(
                    Scored(w * ruler + (1.0 - w) * v.outcome, v.candidate_score, v.incumbent_score)
                )
        return out

    def _verified(
        self, config: AliasConfig, prompts: list[HeldoutPrompt], answered: list[Answered]
    ) -> list[Scored | None]:
        """Each answered pair scored by the alias's verifier."""
        assert config.reward.verifier is not None
        verifier = load_verifier(config.reward.verifier)
        verified: list[Scored | None] = [None] * len(prompts)
        for i, (prompt, answers) in enumerate(zip(prompts, answered, strict=True)):
            if answers is None:
                continue
            try:
                c = run_verifier(verifier, prompt.prompt_messages, answers[0])
                n = run_verifier(verifier, prompt.prompt_messages, answers[1])
            except VerifierError as exc:
                raise GateError(f"the verifier failed on a held-out prompt: {exc}") from exc
            verified[i] = Scored(verifier_outcome(c, n), c, n)
        return verified

    def _reward_model_scored(
        self, prompts: list[HeldoutPrompt], answered: list[Answered]
    ) -> list[Scored]:
        """Each pair scored by the alias's live reward model: 1, 0 or 0.5 as a verifier's."""
        if self.reward_models is None or self.reward_status is None:
            raise GateError("a feedback alias's gate needs the reward models")
        alias = prompts[0].alias if prompts else ""
        status = self.pinned
        out = []
        for prompt, answers in zip(prompts, answered, strict=True):
            if answers is None:
                out.append(Scored(None))
                continue
            texts = [str(a.get("content") or "") for a in answers]
            try:
                (c, n), _ = self.reward_models.score(alias, status, prompt.prompt_messages, texts)
            except RewardModelUnavailable as exc:
                raise GateError(str(exc)) from exc
            out.append(Scored(verifier_outcome(c, n), c, n))
        return out

    async def _judge_pair(
        self,
        config: AliasConfig,
        prompt: HeldoutPrompt,
        answers: tuple[dict[str, Any], dict[str, Any]],
        seed: int,
    ) -> float | None:
        """RULER on the pair in both orders; None when the judge gave no usable verdict."""
        if orjson.dumps(answers[0]) == orjson.dumps(answers[1]):
            return 0.5  # the same answer: a tie, no judge call needed
        margins = []
        for order in ((0, 1), (1, 0)):
            scores = await self._judge_once(config, prompt, list(answers), order, seed)
            if scores is None:
                return None
            margins.append(scores[0] - scores[1])
        return pairwise_outcome(margins[0], margins[1])

    async def _judge_once(
        self,
        config: AliasConfig,
        prompt: HeldoutPrompt,
        answers: list[dict[str, Any]],
        order: tuple[int, int],
        seed: int,
    ) -> list[float] | None:
        """The judge's scores for ``answers`` shown in ``order``; None if it gave no verdict."""
        reward, judge = config.reward, self.settings.judge

        def request_for(attempt: int) -> JudgeRequest:
            return build_judge_request(
                prompt.prompt_messages,
                answers,
                reward.rubric,
                tools=prompt.tools,
                seed=seed + attempt,
                order=order,
            )

        model = JudgeModel.of(
            judge, reward.judge_model, self.settings.vllm_url.rstrip("/") + "/v1", self.vllm_key
        )
        try:
            verdict = await judge_scores(
                request_for, model, judge.judge_retries, limit=self.limit, bill=self.bill
            )
        except JudgeUnavailable:
            return None
        return verdict.scores

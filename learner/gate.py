"""The promotion gate: does the candidate beat the live version on prompts it never trained on?

Both versions answer the same held-out prompts through vLLM (greedy by default, so a pair
differs only because the weights do). Each prompt gives one paired outcome for the candidate:

* verifier: 1 if its score is higher, 0 if lower, 0.5 on a tie (the paired score difference);
* RULER: the judge sees the two answers side by side twice, in both presentation orders; a win
  (or a loss) counts only when both orders agree, anything else is a tie, so a judge that simply
  prefers the first answer it reads cannot promote anything;
* mixed: ``ruler_weight`` x the RULER outcome + the rest x the verifier outcome.

The win rate is the mean outcome, and its 95% interval a percentile bootstrap over prompts. The
candidate passes when at least ``min_pairs`` pairs were compared and the interval's lower end is
above ``threshold``. The pure part (:func:`decide` and below) is tested without a model.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from ratchet.records import HeldoutPrompt
from ratchet.rewards.judge_call import JudgeModel, JudgeUnavailable, judge_scores
from ratchet.rewards.ruler import JudgeRequest, build_judge_request
from ratchet.rewards.verifiers import VerifierError, load_verifier, run_verifier
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, GateConfig, RatchetSettings

log = logging.getLogger(__name__)

TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reason: str
    pairs: int
    win_rate: float | None
    ci_low: float | None
    ci_high: float | None
    threshold: float
    min_pairs: int
    candidate_score: float | None = None  # mean verifier score on the held-out prompts
    incumbent_score: float | None = None
    failed_pairs: int = 0  # prompts one of the versions could not answer, or not judged

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def bootstrap_interval(
    outcomes: list[float], samples: int, seed: int, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean outcome (resampling prompts with replacement)."""
    if not outcomes:
        raise ValueError("no outcomes to bootstrap")
    values = np.asarray(outcomes, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def decide(
    outcomes: list[float],
    gate: GateConfig,
    seed: int = 0,
    candidate_score: float | None = None,
    incumbent_score: float | None = None,
    failed_pairs: int = 0,
) -> GateResult:
    """Promote only with enough pairs and a 95% lower bound above the threshold."""
    common = {
        "pairs": len(outcomes),
        "threshold": gate.threshold,
        "min_pairs": gate.min_pairs,
        "candidate_score": candidate_score,
        "incumbent_score": incumbent_score,
        "failed_pairs": failed_pairs,
    }
    if not outcomes:
        unmeasured = {"win_rate": None, "ci_low": None, "ci_high": None}
        return GateResult(False, "no held-out pairs", **unmeasured, **common)  # type: ignore[arg-type]
    win_rate = sum(outcomes) / len(outcomes)
    low, high = bootstrap_interval(outcomes, gate.bootstrap_samples, seed)
    if len(outcomes) < gate.min_pairs:
        passed, reason = False, f"{len(outcomes)} held-out pairs, fewer than {gate.min_pairs}"
    elif low > gate.threshold:
        passed, reason = True, f"win rate {win_rate:.3f}, 95% CI low {low:.3f} > {gate.threshold}"
    else:
        passed, reason = False, f"win rate {win_rate:.3f}, 95% CI low {low:.3f} <= {gate.threshold}"
    return GateResult(passed, reason, win_rate=win_rate, ci_low=low, ci_high=high, **common)  # type: ignore[arg-type]


def answer_message(choice: dict[str, Any]) -> dict[str, Any]:
    """The parts of vLLM's answer that are the answer: role, content and tool calls."""
    message = choice.get("message") or {}
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return answer


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


class GateError(Exception):
    pass


class Gate:
    """Answers held-out prompts with both versions through vLLM, then scores the pairs."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self.vllm_key = vllm_api_key(settings)  # vLLM's key, for its answers and as the judge
        self.limit = asyncio.Semaphore(settings.learner.gate_concurrency)

    async def evaluate(
        self,
        alias: str,
        config: AliasConfig,
        prompts: list[HeldoutPrompt],
        candidate: str,
        incumbent: str,
        seed: int = 0,
    ) -> GateResult:
        """``candidate`` and ``incumbent`` are served names (``alias@vN`` or the base model)."""
        # A fresh limit per call: an asyncio.Semaphore is bound to the first event loop it waits
        # on, and the learner runs each round's gate in a new one (asyncio.run).
        self.limit = asyncio.Semaphore(self.settings.learner.gate_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.settings.learner.gate_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            answered = await asyncio.gather(
                *(self._pair(session, p, config.gate, candidate, incumbent, seed) for p in prompts)
            )
        pairs = [(p, a) for p, a in zip(prompts, answered, strict=True) if a is not None]
        failed = len(prompts) - len(pairs)
        reward = config.reward
        cand_scores = inc_scores = verified = None
        if reward.kind in ("verifier", "mixed"):
            assert reward.verifier is not None
            verifier = load_verifier(reward.verifier)
            try:
                cand_scores = [run_verifier(verifier, p.prompt_messages, a[0]) for p, a in pairs]
                inc_scores = [run_verifier(verifier, p.prompt_messages, a[1]) for p, a in pairs]
            except VerifierError as exc:
                raise GateError(f"the verifier failed on a held-out prompt: {exc}") from exc
            verified = [
                verifier_outcome(c, i) for c, i in zip(cand_scores, inc_scores, strict=True)
            ]
        if reward.kind == "verifier":
            assert verified is not None
            outcomes = verified
        else:
            judged = await asyncio.gather(*(self._judge_pair(config, p, a, seed) for p, a in pairs))
            ruler = {i: outcome for i, outcome in enumerate(judged) if outcome is not None}
            failed += len(pairs) - len(ruler)
            w = 1.0 if verified is None else reward.ruler_weight
            outcomes = [
                w * outcome + (1.0 - w) * (verified[i] if verified is not None else 0.0)
                for i, outcome in ruler.items()
            ]
        return decide(outcomes, config.gate, seed, _mean(cand_scores), _mean(inc_scores), failed)

    async def _pair(
        self,
        session: aiohttp.ClientSession,
        prompt: HeldoutPrompt,
        gate: GateConfig,
        candidate: str,
        incumbent: str,
        seed: int,
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        try:
            return (
                await self._answer(session, candidate, prompt, gate, seed),
                await self._answer(session, incumbent, prompt, gate, seed),
            )
        except (aiohttp.ClientError, TimeoutError, GateError) as exc:
            log.warning("gate: no answer pair for %s: %s", prompt.prompt_hash[:12], exc)
            return None

    async def _answer(
        self,
        session: aiohttp.ClientSession,
        served: str,
        prompt: HeldoutPrompt,
        gate: GateConfig,
        seed: int,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": served,
            "messages": prompt.prompt_messages,
            "temperature": gate.temperature,
            "max_tokens": gate.max_tokens,
            "seed": seed,
        }
        if prompt.tools:
            body["tools"] = prompt.tools
        url = self.settings.vllm_url.rstrip("/") + "/v1/chat/completions"
        headers = {"content-type": "application/json", "authorization": f"Bearer {self.vllm_key}"}
        async with (
            self.limit,
            session.post(url, data=orjson.dumps(body), headers=headers) as response,
        ):
            payload = await response.read()
            if response.status != 200:
                raise GateError(f"{served}: vLLM answered {response.status}: {payload[:200]!r}")
        try:
            choices = orjson.loads(payload).get("choices") or []
        except (orjson.JSONDecodeError, AttributeError) as exc:
            raise GateError(f"{served}: vLLM's reply is not a completion: {exc}") from exc
        if not choices:
            raise GateError(f"{served}: vLLM returned no choices")
        return answer_message(choices[0])

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
            verdict = await judge_scores(request_for, model, judge.judge_retries, limit=self.limit)
        except JudgeUnavailable:
            return None
        return verdict.scores

"""The promotion gate: does the candidate beat the live version on prompts it never trained on?

Both versions answer the same held-out prompts through vLLM (greedy by default, so a pair
differs only because the weights do). Each prompt gives one paired outcome for the candidate,
by the alias's reward: verifier, RULER in both presentation orders, both mixed, or the live
reward model (learner/gate_scoring.py). A candidate trained against a reward model can fool it,
so a feedback alias always goes through a canary that live ratings decide.

The pairs are answered in their drawn order, a wave of ``learner.gate_concurrency`` at a time
(so vLLM batches), and their outcomes feed a sequential test of the win rate against
``threshold`` (:mod:`ratchet.sequential`, with its look at the last pair): the gate stops as
soon as the test passes
(at least ``min_pairs`` pairs, false-promotion rate at most ``alpha``), fails (significantly
worse, or a pass is out of reach), or the drawn pairs run out. The verdict
(learner/gate_verdict.py) is pure, tested without a model.

A greedy gate asks the live version for each prompt's answer once and reuses it while that
version stays the incumbent: it is the same answer, and rejected rounds are gated against the
same version again and again (half of every later gate's answers).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from learner.gate_scoring import Answered, PairScorer, Scored
from learner.gate_scoring import GateError as GateError  # raised by both; callers catch it here
from learner.gate_verdict import GateResult, conclude, mean_or_none, score_lift, sequential_test
from ratchet.answer_length import auto_max_tokens
from ratchet.fleet import Replicas, conversation_key
from ratchet.gate_pairs import ANSWER_CHARS, KEPT, GatePair
from ratchet.records import HeldoutPrompt
from ratchet.replica_calls import call_timeout, never_connected, replica_fault
from ratchet.rewards.reward_model import RewardModels
from ratchet.rewards.reward_status import RewardStatus
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, GateConfig, RatchetSettings

log = logging.getLogger(__name__)

ANSWER_ATTEMPTS = 2  # per answer, against a dropped connection
KEPT_ANSWERS = 4096  # the live version's greedy answers kept (learner.heldout_pool is 1024)
LOSS = 0.0  # a pair's outcome when the candidate lost it


@dataclass(frozen=True)
class CandidateFailed:
    """vLLM refused or broke the candidate's answer to a held-out prompt."""

    why: str


def answer_max_tokens(config: AliasConfig, prompts: list[HeldoutPrompt]) -> int:
    """The gate's max_tokens: ``gate.max_tokens``, else ``sampling.max_tokens``, else drawn
    from the served answer lengths of the prompts drawn, as the judge draws a group's."""
    if config.gate.max_tokens is not None:
        return config.gate.max_tokens
    if config.sampling.max_tokens is not None:
        return config.sampling.max_tokens
    served = [p.served_output_tokens for p in prompts if p.served_output_tokens is not None]
    return auto_max_tokens(served, None, config.sampling.max_tokens_cap)


def answer_message(choice: dict[str, Any]) -> dict[str, Any]:
    """The parts of vLLM's answer that are the answer: role, content and tool calls."""
    message = choice.get("message") or {}
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return answer


def _text(answer: dict[str, Any]) -> str:
    return str(answer.get("content") or "")[:ANSWER_CHARS]


Progress = Callable[[int, int, float], None]


class Gate:
    """Answers held-out prompts with both versions through vLLM, then scores the pairs."""

    def __init__(
        self,
        settings: RatchetSettings,
        reward_models: RewardModels | None = None,
        reward_status: Callable[[str], RewardStatus | None] | None = None,
    ) -> None:
        self.settings = settings
        self.vllm_key = vllm_api_key(settings)  # vLLM's key, for its answers and as the judge
        self.limit = asyncio.Semaphore(settings.learner.gate_concurrency)
        self.scorer = PairScorer(settings, self.vllm_key, reward_models, reward_status)
        self.replicas = Replicas.from_settings(settings)
        # The incumbent's greedy answers, by (served name, prompt, max_tokens): cleared when
        # another version is the incumbent.
        self.incumbent_answers: dict[tuple[str, str, int | None], dict[str, Any]] = {}
        self.incumbent_reused = 0  # answers taken from it rather than asked of vLLM

    async def evaluate(
        self,
        alias: str,
        config: AliasConfig,
        prompts: list[HeldoutPrompt],
        candidate: str,
        incumbent: str,
        seed: int = 0,
        progress: Progress | None = None,
    ) -> GateResult:
        """``candidate`` and ``incumbent`` are served names (``alias@vN`` or the base model).
        ``progress(pairs scored, pairs drawn, running win rate)`` is called after each wave."""
        # A fresh limit per call: an asyncio.Semaphore is bound to the first event loop it waits
        # on, and the learner runs each round's gate in a new one (asyncio.run).
        self.limit = asyncio.Semaphore(self.settings.learner.gate_concurrency)
        self.scorer.limit = self.limit
        reward_model = self.scorer.begin(alias, config)
        wave = self.settings.learner.gate_concurrency
        gate = config.gate.model_copy(update={"max_tokens": answer_max_tokens(config, prompts)})
        config = config.model_copy(update={"gate": gate})
        test = sequential_test(config.gate, len(prompts))
        failed, cand_scores, inc_scores = 0, [], []
        sample: list[GatePair] = []
        timeout = call_timeout(
            self.settings.learner.gate_timeout_s, self.replicas.connect_timeout_s
        )
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for start in range(0, len(prompts), wave):
                batch = prompts[start : start + wave]
                scored_wave = await self._wave(session, config, batch, candidate, incumbent, seed)
                for prompt, scored in zip(batch, scored_wave, strict=True):
                    if scored.outcome is None:
                        failed += 1
                        continue
                    if scored.answers is not None and len(sample) < KEPT:
                        kept = GatePair(prompt.prompt_messages, *scored.answers, scored.outcome)
                        sample.append(kept)
                    if scored.candidate_score is not None:
                        cand_scores.append(scored.candidate_score)
                        inc_scores.append(scored.incumbent_score or 0.0)
                    if test.update(scored.outcome) != "continue":
                        break
                win_rate = test.total / test.n if test.n else 0.0
                log.info(
                    "gate %s vs %s: pair %d/%d, win rate %.3f, evidence %.2f of %.2f",
                    candidate,
                    incumbent,
                    test.n + failed,
                    len(prompts),
                    win_rate,
                    test.evidence,
                    test.threshold,
                )
                if progress is not None:
                    progress(test.n, len(prompts), win_rate)
                if test.decision != "continue":
                    break
        result = conclude(
            test,
            config.gate,
            len(prompts),
            mean_or_none(cand_scores),
            mean_or_none(inc_scores),
            failed,
            score_lift(cand_scores, inc_scores),
        )
        return replace(
            result, sample=tuple(sample), bill=self.scorer.bill, reward_model=reward_model
        )

    async def _wave(
        self,
        session: aiohttp.ClientSession,
        config: AliasConfig,
        prompts: list[HeldoutPrompt],
        candidate: str,
        incumbent: str,
        seed: int,
    ) -> list[Scored]:
        """Both versions' answers to ``prompts`` and each pair's outcome, in the drawn order."""
        pairs = await asyncio.gather(
            *(self._pair(session, p, config.gate, candidate, incumbent, seed) for p in prompts)
        )
        answered = [None if isinstance(a, CandidateFailed) else a for a in pairs]
        scored = await self.scorer.score(config, prompts, answered, seed)
        return [
            Scored(LOSS)  # the candidate could not answer: it lost this pair
            if isinstance(a, CandidateFailed)
            else s
            if a is None
            else replace(s, answers=(_text(a[0]), _text(a[1])))
            for s, a in zip(scored, pairs, strict=True)
        ]

    async def _pair(
        self,
        session: aiohttp.ClientSession,
        prompt: HeldoutPrompt,
        gate: GateConfig,
        candidate: str,
        incumbent: str,
        seed: int,
    ) -> Answered | CandidateFailed:
        """Both answers; :class:`CandidateFailed` when vLLM refused the candidate's answer but
        gave the live version's (its adapter would not load, or its answer broke): a loss, not a
        pair to leave out, or a candidate that fails where it would lose would pass. None when
        neither could be had (the network, or a prompt vLLM refuses whoever answers)."""
        answers: list[dict[str, Any] | Exception] = []
        for ask in (
            self._answer(session, candidate, prompt, gate, seed),
            self._incumbent_answer(session, incumbent, prompt, gate, seed),
        ):
            try:
                answers.append(await ask)
            except (aiohttp.ClientError, TimeoutError, GateError) as exc:
                answers.append(exc)
        mine, theirs = answers
        if isinstance(mine, GateError) and not isinstance(theirs, Exception):
            log.warning("gate: %s lost %s unanswered: %s", candidate, prompt.prompt_hash[:12], mine)
            return CandidateFailed(str(mine))
        if isinstance(mine, Exception) or isinstance(theirs, Exception):
            failure = mine if isinstance(mine, Exception) else theirs
            log.warning("gate: no answer pair for %s: %s", prompt.prompt_hash[:12], failure)
            return None
        return mine, theirs

    async def _incumbent_answer(
        self,
        session: aiohttp.ClientSession,
        served: str,
        prompt: HeldoutPrompt,
        gate: GateConfig,
        seed: int,
    ) -> dict[str, Any]:
        """The incumbent's answer; a greedy one is asked of vLLM once per prompt."""
        if gate.temperature > 0:
            return await self._answer(session, served, prompt, gate, seed)
        key = (served, prompt.prompt_hash, gate.max_tokens)
        if any(k[0] != served for k in itertools.islice(self.incumbent_answers, 1)):
            self.incumbent_answers.clear()  # another version is live now
        if key in self.incumbent_answers:
            self.incumbent_reused += 1
            return self.incumbent_answers[key]
        answer = await self._answer(session, served, prompt, gate, seed)
        if len(self.incumbent_answers) < KEPT_ANSWERS:
            self.incumbent_answers[key] = answer
        return answer

    async def _post_answer(
        self,
        session: aiohttp.ClientSession,
        base: str,
        body: dict[str, Any],
        headers: dict[str, str],
        served: str,
    ) -> bytes:
        """One answer of replica ``base``, its outcome told to the replicas: no connection, no
        answer within gate_timeout_s, or a 5xx counts toward its ejection
        (ratchet/replica_calls.py)."""
        try:
            async with (
                self.limit,
                session.post(
                    base + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
                ) as response,
            ):
                payload = await response.read()
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            if replica_fault(exc):
                self.replicas.failed(base, connected=not never_connected(exc))
            raise
        if response.status >= 500:
            self.replicas.failed(base, connected=True)
        elif response.status == 200:
            self.replicas.succeeded(base)
        if response.status != 200:
            raise GateError(f"{served}: vLLM answered {response.status}: {payload[:200]!r}")
        return payload

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
            if prompt.tool_choice is not None:
                body["tool_choice"] = prompt.tool_choice
        headers = {"content-type": "application/json", "authorization": f"Bearer {self.vllm_key}"}
        conversation = conversation_key(body)
        tried: list[str] = []  # replicas that could not be reached
        lost = 0  # connections lost on the way
        while True:
            # The replica the version's requests go to (ratchet/fleet.py), as the proxy's.
            async with self.replicas.use(served, exclude=tried, conversation=conversation) as base:
                try:
                    payload = await self._post_answer(session, base, body, headers, served)
                    break
                except aiohttp.ClientConnectionError as exc:
                    if never_connected(exc):  # vLLM never saw it: another replica may
                        tried.append(base)
                        if not self.replicas.may_retry(tried, served):
                            raise
                        continue
                    # Else a pooled keep-alive connection the server had closed ("Can not write
                    # request body"): seen losing one pair of a 96-pair gate; another answers.
                    # A timeout is not asked again: the answer's time is spent.
                    lost += 1
                    if isinstance(exc, TimeoutError) or lost >= ANSWER_ATTEMPTS:
                        raise
        try:
            choices = orjson.loads(payload).get("choices") or []
        except (orjson.JSONDecodeError, AttributeError) as exc:
            raise GateError(f"{served}: vLLM's reply is not a completion: {exc}") from exc
        if not choices:
            raise GateError(f"{served}: vLLM returned no choices")
        return answer_message(choices[0])

"""The one judge call: a RULER request to the judge model through litellm, retried until a reply
parses. The judge (scoring sampled groups) and the learner's gate (a candidate against the live
version) both call :func:`judge_scores`; what differs between them is a parameter: how each
attempt's request is built, a concurrency limit, a latency observer, or the attempt itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ratchet.bill import Bill
from ratchet.rewards.ruler import JudgeReplyError, JudgeRequest, JudgeScores, parse_judge_reply
from ratchet.settings import JudgeSettings

log = logging.getLogger(__name__)

# litellm would otherwise download its model price list at import; nothing here needs it.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

Attempt = Callable[[JudgeRequest], Awaitable[JudgeScores]]


class JudgeUnavailable(Exception):
    """No attempt gave a usable verdict; ``cause`` (a metric label) says why the last one failed:
    ``reply_<JudgeReplyError cause>``, ``judge_timeout`` or ``judge_unavailable``."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


@dataclass(frozen=True)
class JudgeModel:
    """Which model a judge call asks, where, and within which bounds: the same on every attempt."""

    model: str  # a litellm model id
    endpoint: dict[str, str]  # api_base and api_key, where they are set
    max_tokens: int
    timeout_s: float

    @classmethod
    def of(
        cls,
        settings: JudgeSettings,
        model: str,
        default_api_base: str,
        default_api_key: str | None = None,
    ) -> JudgeModel:
        return cls(
            model=model,
            endpoint=judge_endpoint(settings, model, default_api_base, default_api_key),
            max_tokens=settings.judge_max_tokens,
            timeout_s=settings.judge_timeout_s,
        )


def judge_endpoint(
    settings: JudgeSettings,
    judge_model: str,
    default_api_base: str,
    default_api_key: str | None = None,
) -> dict[str, str]:
    """Where litellm sends a judge call, and with which key.

    ``default_api_base`` is the vLLM Ratchet serves from and ``default_api_key`` the key it
    requires (ratchet.secrets.vllm_api_key). An explicit judge_api_base / judge_api_key wins.
    Otherwise a ``hosted_vllm/`` model is asked at ``default_api_base``, and a call to that base
    (by default or named explicitly) carries vLLM's key; that key never goes anywhere else. Any
    other provider is left to litellm's own defaults and environment (OPENAI_API_KEY, ...).
    """
    options: dict[str, str] = {}
    api_base = settings.judge_api_base
    if not api_base and judge_model.startswith("hosted_vllm/"):
        api_base = default_api_base
    if api_base:
        options["api_base"] = api_base
    if settings.judge_api_key:
        options["api_key"] = settings.judge_api_key.get_secret_value()
    elif default_api_key and api_base and _same_base(api_base, default_api_base):
        options["api_key"] = default_api_key
    elif judge_model.startswith("hosted_vllm/"):
        options["api_key"] = "unused"  # a vLLM without a key accepts any; litellm wants one
    return options


def _same_base(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def backoff_s(attempt: int) -> float:
    """The wait before retry ``attempt`` (1, 2, ...): exponential, capped at 8 s, with jitter so
    that replicas do not retry in lock-step."""
    return min(8.0, 0.5 * 2.0 ** (attempt - 1)) * (0.5 + random.random())


async def ask_judge_once(
    request: JudgeRequest,
    judge: JudgeModel,
    on_latency: Callable[[float], None] | None = None,
    bill: Bill | None = None,
) -> JudgeScores:
    """One attempt, no retry: the request out, the parsed reply back. Raises JudgeReplyError for
    a reply that cannot be trusted, TimeoutError, or whatever litellm raises. ``bill`` gets the
    call, its tokens and its price (a call that failed counts, with its seconds)."""
    import litellm  # heavy import, only where a judge call is made

    started = time.perf_counter()
    try:
        reply: Any = await asyncio.wait_for(
            litellm.acompletion(
                model=judge.model,
                messages=request.messages,
                response_format=request.response_format,
                temperature=0.0,
                max_tokens=judge.max_tokens,
                num_retries=0,  # retries are ours, with a fresh request each
                **judge.endpoint,
            ),
            timeout=judge.timeout_s,
        )
    except BaseException:
        if bill is not None:
            bill.add_judge_call(0, 0, 0.0, time.perf_counter() - started)
        raise
    elapsed = time.perf_counter() - started
    if on_latency is not None:
        on_latency(elapsed)
    if bill is not None:
        input_tokens, output_tokens = usage_of(reply)
        bill.add_judge_call(input_tokens, output_tokens, price_of(reply, judge.model), elapsed)
    return parse_judge_reply(reply.choices[0].message.content or "", request)


def usage_of(reply: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of a chat completion; 0 where the server did not say."""
    usage = getattr(reply, "usage", None)
    prompt = getattr(usage, "prompt_tokens", 0)
    completion = getattr(usage, "completion_tokens", 0)
    return (
        prompt if isinstance(prompt, int) else 0,
        completion if isinstance(completion, int) else 0,
    )


def price_of(reply: Any, model: str) -> float:
    """The call's price in USD from litellm's price map (bundled: no download); 0 for a model
    it has no price for, such as a local vLLM judge, whose cost is the device time the bill
    counts instead."""
    import litellm

    litellm.suppress_debug_info = True  # else it prints its provider list for each such model
    try:
        cost = litellm.completion_cost(completion_response=reply, model=model)
    except Exception:  # litellm raises for any model missing from its map
        return 0.0
    return float(cost) if isinstance(cost, int | float) and cost > 0 else 0.0


async def judge_scores(
    request_for: Callable[[int], JudgeRequest],
    judge: JudgeModel,
    retries: int,
    *,
    limit: asyncio.Semaphore | None = None,
    on_latency: Callable[[float], None] | None = None,
    attempt: Attempt | None = None,
    bill: Bill | None = None,
) -> JudgeScores:
    """The judge's verdict, after up to ``retries`` retries with backoff; JudgeUnavailable if no
    attempt gives one.

    ``request_for(n)`` builds the request of attempt n (0 first), so a retry can present the
    samples anew. ``limit`` is held for each attempt, never during a backoff. ``attempt``
    replaces :func:`ask_judge_once` (``on_latency`` and ``bill`` then go unused).
    """
    ask: Attempt = attempt or (lambda request: ask_judge_once(request, judge, on_latency, bill))
    cause = "judge_unavailable"
    for n in range(retries + 1):
        if n:
            await asyncio.sleep(backoff_s(n))
        request = request_for(n)
        try:
            async with limit or contextlib.nullcontext():
                return await ask(request)
        except JudgeReplyError as exc:
            cause = f"reply_{exc.cause}"
            log.info("judge reply rejected (%s), attempt %d", exc, n + 1)
        except TimeoutError:
            cause = "judge_timeout"
            log.info("judge call timed out after %.0f s, attempt %d", judge.timeout_s, n + 1)
        except Exception as exc:  # litellm raises many types; none may stop the caller
            cause = "judge_unavailable"
            log.warning(
                "judge call failed (%s: %s), attempt %d", type(exc).__name__, str(exc)[:200], n + 1
            )
    raise JudgeUnavailable(cause)

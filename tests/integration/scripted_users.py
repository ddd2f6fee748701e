"""Scripted users for the mechanics tests: prompts through the proxy with the official client,
each answer rated by a fixed rule, so every decision the loop takes is forced by the script.

Also the one wait these tests use for a decision: the first of several lifecycle events, any of
them terminal, so a wrong outcome fails at once instead of timing out on the right one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import openai

from ratchet.records import GROUPS_TOPIC, ScoredGroup
from ratchet.settings import RatchetSettings
from tests.integration.conftest import Embedded
from tests.integration.test_learner import history

# rate(prompt index, canary arm that answered, answer text) -> the user's rating, or None
Rule = Callable[[int, str, str], float | None]
# Bearer tokens, as users' apps send them; the session's proxy checks none, so all of them are
# one client (ANONYMOUS_CLIENT), whose ratings the canary takes uncapped.
KEYS = 8


def send(
    env: Embedded,
    alias: str,
    prompts: list[dict[str, Any]],
    rate: Rule | None = None,
    max_tokens: int = 8,
    concurrency: int = 8,
    first_user: int = 0,
) -> dict[str, int]:
    """Each prompt through the proxy (greedy), rated by ``rate`` when it gives a rating. Users
    are numbered from ``first_user`` (canary arms are sticky per user). Returns the answers each
    canary arm gave."""
    arms: dict[str, int] = {}

    async def run() -> None:
        clients = [
            openai.AsyncOpenAI(base_url=f"{env.proxy_url}/v1", api_key=f"user-{k}", max_retries=2)
            for k in range(KEYS)
        ]
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: dict[str, Any]) -> None:
            user = first_user + i
            client = clients[user % KEYS]
            async with limit:
                raw = await client.chat.completions.with_raw_response.create(
                    model=alias,
                    messages=prompt["messages"],
                    max_tokens=max_tokens,
                    temperature=0.0,
                    user=f"user-{user}",
                )
            arm = raw.headers["x-ratchet-canary-arm"]
            arms[arm] = arms.get(arm, 0) + 1
            answer = raw.parse()
            score = rate(i, arm, answer.choices[0].message.content or "") if rate else None
            if score is not None:
                await client.post(
                    "/feedback", body={"completion_id": answer.id, "score": score}, cast_to=object
                )

        try:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
    return arms


def canary_favoured(_: int, arm: str, __: str) -> float:
    """Users who like the canary: its answers 1, the live version's 0."""
    return 1.0 if arm == "canary" else 0.0


def canary_disliked(_: int, arm: str, __: str) -> float:
    """Users who dislike the canary: its answers 0, the live version's 1."""
    return 0.0 if arm == "canary" else 1.0


def first_event(
    settings: RatchetSettings, alias: str, kinds: set[str], timeout_s: float, after: int = 0
) -> dict[str, Any]:
    """The oldest of ``alias``'s lifecycle events of any of ``kinds`` beyond the first
    ``after`` of them (e.g. the second canary decision: after=1)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in reversed(history(settings, alias)) if e["kind"] in kinds]
        if len(found) > after:
            event: dict[str, Any] = found[after]
            return event
        time.sleep(0.2)
    raise TimeoutError(f"no {kinds} event for {alias} in {timeout_s}s: {history(settings, alias)}")


def rate_canary_until_decided(
    env: Embedded,
    settings: RatchetSettings,
    alias: str,
    prompts: list[dict[str, Any]],
    rate: Rule,
    batch: int = 32,
    decide_s: float = 15,
) -> tuple[dict[str, Any], dict[str, int]]:
    """Canary-time traffic, ``batch`` rated prompts at a time, until the canary is promoted or
    rolled back (the learner's canary watcher looks every 2 s; the ratings' sequential test
    decides all-1 against all-0 at about 15 pairs, so one batch of 32 usually does); the
    decision and the answers each arm gave. Fails once ``prompts`` run out undecided."""
    arms: dict[str, int] = {}
    for start in range(0, len(prompts), batch):
        sent = send(env, alias, prompts[start : start + batch], rate, first_user=1000 + start)
        for arm, n in sent.items():
            arms[arm] = arms.get(arm, 0) + n
        try:
            decided = first_event(settings, alias, {"promote", "rollback"}, decide_s)
        except TimeoutError:
            continue
        return decided, arms
    raise AssertionError(f"{alias}: canary undecided after {arms}: {history(settings, alias)}")


def judged_groups(env: Embedded, group_ids: list[str]) -> list[ScoredGroup]:
    """The judge's groups of these ids, from ratchet.groups."""
    wanted = set(group_ids)
    found = env.find_records(
        GROUPS_TOPIC,
        lambda r: isinstance(r, ScoredGroup) and r.group_id in wanted,
        count=len(wanted),
    )
    return [g for g in found if isinstance(g, ScoredGroup)]

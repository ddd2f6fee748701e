"""The loop learns from users' ratings alone: no verifier, no LLM judge.

Users are a script. They send the bulleted-list task's prompts through the proxy with the
official client and rate every answer through ``POST /v1/feedback`` by a criterion only the
script knows (the task's verifier, which no part of the loop is configured with). The alias says
only ``reward: {kind: feedback}``. The learner joins the ratings with the answers, trains a
reward model, and once its held-out AUC clears ``feedback.min_auc`` the judge scores groups with
it; a round trains, the gate compares with the reward model, and the canary is decided by the
users' live ratings. The promoted version is then compared with the base on prompts no part of
the loop saw, by the script's criterion.

An outcome test (tests/outcomes/conftest.py): ``scripts/test --outcomes`` runs it and reports
its figures (written to ``$RATCHET_OUTCOMES_DIR/ratings.json``, else beside the test's files).
The alias's settings are tuned for speed, not the shipped defaults (issue 35 is about learning
from ratings as fast on the defaults); TUNED lists them for the lane's summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from embedded.processes import Stack, free_port, wait_until
from embedded.stack import judge_part, learner_part
from ratchet.evaluation import paired_lift
from ratchet.registry import AliasRoute
from ratchet.rewards.reward_status import RewardStatus
from ratchet.settings import RatchetSettings, load_settings
from tasks.bullets import bullets_reward, generate_prompts, load_prompts
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.integration.test_learner import history, served_by, wait_for_event

pytestmark = [pytest.mark.integration, pytest.mark.outcome]

ALIAS = "lt-rated"
PROMPTS = load_prompts()
FIRST_TRAFFIC = PROMPTS[:192]  # rated; they train the reward model and fill the held-out pool
CANARY_TRAFFIC = PROMPTS[192:256]  # rated while a candidate is on canary
# The script's own evaluation: 320 prompts never sent through the proxy, from the same generator
# (480 took 164 s to answer greedily on this machine).
UNSEEN = generate_prompts(576)[256:]
GROUPS = 24
# The promoted version's greedy score by the users' criterion on UNSEEN must beat the base's:
# the paired lift's 95% bootstrap interval lies above zero and its mean is at least MARGIN.
# Measured: one round of 24 groups lifted +0.071 [+0.058, +0.084] on 480 prompts (runs on 64
# saw +0.037, +0.038, +0.027), a carried second round +0.086 [+0.063, +0.110] on 224. The
# per-prompt difference's sd is 0.15-0.18, so 320 prompts put the mean within about 0.02 of the
# truth; on 64, as before, within 0.044, and a 0.03 margin there failed a run that had learned.
MARGIN = 0.02
DEADLINE_S = 1800  # no new round of traffic after this: the 40 minutes include the last canary
BAR = (
    f"a promoted version's lift on {len(UNSEEN)} unseen prompts: 95% interval above 0 and "
    f"mean >= {MARGIN} within 40 min"
)
# What config_for sets that is not the default, for the lane's summary.
TUNED = (
    "tuned, not the defaults (issue 35): canary weight 0.5, min_requests 16, "
    "feedback_wait_s 60; retrain_every 96; heldout_fraction 0.5; gate alpha 0.2, 32-96 pairs"
)


def config_for(env: Embedded, home: Path) -> Path:
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)
    config["judge"] = {"consumer_group": "judge-rated", "metrics_port": free_port()}
    config["learner"] = {
        "consumer_group": "learner-rated",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        "batch_groups": GROUPS,
        "min_groups": GROUPS,
    }
    config["aliases"] = {
        ALIAS: {
            "base_model": BASE_MODEL,
            "reward": {"kind": "feedback"},
            "feedback": {"retrain_every": 96},
            # Half the prompts held out: the gate needs about 80 pairs to pass a 0.65 win rate
            # (a run with a quarter, 46-48 pairs, rejected 0.645 and 0.650 as futile).
            "learning": {"dedup_window_s": 0, "heldout_fraction": 0.5},
            # Alpha 0.2, not the default 0.05: rounds of 24 groups win about 0.6 of their pairs
            # here (runs saw 0.62, 0.59, 0.53, 0.61, 0.59), which 96 pairs pass at 0.05 two
            # rounds in three, at 0.2 six in seven (bench/gate_power.py, a quarter ties; before
            # the gate's last look, 0.28 and 0.58). What this test guards is the promoted
            # version's lift on prompts nothing saw (MARGIN), not the gate's power.
            "gate": {"min_pairs": 32, "max_pairs": 96, "alpha": 0.2},
            "canary": {
                "weight": 0.5,
                "min_requests": 16,
                "min_feedback": 8,
                "feedback_wait_s": 60,
            },
        }
    }
    path = home / "rated.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rated_alias_services(
    env: Embedded, config: Path, alias: str, home: Path
) -> tuple[RatchetSettings, Stack]:
    """``alias`` routed to the base model on the shared stack, and a judge and a learner of its
    own for it (not started yet)."""
    settings = load_settings(config)
    env.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    env.wait_for_proxy_route(alias)
    services = Stack([judge_part(settings, config), learner_part(settings, config)], home)
    return settings, services


def users(
    env: Embedded, prompts: list[dict[str, Any]], concurrency: int = 8, temperature: float = 1.0
) -> dict[str, int]:
    """Each prompt through the proxy, its answer rated by the users' hidden criterion. Users
    send eight bearer tokens, which the session's proxy (no auth) counts as one client. Returns
    the answers each canary arm gave."""
    arms: dict[str, int] = {}

    async def run() -> None:
        clients = [
            openai.AsyncOpenAI(base_url=f"{env.proxy_url}/v1", api_key=f"user-{u}", max_retries=2)
            for u in range(8)
        ]
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: dict[str, Any]) -> None:
            client = clients[i % len(clients)]
            async with limit:
                raw = await client.chat.completions.with_raw_response.create(
                    model=ALIAS,
                    messages=prompt["messages"],
                    max_tokens=64,
                    temperature=temperature,
                    user=f"user-{i}",
                )
            arm = raw.headers["x-ratchet-canary-arm"]
            arms[arm] = arms.get(arm, 0) + 1
            answer = raw.parse()
            score = bullets_reward(prompt["messages"], answer.choices[0].message.to_dict())
            await client.post(
                "/feedback", body={"completion_id": answer.id, "score": score}, cast_to=object
            )

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for client in clients:
            await client.close()

    asyncio.run(run())
    return arms


def wait_for_reward_model(env: Embedded, timeout_s: float) -> RewardStatus:
    client = redis.Redis.from_url(env.settings.redis_url)

    def usable() -> bool:
        status = RewardStatus.read(client, ALIAS)
        return status is not None and status.usable

    wait_until(usable, timeout_s, f"a usable reward model ({RewardStatus.read(client, ALIAS)})")
    status = RewardStatus.read(client, ALIAS)
    assert status is not None
    return status


def promote_next(
    embedded: Embedded,
    settings: RatchetSettings,
    started: float,
    count: int,
    figures: dict[str, Any],
) -> int:
    """Users come back until the ``count``-th candidate is on canary (a rejected candidate is
    part of learning), then rate its canary traffic; the candidate's version, once promoted.
    Every answer users get is rated: ``figures["ratings"]`` counts them."""
    outcome: list[dict[str, Any]] = []
    while not outcome and time.monotonic() - started < DEADLINE_S:
        users(embedded, FIRST_TRAFFIC[: GROUPS * 2], temperature=0.7)
        figures["ratings"] += GROUPS * 2
        try:
            outcome = wait_for_event(settings, ALIAS, {"canary"}, count=count, timeout_s=120)
        except TimeoutError:
            continue
    assert outcome, history(settings, ALIAS)
    candidate: int = outcome[0]["version"]
    progress(started, f"v{candidate} on canary")
    arms = users(embedded, CANARY_TRAFFIC, concurrency=16, temperature=0.0)
    figures["ratings"] += len(CANARY_TRAFFIC)
    assert arms.get("canary", 0) >= 16, arms
    decided = wait_for_event(settings, ALIAS, {"promote", "rollback"}, count=count, timeout_s=300)
    progress(started, f"canary v{candidate}: {decided[0]['detail'].get('reason')}")
    assert decided[0]["kind"] == "promote" and decided[0]["version"] == candidate, decided[0]
    if figures["minutes_to_first_promotion"] is None:
        figures["minutes_to_first_promotion"] = round((time.monotonic() - started) / 60, 2)
    return candidate


def progress(started: float, what: str) -> None:
    """One line of progress (the outcome lane shows the last one while the test runs)."""
    print(f"[{(time.monotonic() - started) / 60:5.1f} min] {what}", flush=True)


def write_figures(figures: dict[str, Any], tmp_path: Path, name: str = "ratings.json") -> Path:
    """The run's figures, for the outcome lane's summary and to compare runs."""
    folder = Path(os.environ.get("RATCHET_OUTCOMES_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(figures, indent=2))
    return path


def greedy_prompt_scores(
    env: Embedded,
    models: list[str],
    prompts: list[dict[str, Any]],
    reward: Callable[[list[dict[str, Any]], dict[str, Any]], float],
) -> list[list[float]]:
    """Each model's ``reward`` of its greedy answer to each prompt, straight from vLLM, in the
    prompts' order. The models answer side by side, so vLLM batches them together."""

    async def run(client: httpx.AsyncClient, limit: asyncio.Semaphore, model: str) -> list[float]:
        async def one(prompt: dict[str, Any]) -> float:
            body = {
                "model": model,
                "messages": prompt["messages"],
                "max_tokens": 64,
                "temperature": 0.0,
            }
            async with limit:
                reply = await client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            message = reply.json()["choices"][0]["message"]
            return reward(prompt["messages"], message)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def run_all() -> list[list[float]]:
        async with httpx.AsyncClient(
            base_url=env.settings.vllm_url, headers=env.vllm_headers, timeout=300
        ) as client:
            limit = asyncio.Semaphore(24 * len(models))
            return list(await asyncio.gather(*(run(client, limit, m) for m in models)))

    return asyncio.run(run_all())


def lift_on_unseen(embedded: Embedded, candidate: int) -> tuple[float, float, float]:
    """The paired lift of ``candidate`` over the base on UNSEEN by the users' criterion: its
    mean and 95% bootstrap interval."""
    evaluated = time.monotonic()
    base, better = greedy_prompt_scores(
        embedded, [BASE_MODEL, f"{ALIAS}@v{candidate}"], UNSEEN, bullets_reward
    )
    mean, low, high = paired_lift(better, base, samples=2000)
    print(
        f"unseen prompts, users' criterion: base {statistics.fmean(base):.3f}, "
        f"v{candidate} {statistics.fmean(better):.3f}, lift {mean:+.3f} [{low:+.3f}, {high:+.3f}] "
        f"({len(UNSEEN)} prompts in {time.monotonic() - evaluated:.0f} s)",
        flush=True,
    )
    return mean, low, high


# The bar of issue 14: within 40 minutes on the 2-core machine, a version is promoted that beats
# the base. A promotion whose lift is not shown is not failure either: the gate and canary
# compare with the live version (by the reward model and the users' ratings), so the loop goes
# on, users keep coming, and the next promoted version is measured (a run saw v1 0.641 on 96
# gate pairs, promoted, then not shown better on UNSEEN).
@pytest.mark.timeout(2400)
def test_the_loop_learns_from_ratings_alone(embedded: Embedded, tmp_path: Path) -> None:
    config = config_for(embedded, tmp_path)
    settings, services = rated_alias_services(embedded, config, ALIAS, tmp_path / "services")
    figures: dict[str, Any] = {
        "check": "ratings",
        "bar": BAR,
        "settings": TUNED,
        "passed": False,
        "ratings": 0,
        "minutes_to_first_promotion": None,
        "unseen_prompts": len(UNSEEN),
        "promotions": [],  # each promoted version's lift on UNSEEN: mean and 95% interval
    }
    services.start()
    started = time.monotonic()
    try:
        # Users' first answers, rated: the reward model's training data. Nothing can score a
        # group yet, so the judge only holds prompts out for the gate meanwhile.
        users(embedded, FIRST_TRAFFIC)
        figures["ratings"] += len(FIRST_TRAFFIC)
        status = wait_for_reward_model(embedded, timeout_s=600)
        figures["reward_model"] = {"version": status.version, "auc": status.auc}
        progress(started, f"reward model v{status.version}: {status.reason}")
        # The same users come back: now the judge samples groups and the reward model scores
        # them.
        promotions = 0
        while True:
            promotions += 1
            candidate = promote_next(embedded, settings, started, promotions, figures)
            assert served_by(embedded, ALIAS) == f"{ALIAS}@v{candidate}"
            mean, low, high = lift_on_unseen(embedded, candidate)
            figures["promotions"].append(
                {
                    "version": candidate,
                    "minutes": round((time.monotonic() - started) / 60, 2),
                    "lift": mean,
                    "lift_low": low,
                    "lift_high": high,
                }
            )
            if low > 0 and mean >= MARGIN:
                figures["passed"] = True
                break
            assert time.monotonic() - started < DEADLINE_S, (candidate, mean, low, high)
    finally:
        figures["minutes_run"] = round((time.monotonic() - started) / 60, 2)
        services.stop()
        progress(started, f"figures: {write_figures(figures, tmp_path)}")

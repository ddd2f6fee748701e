"""The loop learns from noisy users' ratings on the shipped defaults (issue 35's bar).

The alias says only ``reward: {kind: feedback}``: every learning, gate, canary and feedback
setting is the shipped default. Users send a bundled task's prompts through the proxy without
pause, eight at a time, and rate answers through ``POST /v1/feedback`` by the task's verifier,
which no part of the loop is given; but a fifth of them never rate, and the others
disagree with the rule by a normal error of ``DISAGREE`` (clipped to [0, 1]). After ``MINUTES``
of that, every promoted version is compared with the base on prompts never sent (the users'
rule, greedy answers), with its paired 95% interval. Once per task of ``RATED_TASKS``: a format
task and a correctness task, so that the feedback defaults are shown on more than the one they
were first measured on.

Bar: the first promotion within ``FIRST_PROMOTION_MIN`` minutes, and a version promoted within
``MINUTES`` whose lift is at least ``LIFT`` with its interval above 0. The figures
(``ratings_defaults_<task>.json``) also say where the learner's time went: reward-model training,
policy training and gates (the learner's own ``ratchet_learner_round_seconds``), and canaries
(from each canary's start to its decision).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from bench.loop_watch import metric, scrape
from embedded.processes import free_port, http_ok, wait_until
from ratchet.evaluation import paired_lift
from tasks import bullets, get_task, sorting
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.integration.test_learner import history
from tests.outcomes.test_learning_from_ratings import (
    greedy_prompt_scores,
    progress,
    rated_alias_services,
    write_figures,
)

pytestmark = [pytest.mark.integration, pytest.mark.outcome]

TRAFFIC_PROMPTS = 256  # a task's first prompts, sent again and again
UNSEEN_PROMPTS = 320  # the next ones, never sent: the lift is measured on them
MINUTES = 45.0
FIRST_PROMOTION_MIN = 25.0
LIFT = 0.1
NEVER_RATE = 0.2  # the share of users who never rate
# How far a rating strays from the rule (the sd of a normal error). Not "a tenth of the ratings
# say the opposite": most base answers score 0.25 on bullets and a good one is rare, so inverted
# ratings outnumbered the true good ones and a first run's reward models stayed at AUC 0.44-0.57
# through five retrains (292 ratings): no signal left to learn, on any settings.
DISAGREE = 0.1
USERS = 40
BAR = (
    f"first promotion within {FIRST_PROMOTION_MIN:g} min; a version promoted within "
    f"{MINUTES:g} min lifts {UNSEEN_PROMPTS} unseen prompts by >= {LIFT} (interval above 0)"
)
Rule = Callable[[list[dict[str, Any]], dict[str, Any]], float]


@dataclass(frozen=True)
class RatedTask:
    """A bundled task as its users see it: the prompts they send, those kept from the loop, and
    the rule they rate by (the task's verifier)."""

    name: str
    traffic: list[dict[str, Any]]
    unseen: list[dict[str, Any]]
    rule: Rule

    @property
    def alias(self) -> str:
        return f"lt-rated-defaults-{self.name}"


# Seeded generators: a longer list starts with the shorter one, so traffic is the task's own
# first prompts and the unseen ones follow them.
GENERATORS = {"bullets": bullets.generate_prompts, "sorting": sorting.generate_prompts}
RATED_TASKS = tuple(GENERATORS)


def rated_task(name: str) -> RatedTask:
    prompts = GENERATORS[name](TRAFFIC_PROMPTS + UNSEEN_PROMPTS)
    return RatedTask(
        name, prompts[:TRAFFIC_PROMPTS], prompts[TRAFFIC_PROMPTS:], get_task(name).reward()
    )


SETTINGS = (
    f"the shipped defaults; users: {NEVER_RATE:.0%} never rate, the others off the rule by "
    f"N(0, {DISAGREE:g}); traffic without pause"
)


def config_for(env: Embedded, home: Path, task: RatedTask) -> Path:
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)
    config["judge"] = {"consumer_group": f"judge-{task.alias}", "metrics_port": free_port()}
    config["learner"] = {
        "consumer_group": f"learner-{task.alias}",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
    }
    config["aliases"] = {task.alias: {"base_model": BASE_MODEL, "reward": {"kind": "feedback"}}}
    path = home / "rated-defaults.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rating_of(
    rng: random.Random, rule: Rule, prompt: dict[str, Any], answer: dict[str, Any]
) -> float:
    """The users' rule, as each user sees it."""
    score = rule(prompt["messages"], answer) + rng.gauss(0.0, DISAGREE)
    return min(1.0, max(0.0, score))


def noisy_users(
    env: Embedded, task: RatedTask, stop: threading.Event, counts: dict[str, int]
) -> None:
    """Users at work until ``stop``: each of the task's traffic prompts in turn, eight in
    flight."""

    async def run() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{env.proxy_url}/v1", api_key="user", max_retries=2, timeout=300
        )
        rng = random.Random(0)

        async def one(i: int) -> None:
            prompt, user = task.traffic[i % len(task.traffic)], i % USERS
            answer = await client.chat.completions.create(
                model=task.alias,
                messages=prompt["messages"],
                max_tokens=64,
                temperature=0.7,
                user=f"user-{user}",
            )
            counts["answered"] += 1
            if user < NEVER_RATE * USERS:
                return
            score = rating_of(rng, task.rule, prompt, answer.choices[0].message.to_dict())
            await client.post(
                "/feedback", body={"completion_id": answer.id, "score": score}, cast_to=object
            )
            counts["rated"] += 1

        async def worker(worker_id: int) -> None:
            for i in itertools.count(worker_id, 8):
                if stop.is_set():
                    return
                try:
                    await one(i)
                except openai.OpenAIError:  # counted; users come back once the proxy is up
                    counts["failed"] += 1
                    await asyncio.to_thread(proxy_up_or_stopped, env, stop)

        await asyncio.gather(*(worker(w) for w in range(8)))
        await client.close()

    asyncio.run(run())


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["ts"]).replace("Z", "+00:00")).timestamp()


def canary_seconds(events: list[dict[str, Any]]) -> float:
    """From each canary's start to its promotion or roll-back (a canary still running: none)."""
    total = 0.0
    ordered = sorted(events, key=_ts)
    for i, event in enumerate(ordered):
        if event["kind"] != "canary":
            continue
        end = next(
            (
                e
                for e in ordered[i + 1 :]
                if e["kind"] in ("promote", "rollback") and e.get("version") == event["version"]
            ),
            None,
        )
        if end is not None:
            total += _ts(end) - _ts(event)
    return total


def minutes_by_part(
    learner_metrics_url: str, alias: str, events: list[dict[str, Any]]
) -> dict[str, float]:
    """Where the learner's time went, in minutes."""
    samples = scrape(learner_metrics_url)
    phase = "ratchet_learner_round_seconds_sum"
    return {
        "reward_model_training": metric(samples, phase, alias=alias, phase="reward_model") / 60,
        "policy_training": metric(samples, phase, alias=alias, phase="train") / 60,
        "gate": metric(samples, phase, alias=alias, phase="gate") / 60,
        "canary": canary_seconds(events) / 60,
    }


def proxy_up_or_stopped(env: Embedded, stop: threading.Event) -> None:
    """After a failed request: until the proxy answers its health check again (or the run
    ends), polled, within the run's length."""
    healthz = f"{env.proxy_url}/healthz"
    wait_until(lambda: stop.is_set() or http_ok(healthz), MINUTES * 60, "the proxy healthy", 0.5)


def watch(settings: Any, alias: str, started: float) -> list[dict[str, Any]]:
    """The alias's events until MINUTES have passed, each new one printed as it comes."""
    deadline = started + MINUTES * 60
    events: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = len(events)

        def more(seen: int = seen) -> bool:
            return len(history(settings, alias)) > seen

        with contextlib.suppress(TimeoutError):  # polled: the next event, or the run's end
            wait_until(more, deadline - time.monotonic(), "the alias's next event", 2.0)
        events = sorted(history(settings, alias), key=_ts)
        for event in events[seen:]:
            detail = event.get("detail") or {}
            what = detail.get("reason") or (detail.get("gate") or {}).get("reason") or ""
            progress(started, f"{event['kind']} v{event.get('version')} {str(what)[:80]}")
    return events


@pytest.mark.timeout(int(MINUTES * 60) + 1800)
@pytest.mark.parametrize("task_name", RATED_TASKS)
def test_the_loop_learns_from_noisy_ratings_on_the_defaults(
    embedded: Embedded, tmp_path: Path, task_name: str
) -> None:
    task = rated_task(task_name)
    config = config_for(embedded, tmp_path, task)
    settings, services = rated_alias_services(embedded, config, task.alias, tmp_path / "services")
    figures: dict[str, Any] = {
        "check": "ratings-defaults",
        "task": task.name,
        "bar": BAR,
        "settings": SETTINGS,
        "passed": False,
        "minutes_to_first_promotion": None,
        "unseen_prompts": len(task.unseen),
        "promotions": [],
    }
    counts = {"answered": 0, "rated": 0, "failed": 0}
    stop = threading.Event()
    users = threading.Thread(target=noisy_users, args=(embedded, task, stop, counts), daemon=True)
    services.start()
    started = time.monotonic()
    start_ts = time.time()
    users.start()
    try:
        events = watch(settings, task.alias, started)
        figures["minutes_by_part"] = minutes_by_part(
            f"http://127.0.0.1:{settings.learner.metrics_port}/metrics", task.alias, events
        )
    finally:
        stop.set()
        users.join(timeout=120)
        figures |= {"ratings": counts["rated"], "traffic": dict(counts)}
        figures["minutes_run"] = round((time.monotonic() - started) / 60, 2)
        services.stop()
    promotions = [e for e in events if e["kind"] == "promote" and e.get("version")]
    if promotions:
        figures["minutes_to_first_promotion"] = round((_ts(promotions[0]) - start_ts) / 60, 2)
    # Every promoted version beside the base, answering side by side: vLLM batches them.
    served = [f"{task.alias}@v{e['version']}" for e in promotions]
    scores = greedy_prompt_scores(embedded, [BASE_MODEL, *served], task.unseen, task.rule)
    base = scores[0]
    for event, version_scores in zip(promotions, scores[1:], strict=True):
        mean, low, high = paired_lift(version_scores, base, samples=2000)
        figures["promotions"].append(
            {
                "version": event["version"],
                "minutes": round((_ts(event) - start_ts) / 60, 2),
                "score": statistics.fmean(version_scores),
                "lift": mean,
                "lift_low": low,
                "lift_high": high,
            }
        )
        progress(started, f"v{event['version']}: lift {mean:+.3f} [{low:+.3f}, {high:+.3f}]")
    figures["base_score"] = statistics.fmean(base)
    first = figures["minutes_to_first_promotion"]
    figures["passed"] = (
        first is not None
        and first <= FIRST_PROMOTION_MIN
        and any(p["lift"] >= LIFT and p["lift_low"] > 0 for p in figures["promotions"])
    )
    written = write_figures(figures, tmp_path, f"ratings_defaults_{task.name}.json")
    progress(started, f"figures: {written}")
    assert figures["passed"], figures

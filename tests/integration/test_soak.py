"""The chaos soak's short run (bench/soak.py runs the long one): traffic with ratings through
the session stack's proxy while its Redis, broker and log worker and a judge and learner of
the test's own are killed in turn, poison records on every consumed topic. Nothing answered
or rated may be lost. vLLM's outage and the 5 MB answer are left to test_faults and
test_proxy_openai, which check them for less time than a soak would spend."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml

from embedded.processes import Stack
from embedded.soak import Soak
from embedded.stack import judge_part, learner_part
from ratchet.records import GROUPS_TOPIC, TRAFFIC_TOPIC
from ratchet.settings import load_settings
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded, free_port

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]

FAULTS = ("log_worker", "redis", "broker", "judge", "learner")
SECONDS = 60
FAULT_EVERY_S = 10


def soak_config(env: Embedded, home: Path) -> Path:
    """The session stack's addresses; a judge sampling short answers for the session's alias
    and a learner that takes groups in but never trains in so short a run."""
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["judge"] = {"consumer_group": "judge-soak", "metrics_port": free_port()}
    config["learner"] = {
        "consumer_group": "learner-soak",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        "min_groups": 10_000,
        "batch_groups": 10_000,
    }
    config["aliases"] = {
        ALIAS: {
            "base_model": BASE_MODEL,
            "reward": {"kind": "verifier", "verifier": "tasks.demo:extraction_reward"},
            "learning": {"group_size": 2, "heldout_fraction": 0.3, "dedup_window_s": 0},
            "sampling": {"max_tokens": 8},
        }
    }
    path = home / "soak.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(900)
def test_a_short_chaos_soak_loses_nothing(base_route: Embedded, tmp_path: Path) -> None:
    env = base_route
    config = soak_config(env, tmp_path)
    settings = load_settings(config)
    services = Stack([judge_part(settings, config), learner_part(settings, config)], tmp_path)
    services.start()
    try:
        stacks = dict.fromkeys(("kafka", "redis", "vllm", "proxy"), env.stack)
        stacks |= {"judge": services, "learner": services}
        soak = Soak(
            settings,
            stacks,
            ALIAS,
            # Each of the five faults once: one per 10 s period, none in the last
            # (embedded/soak.py). 12 s periods would leave room for only four in 60 s.
            seconds=SECONDS,
            fault_every_s=FAULT_EVERY_S,
            hold_s=3,
            faults=FAULTS,
            huge_answer=False,
        )
        report = soak.run()
        learner = settings.learner
        metrics = httpx.get(f"http://127.0.0.1:{learner.metrics_port}/metrics").text
    finally:
        services.stop()
    print(report.to_json().split('"timeline"')[0])

    assert {f["part"] for f in report.faults} == set(FAULTS), report.faults
    assert all(f["ended"] is not None for f in report.faults), report.faults
    # The proxy kept answering through the run: answers in every period of traffic. A count
    # (50 answers here) would measure the host's speed: on one 2.7x slower, with a learner that
    # took 24 s to come back, the same run answered 48.
    answered_at = [e["t"] for e in report.timeline if e["status"] == 200]
    quiet = [
        period
        for period in range(SECONDS // FAULT_EVERY_S)
        if not any(period * FAULT_EVERY_S <= t < (period + 1) * FAULT_EVERY_S for t in answered_at)
    ]
    assert not quiet, f"no answer in periods {quiet} of {FAULT_EVERY_S} s: {answered_at}"
    # No vLLM outage here, so no request may fail at all.
    assert not report.failed, report.failed
    assert report.delivered == report.records_expected == report.answered
    assert not report.lost, report.lost
    assert report.ratings_accepted > 0 and not report.ratings_lost, report.ratings_lost
    # The judge and the learner dead-letter the poison on their topics and carry on; the
    # learner reads ratchet.heldout from its start after every restart, so it only counts it.
    for topic in (TRAFFIC_TOPIC, GROUPS_TOPIC):
        assert report.poison_dead_lettered.get(topic, 0) >= 1, report.poison_dead_lettered
    assert re.search(
        r'^ratchet_learner_failures_total\{alias="-",cause="heldout_malformed"\} [1-9]',
        metrics,
        re.M,
    ), metrics

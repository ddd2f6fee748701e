"""`ratchet demo` on the embedded stack: it replays the demo prompts through the proxy and rates
each answer with the demo verifier.

The loop itself is tested in two lanes. CI runs its mechanics with every decision forced
(tests/integration/test_loop_mechanics.py: judged traffic, a round with the default steps, the
gate, a canary settled by ratings, the new version served); whether a run of the loop learns, a
lift on unseen prompts with its interval, is the outcome lane's (``scripts/test --outcomes``,
bench/loop_speed.py on the shipped defaults).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, TrafficRecord, utc_now
from tasks.demo import extraction_reward, load_prompts
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded

pytestmark = pytest.mark.integration

PROMPTS = load_prompts()


def test_ratchet_demo_replays_prompts_and_rates_each_answer(base_route: Embedded) -> None:
    """`ratchet demo` itself: the prompts go through the proxy, the table shows the version that
    answered, and each answer's verifier score reaches ratchet.feedback for its completion."""
    embedded, count = base_route, 6
    since = utc_now()  # earlier tests in the session sent the same prompts to this alias
    command = ["demo", "--alias", ALIAS, "--count", str(count)]
    result = subprocess.run(
        [sys.executable, "-m", "cli", *command, "--config", str(embedded.config_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert BASE_MODEL in result.stdout and "failed" not in result.stdout, result.stdout

    sent = [p["messages"] for p in PROMPTS[:count]]
    traffic = embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: (
            isinstance(r, TrafficRecord)
            and r.alias == ALIAS
            and r.ts >= since
            and r.request.get("messages") in sent
        ),
        count=count,
    )
    assert len(traffic) >= count
    expected = {
        r.response_id: extraction_reward(r.request["messages"], r.choices[0]["message"])
        for r in traffic
        if isinstance(r, TrafficRecord)
    }
    rated = embedded.find_records(
        FEEDBACK_TOPIC,
        lambda r: isinstance(r, FeedbackRecord) and r.completion_id in expected,
        count=len(expected),
    )
    assert {r.completion_id: r.score for r in rated if isinstance(r, FeedbackRecord)} == expected

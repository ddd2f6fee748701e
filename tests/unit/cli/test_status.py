"""`ratchet status` against a real Redis: each alias's learner progress, or its absence."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

import cli  # noqa: F401  (registers the commands on the app)
from cli.app import app, console
from ratchet.progress import LearnerProgress, publish


@pytest.fixture
def configured(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    Path("ratchet.yaml").write_text(
        "aliases:\n  support: {base_model: base}\n  billing: {base_model: base}\n"
    )
    monkeypatch.setenv("RATCHET_REDIS_URL", redis_url)
    monkeypatch.setattr("cli.report.learner_lag", lambda settings: 0)  # no Kafka here
    return redis.Redis.from_url(redis_url)


def test_status_shows_each_aliases_learner_progress(
    configured: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = LearnerProgress(
        "support",
        phase="train",
        version=2,
        step=3,
        steps=4,
        detail="round 5: step 3/4 loss 0.1200, reward 0.500, 88.0 tokens/s",
        round_started_at=1.0,
    )
    publish(configured, progress)
    # The console's width was fixed when it was made (at import): widen it, or rich wraps cells.
    monkeypatch.setattr(console, "width", 400)
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    [support] = [line for line in result.output.splitlines() if "support" in line]
    assert "round from v2, train 3/4" in support
    assert "step 3/4 loss 0.1200, reward 0.500, 88.0 tokens/s" in support
    [billing] = [line for line in result.output.splitlines() if "billing" in line]
    assert "no learner progress" in billing  # never published (or expired)


def test_status_says_why_a_feedback_alias_waits_for_its_reward_model(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratchet.rewards.reward_status import RewardStatus

    Path("ratchet.yaml").write_text(
        "aliases:\n  rated:\n    base_model: base\n    reward: {kind: feedback}\n"
        "  judged: {base_model: base}\n"
    )
    monkeypatch.setenv("RATCHET_REDIS_URL", redis_url)
    monkeypatch.setattr("cli.report.learner_lag", lambda settings: 0)
    monkeypatch.setattr(console, "width", 400)
    client = redis.Redis.from_url(redis_url)
    from ratchet.registry import AliasRoute, RegistryWriter

    writer = RegistryWriter(redis_url, {})
    for alias in ("rated", "judged"):
        writer.write(AliasRoute(alias=alias, base_model="base"))

    def output() -> str:
        result = CliRunner().invoke(app, ["status"])
        assert result.exit_code == 0, result.output
        return result.output

    assert "waiting: no reward model yet (users' ratings are being collected)" in output()
    low = RewardStatus(2, usable=False, reason="held-out AUC 0.580 on 40 ratings, not above 0.65")
    low.write(client, "rated")
    assert "waiting: rated.reward@v2: held-out AUC 0.580" in output()
    RewardStatus(3, usable=True, reason="held-out AUC 0.810 on 52 ratings").write(client, "rated")
    text = output()
    assert "rewards from rated.reward@v3: held-out AUC 0.810" in text
    assert "reward model" not in next(line for line in text.splitlines() if "judged" in line)


def test_status_says_when_the_reward_guard_could_not_check_a_canary(
    configured: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit N-15: a canary the guard could not check (too few raters) said nothing; `ratchet
    status` now says so, for the canary and for the version it was promoted as."""
    from ratchet.registry import AliasRoute, RegistryWriter
    from ratchet.reward_guard_state import GuardResult, write_guard

    monkeypatch.setattr(console, "width", 400)
    writer = RegistryWriter(redis_url, {})
    writer.write(AliasRoute(alias="support", base_model="base", active=1, canary=2))
    writer.write(AliasRoute(alias="billing", base_model="base", active=1))
    said = "could not check: too few raters (4 < 10 held-out rated answers on the canary arm)"
    write_guard(configured, "support", 2, GuardResult("unchecked", said))

    def support_cell() -> str:
        result = CliRunner().invoke(app, ["status"])
        assert result.exit_code == 0, result.output
        return result.output

    assert f"reward guard on v2: {said}" in support_cell()
    writer.write(AliasRoute(alias="support", base_model="base", active=2))  # promoted
    assert f"reward guard on v2: {said}" in support_cell()
    writer.write(AliasRoute(alias="support", base_model="base", active=3))
    assert "reward guard" not in support_cell()  # a later version: not what it said of v3

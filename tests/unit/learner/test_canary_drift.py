"""Drift stops a running canary: a canary whose version's latest served drift is past the
tolerance is rolled back by the watcher, whatever its counts say, with a reason that names the
version; within the tolerance (or unmeasured) the counts decide as before. And the watcher keeps
the exclusions of routed versions alive (ratchet/version_exclusion.py)."""

from __future__ import annotations

from typing import Any

from learner.drift_state import keep_drift, latest_drift
from ratchet.lifecycle import Lifecycle
from ratchet.settings import RatchetSettings
from ratchet.version_exclusion import exclude, excluded_key
from tests.unit.learner.test_canary import (  # noqa: F401  (fixtures)
    ALIAS,
    LATE,
    age_canary,
    healthy_traffic,
    lifecycle,
    route_of,
    settings,
    start_canary,
    watcher_for,
)

REPLICA = "http://10.0.0.7:8000"


def drift_of(version: int, mean_abs: float) -> dict[str, Any]:
    """A round's drift record, as learner/drift.py keeps it (float32: tolerance 0.01)."""
    per_replica = {"mean_abs": mean_abs, "max_abs": 2 * mean_abs, "tokens": 600}
    return {
        "version": version,
        "precision": "float32",
        **per_replica,
        "replicas": {REPLICA: per_replica},
    }


def test_a_canary_whose_drift_goes_past_the_tolerance_is_rolled_back(
    settings: RatchetSettings,  # noqa: F811
    lifecycle: Lifecycle,  # noqa: F811
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)  # the counts alone would promote it now
    # A round that trains on from the canary measured its drift: past 0.01 per token.
    keep_drift(lifecycle.writer.redis, ALIAS, drift_of(2, 0.3))
    assert latest_drift(lifecycle.writer.redis, ALIAS, 2) == drift_of(2, 0.3)
    watcher.check()
    assert route_of(lifecycle) == (1, None)
    event = lifecycle.writer.history(ALIAS)[0]
    assert event["kind"] == "rollback" and event["previous_version"] == 2
    reason = event["detail"]["reason"]
    assert reason.startswith("served drift:") and "v2" in reason and "0.3000" in reason, reason
    rollbacks = watcher.metrics.registry.get_sample_value(
        "ratchet_learner_rollbacks_total", {"alias": ALIAS, "reason": "served drift"}
    )
    assert rollbacks == 1.0


def test_a_drift_within_the_tolerance_or_of_another_version_leaves_the_canary_to_its_counts(
    settings: RatchetSettings,  # noqa: F811
    lifecycle: Lifecycle,  # noqa: F811
) -> None:
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)
    keep_drift(lifecycle.writer.redis, ALIAS, drift_of(2, 0.001))
    keep_drift(lifecycle.writer.redis, ALIAS, drift_of(1, 0.3))  # the active one's: not this
    watcher.check()
    assert route_of(lifecycle) == (2, None)  # promoted
    assert lifecycle.writer.history(ALIAS)[0]["kind"] == "promote"


def test_drift_with_the_served_check_off_does_not_stop_the_canary(
    settings: RatchetSettings,  # noqa: F811
    lifecycle: Lifecycle,  # noqa: F811
) -> None:
    settings.learner.served_check.enabled = False
    start_canary(lifecycle)
    watcher = watcher_for(settings, lifecycle)
    watcher.count(healthy_traffic(10))
    age_canary(lifecycle, LATE)
    keep_drift(lifecycle.writer.redis, ALIAS, drift_of(2, 0.3))
    watcher.check()
    assert route_of(lifecycle) == (2, None)


def test_the_watcher_renews_the_exclusions_of_routed_versions_only(
    settings: RatchetSettings,  # noqa: F811
    lifecycle: Lifecycle,  # noqa: F811
) -> None:
    client = lifecycle.writer.redis
    start_canary(lifecycle)
    for version in (1, 2, 3):  # active, canary, and one no longer routed
        exclude(client, ALIAS, version, {REPLICA: "cannot serve it"}, ttl_s=60)
    watcher = watcher_for(settings, lifecycle)
    watcher._last_check = 0.0
    watcher.tick()
    ttl = settings.learner.served_check.exclusion_ttl_s
    assert client.ttl(excluded_key(ALIAS, 1)) > 60
    assert ttl - 60 < client.ttl(excluded_key(ALIAS, 2)) <= ttl
    assert client.ttl(excluded_key(ALIAS, 3)) <= 60  # lapses: v3 left the registry

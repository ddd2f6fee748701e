"""Each version's latest served drift (learner/drift.py), kept where the canary watcher reads it.

A round measures the drift of the version it starts from, which is the alias's canary when the
round trains on from it (ratchet/carry.py): that round's candidate is held until the canary
ends, so its ``ratchet.json`` comes too late to stop the canary. The round keeps the record here
as soon as it is measured, ``ratchet:served_drift:<alias>`` (a hash of version to the record as
the candidate's ``ratchet.json`` keeps it, ``DRIFT_KEEP_S`` to live from its last write), and the
watcher (learner/canary.py) rolls back a canary whose latest drift is past the tolerance, with
:func:`learner.drift.drift_block`'s reason, which names the version and the replica.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from learner.drift import drift_block
from ratchet.settings import RatchetSettings

log = logging.getLogger(__name__)

# Longer than any canary runs (canary.feedback_wait_s): a record is only read while one does.
DRIFT_KEEP_S = 7 * 24 * 3600


def drift_key(alias: str) -> str:
    return f"ratchet:served_drift:{alias}"


def keep_drift(client: redis.Redis, alias: str, record: dict[str, Any] | None) -> None:
    """The round's drift ``record`` as its version's latest; losing it loses only the check of
    a canary on that version (logged)."""
    if not record or not isinstance(record.get("version"), int):
        return
    try:
        pipe = client.pipeline(transaction=True)
        pipe.hset(drift_key(alias), str(record["version"]), json.dumps(record))
        pipe.expire(drift_key(alias), DRIFT_KEEP_S)
        pipe.execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("%s: the drift of v%s was not kept: %s", alias, record["version"], exc)


def latest_drift(client: redis.Redis, alias: str, version: int) -> dict[str, Any] | None:
    raw = client.hget(drift_key(alias), str(version))
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def canary_drift_block(
    client: redis.Redis, alias: str, canary: int, settings: RatchetSettings
) -> str | None:
    """Why the canary must not be promoted: its version's latest drift past the tolerance (the
    reason names the replica); None when within it, not measured, or the check is off."""
    if not settings.learner.served_check.enabled:
        return None
    return drift_block(latest_drift(client, alias, canary), settings)

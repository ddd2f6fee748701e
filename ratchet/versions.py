"""Version numbers, and the queue of imported versions waiting for their gate.

Two writers hand out versions of an alias: the learner (a round's candidate) and `ratchet import`
(an adapter trained elsewhere). Both take the next number from one Redis counter, so no two ever
write the same folder. An imported version is written to the store by the CLI and queued here;
the learner holding the alias's lease gates it like a round's candidate and takes it off the
queue in the transaction that stores the outcome.
"""

from __future__ import annotations

from typing import Any

import redis

from ratchet.store import AdapterStore


def next_version_key(alias: str) -> str:
    return f"ratchet:learner:{alias}:next_version"


def imports_key(alias: str) -> str:
    """List of imported versions waiting for their gate, oldest first."""
    return f"ratchet:learner:{alias}:imports"


# KEYS[1]: the counter; ARGV[1]: the highest version in the store. Returns the new version.
NEXT_VERSION_SCRIPT = """
local version = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if version <= floor then
  version = floor + 1
  redis.call('SET', KEYS[1], version)
end
return version
"""


def next_version(client: redis.Redis, store: AdapterStore, alias: str) -> int:
    """A version number no other writer will use, above any in the store. One script, so the
    counter only ever moves up: a writer that finds it behind the store (Redis lost it) lifts
    it, and never sets it back below what another has taken since."""
    existing = max(store.versions(alias), default=0)
    return int(client.eval(NEXT_VERSION_SCRIPT, 1, next_version_key(alias), existing))


def queue_import(pipe: Any, alias: str, version: int) -> None:
    """Queue a version for its gate (in the transaction that records its candidate event)."""
    pipe.rpush(imports_key(alias), version)


def queued_imports(client: redis.Redis, alias: str) -> list[int]:
    """The alias's imported versions waiting for their gate, oldest first."""
    values: list[Any] = client.lrange(imports_key(alias), 0, -1)
    texts = [v.decode() if isinstance(v, bytes) else str(v) for v in values]
    return [int(t) for t in texts if t.isdigit()]


def unqueue_import(pipe: Any, alias: str, version: int) -> None:
    """Take a version off the queue (in the transaction that stores its outcome)."""
    pipe.lrem(imports_key(alias), 0, version)

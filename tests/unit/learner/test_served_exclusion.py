"""What the served check does with each failure (learner/served_check.py, learner/gating.py): a
replica past the tolerance rejects the candidate, naming it; one that cannot load the candidate
is out of that version's rotation (kept in Redis, told to the gate's own replicas) and the
candidate goes on; none that can serve it rejects it, naming them all."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import redis

from learner.fingerprint import Distance
from learner.gating import exclude_unloaded, load_exclusions
from learner.served_check import ReplicaCheck, ServedVerdict
from ratchet.fleet import Replicas
from ratchet.registry import CHANNEL
from ratchet.settings import RatchetSettings
from ratchet.version_exclusion import exclude, excluded_key, read_excluded

GOOD, BAD, FAR = "http://a:8000", "http://b:8000", "http://c:8000"
LIMIT = 0.01


def match(url: str) -> ReplicaCheck:
    return ReplicaCheck(url, "match", Distance(0.001, 0.002, 10))


def unloaded(url: str) -> ReplicaCheck:
    return ReplicaCheck(url, "unloaded", detail="HTTP 404 The model `support@v3` does not exist")


def mismatch(url: str) -> ReplicaCheck:
    return ReplicaCheck(url, "mismatch", Distance(0.5, 0.9, 10))


def test_a_replica_that_cannot_load_the_candidate_is_left_out_and_the_rest_serve_it() -> None:
    verdict = ServedVerdict("support@v3", (match(GOOD), unloaded(BAD)), LIMIT)
    assert verdict.passed
    assert [c.replica for c in verdict.excluded] == [BAD]
    assert verdict.reason.startswith("served check of support@v3: out of its rotation: ")
    assert f"{BAD} cannot serve it: HTTP 404" in verdict.reason and GOOD not in verdict.reason


def test_a_mismatch_rejects_the_candidate_whatever_the_others_do() -> None:
    verdict = ServedVerdict("support@v3", (match(GOOD), unloaded(BAD), mismatch(FAR)), LIMIT)
    assert not verdict.passed and verdict.excluded == ()
    assert f"{FAR} serves other weights" in verdict.reason
    assert f"{BAD} cannot serve it" in verdict.reason and GOOD not in verdict.reason


def test_no_replica_that_can_serve_it_rejects_it_naming_them_all() -> None:
    verdict = ServedVerdict("support@v3", (unloaded(GOOD), unloaded(BAD)), LIMIT)
    assert not verdict.passed and verdict.excluded == ()
    assert "no replica can serve it" in verdict.reason
    assert GOOD in verdict.reason and BAD in verdict.reason
    assert ServedVerdict("s", (match(GOOD),), LIMIT).reason.endswith("every replica matches")


def rounds_of(redis_url: str, tmp_path: Path) -> SimpleNamespace:
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path)
    return SimpleNamespace(
        settings=settings,
        redis=redis.Redis.from_url(redis_url),
        gate=SimpleNamespace(replicas=Replicas([GOOD, BAD], resolve=False)),
    )


def test_the_exclusion_is_kept_published_and_given_to_the_gate(
    redis_url: str, tmp_path: Path
) -> None:
    rounds = rounds_of(redis_url, tmp_path)
    pubsub = rounds.redis.pubsub()
    pubsub.subscribe(CHANNEL)
    verdict = ServedVerdict("support@v3", (match(GOOD), unloaded(BAD)), LIMIT)
    assert exclude_unloaded(rounds, "support", 3, verdict) is None  # type: ignore[arg-type]
    kept = read_excluded(rounds.redis, "support", 3)
    assert list(kept) == [BAD] and "HTTP 404" in kept[BAD]
    ttl = rounds.settings.learner.served_check.exclusion_ttl_s
    assert ttl - 60 < rounds.redis.ttl(excluded_key("support", 3)) <= ttl
    assert rounds.gate.replicas.exclusions.barred("support@v3") == {BAD}
    messages = [pubsub.get_message(timeout=1) for _ in range(2)]
    assert any(m and m["type"] == "message" and m["data"] == b"support" for m in messages)
    # Nothing to leave out: nothing written.
    every = ServedVerdict("support@v4", (match(GOOD), match(BAD)), LIMIT)
    assert exclude_unloaded(rounds, "support", 4, every) is None  # type: ignore[arg-type]
    assert not rounds.redis.exists(excluded_key("support", 4))


def test_an_exclusion_that_cannot_be_kept_stops_the_candidate(tmp_path: Path) -> None:
    rounds = rounds_of("redis://127.0.0.1:1/0", tmp_path)  # nothing listens there
    verdict = ServedVerdict("support@v3", (match(GOOD), unloaded(BAD)), LIMIT)
    blocked = exclude_unloaded(rounds, "support", 3, verdict)  # type: ignore[arg-type]
    assert blocked is not None and "the exclusion was not kept" in blocked and BAD in blocked
    assert rounds.gate.replicas.exclusions.barred("support@v3") == frozenset()


def test_the_gate_loads_the_active_versions_exclusions_too(redis_url: str, tmp_path: Path) -> None:
    """A restarted learner's gate knows nothing; the active version's exclusion (an earlier
    round's) and the candidate's are read from Redis before it asks for either."""
    rounds = rounds_of(redis_url, tmp_path)
    exclude(rounds.redis, "restarted", 2, {BAD: "HTTP 404"}, ttl_s=3600)
    exclude(rounds.redis, "restarted", 3, {GOOD: "HTTP 400"}, ttl_s=3600)
    load_exclusions(rounds, "restarted", (2, 3))  # type: ignore[arg-type]
    assert rounds.gate.replicas.exclusions.barred("restarted@v2") == {BAD}
    assert rounds.gate.replicas.exclusions.barred("restarted@v3") == {GOOD}
    # Redis away: what the gate knew stays.
    away = rounds_of("redis://127.0.0.1:1/0", tmp_path)
    away.gate.replicas.exclusions.add("restarted", 3, {GOOD: "HTTP 400"})
    load_exclusions(away, "restarted", (2, 3))  # type: ignore[arg-type]
    assert away.gate.replicas.exclusions.barred("restarted@v3") == {GOOD}

"""Where a candidate stands (learner/candidate.py): the moves the lifecycle allows and no other,
pure; then kept in Redis, moved in a transaction's pipeline, and read back by a canary's end."""

from __future__ import annotations

import itertools

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter

from learner.candidate import (
    KEEP_SETTLED,
    MOVES,
    Candidate,
    Candidates,
    Stage,
    WrongMove,
    after_route,
    candidates_key,
    move,
)
from ratchet.registry import AliasRoute

ALIAS = "support"

# Every path a candidate may take, start to end.
PATHS = [
    [Stage.TRAINED, Stage.GATING, Stage.CANARY, Stage.PROMOTED],
    [Stage.TRAINED, Stage.GATING, Stage.CANARY, Stage.REJECTED],
    [Stage.TRAINED, Stage.GATING, Stage.PROMOTED],
    [Stage.TRAINED, Stage.GATING, Stage.REJECTED],
    [Stage.TRAINED, Stage.HELD, Stage.GATING, Stage.CANARY],
    [Stage.TRAINED, Stage.HELD, Stage.REJECTED],
    [Stage.TRAINED, Stage.REJECTED],
]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(p))
def test_a_candidate_moves_along_the_lifecycle(path: list[Stage]) -> None:
    candidate = Candidate(ALIAS, 3, 2, group_ids=("g1",))
    for stage in path[1:]:
        candidate = move(candidate, stage, now=1.0)
    assert candidate.stage == path[-1] and candidate.updated_at == 1.0
    assert candidate.settled == (path[-1] in (Stage.PROMOTED, Stage.REJECTED))


def test_no_other_move_is_allowed() -> None:
    allowed = {(a, b) for a, targets in MOVES.items() for b in targets}
    for a, b in itertools.product(Stage, Stage):
        candidate = Candidate(ALIAS, 3, 2, stage=a)
        if (a, b) in allowed:
            assert move(candidate, b).stage == b
        else:
            with pytest.raises(WrongMove, match=f"{a} -> {b}"):
                move(candidate, b)
    # Nothing moves a settled candidate; a held one is never served before its gate.
    assert not MOVES[Stage.PROMOTED] and not MOVES[Stage.REJECTED]
    assert Stage.CANARY not in MOVES[Stage.HELD] and Stage.PROMOTED not in MOVES[Stage.TRAINED]


def test_a_canary_s_end_is_read_from_the_route() -> None:
    canary = Candidate(ALIAS, 3, 2, stage=Stage.CANARY)
    still = AliasRoute(alias=ALIAS, base_model="b", active=2, canary=3)
    assert after_route(canary, still) is None
    promoted = after_route(canary, AliasRoute(alias=ALIAS, base_model="b", active=3))
    assert promoted is not None and promoted.stage == Stage.PROMOTED
    rolled_back = after_route(canary, AliasRoute(alias=ALIAS, base_model="b", active=2))
    assert rolled_back is not None and rolled_back.stage == Stage.REJECTED
    assert rolled_back.reason == "its canary was rolled back"
    held = Candidate(ALIAS, 4, 3, stage=Stage.HELD)
    assert after_route(held, AliasRoute(alias=ALIAS, base_model="b", active=3)) is None


def test_the_json_round_trips() -> None:
    candidate = Candidate(ALIAS, 3, 2, Stage.HELD, "round", ("g1", "g2"), {"loss": None}, {})
    assert Candidate.from_json(candidate.to_json()) == candidate


# --- kept in Redis ------------------------------------------------------------------------------


def test_candidates_are_kept_moved_and_pruned_in_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    book = Candidates(client)
    book.add(Candidate(ALIAS, 1, 0, group_ids=("g1",)))
    assert book.begin_gate(ALIAS, 1, 0).stage == Stage.GATING
    assert book.begin_gate(ALIAS, 1, 0).stage == Stage.GATING  # gated again after a restart
    with client.pipeline() as pipe:  # in a lifecycle change's transaction
        pipe.multi()
        book.move(ALIAS, 1, Stage.CANARY, pipe=pipe)
        assert book.get(ALIAS, 1).stage == Stage.GATING  # type: ignore[union-attr]
        pipe.execute()
    assert book.get(ALIAS, 1).stage == Stage.CANARY  # type: ignore[union-attr]
    with pytest.raises(WrongMove):
        book.move(ALIAS, 1, Stage.HELD)
    assert book.move(ALIAS, 9, Stage.GATING) is None  # none stored: one from before the record

    [moved] = book.follow_route([AliasRoute(alias=ALIAS, base_model="b", active=1)])
    assert (moved.version, moved.stage) == (1, Stage.PROMOTED)
    assert book.open(ALIAS) == []

    for version in range(2, KEEP_SETTLED + 5):
        book.add(Candidate(ALIAS, version, 1))
        book.drop(ALIAS, version, "dropped: a test")
    book.add(Candidate(ALIAS, 99, 1, Stage.HELD))
    stored = book.all(ALIAS)
    assert [c.version for c in stored if c.settled] == list(range(5, KEEP_SETTLED + 5))
    assert [c.version for c in book.open(ALIAS)] == [99]  # the open one is never pruned
    assert client.hlen(candidates_key(ALIAS)) == KEEP_SETTLED + 1


def test_orphans_of_rounds_are_dropped_and_imports_and_held_ones_kept(redis_url: str) -> None:
    book = Candidates(redis.Redis.from_url(redis_url))
    book.add(Candidate(ALIAS, 1, 0))  # trained, its round killed before its gate
    book.add(Candidate(ALIAS, 2, 0, Stage.GATING))  # killed mid-gate
    book.add(Candidate(ALIAS, 3, 0, Stage.GATING, origin="import"))  # the queue gates it again
    book.add(Candidate(ALIAS, 4, 0, Stage.HELD))  # settled once its canary ends
    assert [c.version for c in book.drop_orphans(ALIAS)] == [1, 2]
    assert [(c.version, c.stage) for c in book.open(ALIAS)] == [
        (3, Stage.GATING),
        (4, Stage.HELD),
    ]
    assert book.get(ALIAS, 1).reason == "no outcome: its round did not finish"  # type: ignore[union-attr]
    assert book.drop(ALIAS, 1, "again") is not None  # settled already: left as it is
    assert book.get(ALIAS, 1).reason == "no outcome: its round did not finish"  # type: ignore[union-attr]


def test_where_the_lifecycle_moved_the_record_follows_even_from_a_wrong_stage(
    redis_url: str,
) -> None:
    errors = Counter("record_errors", "test", ("alias",), registry=CollectorRegistry())
    book = Candidates(redis.Redis.from_url(redis_url), errors)
    book.add(Candidate(ALIAS, 1, 0, Stage.HELD))  # the lifecycle promotes it: a bookkeeping bug
    with pytest.raises(WrongMove):  # a direct caller's move stays strict
        book.move(ALIAS, 1, Stage.PROMOTED)
    moved = book.reached(ALIAS, 1, Stage.PROMOTED)
    assert moved is not None and book.get(ALIAS, 1) == moved and moved.stage == Stage.PROMOTED
    assert errors.labels(ALIAS)._value.get() == 1
    book.add(Candidate(ALIAS, 2, 0, Stage.GATING))
    assert book.reached(ALIAS, 2, Stage.REJECTED, "worse").reason == "worse"  # type: ignore[union-attr]
    assert errors.labels(ALIAS)._value.get() == 1  # a move of the lifecycle: no error
    assert book.reached(ALIAS, 9, Stage.PROMOTED) is None  # none stored

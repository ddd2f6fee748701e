"""A round's steps around the trainer and the gate, against a real Redis and adapter store: what it
writes, what it asks the gate, and how each outcome is stored. The trainer is a stand-in (training
itself is tests/unit/learner/test_trainer.py) and the gate's verdict is scripted (test_gate.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka.errors import KafkaError
from kafka.structs import TopicPartition

from learner.candidate import Candidate, Stage
from learner.gate import GateError
from learner.gate_verdict import GateResult
from learner.heldout import HeldoutPool
from learner.parallel import Ranks
from learner.round import RoundReport, Rounds, trained_key
from learner.service import LearnerService
from learner.trainer import RoundStats, StepCallback, StepProgress
from ratchet.canary_state import read_counts
from ratchet.carry import Carry, read_carry
from ratchet.progress import LearnerProgress, read_progress
from ratchet.records import GROUPS_TOPIC, HeldoutPrompt, ScoredGroup
from ratchet.registry import AliasRoute
from ratchet.settings import (
    AliasConfig,
    CanaryConfig,
    GateConfig,
    LearnerSettings,
    RatchetSettings,
    ServedCheckSettings,
)

ALIAS = "support"


class StandInTrainer:
    """What a round asks of LoraGRPOLearner, without a model."""

    def __init__(self) -> None:
        self.loaded: list[Path | None] = []
        self.trained: list[list[str]] = []
        self.fail: Exception | None = None
        self.ranks = Ranks()  # one process

    def load_adapter(self, folder: Path | None) -> None:
        self.loaded.append(folder)

    def train_round(
        self, groups: list[ScoredGroup], on_step: StepCallback | None = None
    ) -> RoundStats:
        self.trained.append([g.group_id for g in groups])
        if self.fail is not None:
            raise self.fail
        for k in (1, 2):
            if on_step is not None:
                on_step(StepProgress(1, k, 2, loss=0.5 / k, reward=0.25, completion_tokens=20 * k,
                                     seconds=1.0 * k))  # fmt: skip
        nan = float("nan")
        return RoundStats(
            round=1, steps=2, groups=len(groups), groups_skipped=0, samples=2 * len(groups),
            mean_reward=0.25, loss=nan, policy_loss=nan, kl=None, ratio_mean=1.0, ratio_min=1.0,
            ratio_max=1.0, clip_frac_low=0.0, clip_frac_high=0.0, approx_kl=0.0, epochs=1,
            stopped=None,
            grad_norm=0.1, steps_skipped=0,
            completion_tokens=40, total_tokens=100, seconds=2.0,
        )  # fmt: skip

    def save_candidate(
        self, store: Any, alias: str, version: int, parent: int, meta: dict[str, Any]
    ) -> Path:
        def write(folder: Path) -> None:
            (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))

        return store.write(alias, version, write, "/base", {"parent_version": parent, **meta})


def group(gid: str, version: int = 0) -> ScoredGroup:
    return ScoredGroup(
        group_id=gid,
        alias=ALIAS,
        version=version,
        response_model="base" if version == 0 else f"{ALIAS}@v{version}",
        prompt_messages=[{"role": "user", "content": gid}],
        prompt_token_ids=[1, 2],
        samples=[],
        rewards=[0.0, 1.0],
        traffic_request_id=f"req-{gid}",
    )


def heldout(h: str) -> HeldoutPrompt:
    return HeldoutPrompt(
        prompt_hash=h,
        alias=ALIAS,
        prompt_messages=[{"role": "user", "content": h}],
        traffic_request_id=h,
    )


def pool_of(*hashes: str) -> HeldoutPool:
    pool = HeldoutPool(capacity=1000)
    for h in hashes:
        pool.add(heldout(h))
    return pool


def verdict(passed: bool) -> GateResult:
    return GateResult(passed, "scripted", 3, 0.9 if passed else 0.2, 0.8, 1.0, 0.5, 2)


def make_rounds(redis_url: str, tmp_path: Path, canary_weight: float) -> Rounds:
    return make_service(redis_url, tmp_path, canary_weight).rounds


def make_service(
    redis_url: str, tmp_path: Path, canary_weight: float, **learner: Any
) -> LearnerService:
    settings = RatchetSettings(
        redis_url=redis_url,
        home=tmp_path,
        kafka_bootstrap_servers="127.0.0.1:1",  # never reached: no Kafka in these tests
        aliases={
            ALIAS: AliasConfig(
                base_model="base",
                gate=GateConfig(min_pairs=2, max_pairs=2),
                canary=CanaryConfig(weight=canary_weight),
            )
        },
        # The stand-in trainer has no model and no vLLM answers here: served equals trained
        # is tests/unit/learner/test_fingerprint.py and tests/integration/test_served_check.py.
        learner=LearnerSettings(**{"served_check": ServedCheckSettings(enabled=False), **learner}),
    )
    service = LearnerService(settings, base_model_path=Path("unused"))
    service.lifecycle.sink = None  # Redis history only
    service.rounds._trainer = StandInTrainer()  # type: ignore[assignment]
    return service


def script_gate(
    rounds: Rounds, monkeypatch: pytest.MonkeyPatch, outcome: GateResult | Exception
) -> list[tuple[list[str], str, str]]:
    """The gate answers ``outcome``; returns (prompt hashes, candidate, incumbent) per call."""
    asked: list[tuple[list[str], str, str]] = []

    async def evaluate(
        alias: str,
        config: AliasConfig,
        prompts: list[HeldoutPrompt],
        cand: str,
        inc: str,
        seed: int,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> GateResult:
        asked.append(([p.prompt_hash for p in prompts], cand, inc))
        if progress is not None:
            progress(1, len(prompts), 1.0)  # as the real gate does after each wave
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(rounds.gate, "evaluate", evaluate)
    return asked


def run(rounds: Rounds, live: int = 0, pool: HeldoutPool | None = None) -> RoundReport:
    route = rounds.lifecycle.writer.read(ALIAS) or AliasRoute(alias=ALIAS, base_model="base")
    assert route.active == live
    return rounds.run(ALIAS, route, [group("g1"), group("g2")], pool or pool_of("h1", "h2", "h3"))


def kinds(rounds: Rounds) -> list[str]:
    return [e["kind"] for e in reversed(rounds.lifecycle.writer.history(ALIAS))]


def metric(rounds: Rounds, name: str, **labels: str) -> float | None:
    return rounds.metrics.registry.get_sample_value(name, {"alias": ALIAS, **labels})


def test_a_rejected_candidate_is_written_marked_and_its_groups_spent(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    asked = script_gate(rounds, monkeypatch, verdict(passed=False))
    report = run(rounds)
    assert (report.version, report.outcome) == (1, "rejected")
    # The gate compares the candidate with the live base model on max_pairs held-out prompts.
    [(prompts, candidate, incumbent)] = asked
    assert len(set(prompts)) == 2 and set(prompts) <= {"h1", "h2", "h3"}
    assert (candidate, incumbent) == ("support@v1", "base")
    trainer = rounds.trainer()
    assert trainer.loaded == [None] and trainer.trained == [["g1", "g2"]]  # type: ignore[attr-defined]
    assert rounds.store.meta(ALIAS, 1)["group_ids"] == ["g1", "g2"]
    assert rounds.store.is_rejected(ALIAS, 1)
    assert kinds(rounds) == ["candidate", "gate", "reject"]
    assert {m.decode() for m in rounds.redis.zrange(trained_key(ALIAS), 0, -1)} == {"g1", "g2"}
    assert metric(rounds, "ratchet_learner_rounds_total", result="rejected") == 1
    assert metric(rounds, "ratchet_learner_gate_win_rate") == 0.2
    assert metric(rounds, "ratchet_learner_train_reward_mean") == 0.25


def test_a_passing_candidate_starts_a_canary_with_fresh_counts(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    script_gate(rounds, monkeypatch, verdict(passed=True))
    rounds.redis.hset(f"ratchet:canary:{ALIAS}", "canary_requests", 99)  # an older canary's
    assert run(rounds).outcome == "canary"
    route = rounds.lifecycle.writer.read(ALIAS)
    assert route is not None and (route.active, route.canary) == (0, 1)
    version, started, stats = read_counts(rounds.redis, ALIAS)
    assert version == 1 and started is not None and stats["canary"].requests == 0
    assert kinds(rounds) == ["candidate", "gate", "canary"]
    assert rounds.redis.zscore(trained_key(ALIAS), "g1") is not None


def test_without_a_canary_a_passing_candidate_is_promoted_and_trains_on(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.0)
    asked = script_gate(rounds, monkeypatch, verdict(passed=True))
    assert run(rounds).outcome == "promoted"
    assert kinds(rounds) == ["candidate", "gate", "promote"]
    report = run(rounds, live=1)  # the next round starts from the version now live
    assert report.version == 2 and asked[-1][1:] == ("support@v2", "support@v1")
    assert rounds.trainer().loaded[-1] == rounds.store.path(ALIAS, 1)  # type: ignore[attr-defined]
    assert rounds.store.meta(ALIAS, 2)["parent_version"] == 1


@pytest.mark.parametrize(
    ("passed", "outcome", "found"),
    [(True, "promoted", Stage.HELD), (False, "rejected", Stage.PROMOTED)],
)
def test_a_candidate_record_in_a_stage_it_should_not_be_does_not_stop_the_outcome(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    passed: bool,
    outcome: str,
    found: Stage,
) -> None:
    # The learner's own bookkeeping went wrong (here: another writer, mid-gate): the promotion or
    # rejection still goes through, and the record follows where the lifecycle went.
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.0)
    script_gate(rounds, monkeypatch, verdict(passed))
    evaluate = rounds.gate.evaluate

    async def then_miswritten(*args: Any, **kwargs: Any) -> GateResult:
        rounds.candidates.put(Candidate(ALIAS, 1, 0, found))
        return await evaluate(*args, **kwargs)

    monkeypatch.setattr(rounds.gate, "evaluate", then_miswritten)
    assert run(rounds).outcome == outcome
    route = rounds.lifecycle.writer.read(ALIAS)
    assert route is not None and route.active == (1 if passed else 0) and not route.paused
    assert kinds(rounds)[-1] == ("promote" if passed else "reject")
    assert rounds.candidates.get(ALIAS, 1).stage == Stage(outcome)  # type: ignore[union-attr]
    assert metric(rounds, "ratchet_learner_candidate_record_errors_total") == 1


def test_a_gate_that_fails_rejects_the_candidate(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    script_gate(rounds, monkeypatch, GateError("the verifier failed on a held-out prompt"))
    report = run(rounds)
    assert report.outcome == "rejected" and not report.gate.passed
    assert report.gate.reason == "gate failed: the verifier failed on a held-out prompt"
    assert metric(rounds, "ratchet_learner_failures_total", cause="gate") == 1


def test_each_round_draws_its_gate_prompts_at_random_from_the_whole_pool(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the newest prompts: a flood of fresh held-out prompts cannot decide what the gate
    sees. The draw is seeded by the candidate's version, so each round draws afresh."""
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    asked = script_gate(rounds, monkeypatch, verdict(passed=False))
    pool = pool_of(*(f"h{i:03d}" for i in range(200)))  # oldest first
    for _ in range(5):
        run(rounds, pool=pool)
    draws = [prompts for prompts, _, _ in asked]
    assert all(len(set(d)) == 2 for d in draws)  # gate.max_pairs = 2
    assert len({tuple(d) for d in draws}) == 5
    assert any(h < "h100" for d in draws for h in d)  # the older half is drawn from too


def test_the_gate_also_draws_held_out_prompts_that_arrived_while_the_round_trained(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round trains for minutes; the held-out prompts traffic brought meanwhile are read into
    the pool before the gate draws, and a broker that is down then leaves the pool as it was."""
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    asked = script_gate(rounds, monkeypatch, verdict(passed=False))
    pool = pool_of("h1")

    def read_heldout() -> None:
        assert rounds.trainer().trained, "read before training ended"  # type: ignore[attr-defined]
        pool.add(heldout("arrived-while-training"))

    rounds.read_heldout = read_heldout
    run(rounds, pool=pool)
    assert sorted(asked[-1][0]) == ["arrived-while-training", "h1"]

    def broker_down() -> None:
        raise KafkaError("broker down")

    rounds.read_heldout = broker_down
    report = run(rounds, pool=pool_of("h1"))
    assert asked[-1][0] == ["h1"] and report.outcome == "rejected"


# --- progress -----------------------------------------------------------------------------------


def record_progress(
    rounds: Rounds, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[LearnerProgress], list[LearnerProgress | None]]:
    """Everything the round reports, and what Redis holds after each report."""
    reported: list[LearnerProgress] = []
    stored: list[LearnerProgress | None] = []
    report = rounds.progress.report

    def spy(progress: LearnerProgress, read_delta: int = 0) -> bool:
        reported.append(progress)
        written = report(progress, read_delta)
        stored.append(read_progress(rounds.redis, ALIAS))
        return written

    monkeypatch.setattr(rounds.progress, "report", spy)
    return reported, stored


def test_a_round_publishes_each_phase_in_order_then_idle(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    script_gate(rounds, monkeypatch, verdict(passed=False))
    reported, stored = record_progress(rounds, monkeypatch)
    route = AliasRoute(alias=ALIAS, base_model="base")
    rounds.run(ALIAS, route, [group("g1"), group("g2")], pool_of("h1", "h2", "h3"), waiting=5)

    phases = [p.phase for p in reported]
    assert [ph for i, ph in enumerate(phases) if i == 0 or phases[i - 1] != ph] == [
        "train", "write", "gate", "settle", "idle",
    ]  # fmt: skip
    train = [p for p in reported if p.phase == "train"]
    # steps_per_round until the trainer says how many steps it planned (2 here)
    planned, batch = rounds.settings.learner.steps_per_round, rounds.settings.learner.batch_groups
    assert [(p.step, p.steps) for p in train] == [(0, planned), (1, 2), (2, 2)]
    assert train[-1].detail == "round 1: step 2/2 loss 0.2500, reward 0.250, 20.0 tokens/s"
    assert all(p.version == 0 for p in train)  # trains from the live version...
    gate = next(p for p in reported if p.phase == "gate")
    assert (gate.version, gate.step, gate.steps) == (1, 0, 2)  # ...then is the candidate's
    answered = [p for p in reported if p.phase == "gate"][-1]  # the gate's per-wave callback
    assert answered.step == 1 and answered.detail == "win rate 1.000 after 1 of 2 pairs"
    assert all(p.waiting == 5 and p.batch_groups == batch and p.heldout == 3 for p in reported[:-1])
    # Every phase reached Redis when it began (steps within one phase may be throttled).
    for progress, held in zip(reported, stored, strict=True):
        if progress.phase != "train" or progress.step == 0:
            assert held is not None and held.phase == progress.phase
    final = read_progress(rounds.redis, ALIAS)
    assert final is not None and (final.phase, final.waiting) == ("idle", 3)  # 5 - the round's 2
    assert metric(rounds, "ratchet_learner_round_phase", phase="idle") == 1
    assert metric(rounds, "ratchet_learner_round_phase", phase="train") == 0
    assert metric(rounds, "ratchet_learner_step_loss") == 0.25


def test_a_round_that_fails_goes_back_to_idle_with_its_groups_waiting(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    rounds.trainer().fail = RuntimeError("out of memory")  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError):
        rounds.run(ALIAS, AliasRoute(alias=ALIAS, base_model="base"), [group("g1")], pool_of("h"))
    final = read_progress(rounds.redis, ALIAS)
    assert final is not None and (final.phase, final.waiting) == ("idle", 1)
    assert metric(rounds, "ratchet_learner_round_phase", phase="train") == 0


def leaning(win_rate: float) -> GateResult:
    """A rejection that won ``win_rate`` of its pairs without proving it."""
    return GateResult(False, "futile", 96, win_rate, 0.45, 0.75, 0.5, 32)


def shown_worse() -> GateResult:
    """A rejection whose upper bound is below the threshold."""
    return GateResult(False, "upper bound 0.42 < 0.5", 40, 0.2, 0.05, 0.42, 0.5, 32)


def test_a_rejected_candidate_that_leaned_better_is_where_the_next_round_starts(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    rounds.settings.learner.max_candidate_rounds = 3
    asked = script_gate(rounds, monkeypatch, leaning(0.6))
    for expected in (1, 2, 3, 4):
        assert run(rounds).version == expected
    trainer = rounds.trainer()
    store = rounds.store
    # v1 from a fresh LoRA, v2 on from v1, v3 on from v2; v3 holds max_candidate_rounds (3)
    # rounds beyond the live version, so v4 starts afresh.
    assert trainer.loaded == [None, store.path(ALIAS, 1), store.path(ALIAS, 2), None]  # type: ignore[attr-defined]
    assert [store.meta(ALIAS, v)["trained_from"] for v in (1, 2, 3, 4)] == [0, 1, 2, 0]
    assert [store.meta(ALIAS, v)["rounds_beyond_parent"] for v in (1, 2, 3, 4)] == [1, 2, 3, 1]
    # Every candidate is still gated against, and descends from, the live version.
    assert {(c, i) for _, c, i in asked} == {(f"support@v{v}", "base") for v in (1, 2, 3, 4)}
    assert {store.meta(ALIAS, v)["parent_version"] for v in (1, 2, 3, 4)} == {0}
    assert all(store.is_rejected(ALIAS, v) for v in (1, 2, 3, 4))


def test_a_candidate_shown_worse_carries_nothing_and_a_failed_gate_keeps_the_carry(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.1)
    script_gate(rounds, monkeypatch, leaning(0.6))
    run(rounds)  # v1 carried
    script_gate(rounds, monkeypatch, GateError("vLLM is down"))
    run(rounds)  # v2 from v1, not judged: v1 stays the carry
    script_gate(rounds, monkeypatch, shown_worse())
    run(rounds)  # v3 from v1 again, shown worse: nothing carried
    run(rounds)  # v4 from the live version
    trainer = rounds.trainer()
    assert trainer.loaded == [None, rounds.store.path(ALIAS, 1), rounds.store.path(ALIAS, 1), None]  # type: ignore[attr-defined]


def test_a_passing_carried_candidate_goes_to_canary_and_the_carry_ends(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = make_rounds(redis_url, tmp_path, canary_weight=0.0)
    script_gate(rounds, monkeypatch, leaning(0.6))
    run(rounds)
    asked = script_gate(rounds, monkeypatch, verdict(passed=True))
    assert run(rounds).outcome == "promoted"  # v2, trained on from v1, against the base
    assert asked == [(asked[0][0], "support@v2", "base")]
    assert rounds.store.meta(ALIAS, 2)["parent_version"] == 0  # rollback goes to the base
    script_gate(rounds, monkeypatch, leaning(0.6))
    run(rounds, live=2)  # v3 starts from the live v2, not from any carry
    assert rounds.trainer().loaded[-1] == rounds.store.path(ALIAS, 2)  # type: ignore[attr-defined]


# --- rounds that train on from a canary ---------------------------------------------------------


def on_canary(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **learner: Any
) -> tuple[LearnerService, list[tuple[list[str], str, str]]]:
    """A service whose first round's v1 passed its gate and is the canary; the gate passes every
    candidate. Returns the service and the gate's calls."""
    service = make_service(
        redis_url, tmp_path, canary_weight=0.1, batch_groups=2, min_groups=1, **learner
    )
    asked = script_gate(service.rounds, monkeypatch, verdict(passed=True))
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    service.refresh_routes()
    for offset, gid in enumerate(("g1", "g2")):
        assert service.take(group(gid), TP, offset) == "waiting"
    [report] = service.leased_round(ALIAS)
    assert (report.version, report.outcome) == (1, "canary")
    return service, asked


TP = TopicPartition(GROUPS_TOPIC, 0)


def train_through_the_canary(service: LearnerService) -> None:
    """Two groups the judge sampled from canary v1, and the round on them: v2, held."""
    service.refresh_routes()  # as the loop does before it takes what it polled
    for offset, gid in ((2, "g3"), (3, "g4")):
        assert service.take(group(gid, version=1), TP, offset) == "waiting"
    assert service.ready(ALIAS)
    assert service.leased_round(ALIAS) == []
    assert service.held.held[ALIAS].candidate.version == 2
    assert not service.ready(ALIAS)  # one held candidate at a time


def test_the_next_round_trains_on_from_the_canary_and_is_gated_once_it_is_promoted(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, asked = on_canary(redis_url, tmp_path, monkeypatch)
    rounds = service.rounds
    assert read_carry(service.redis, ALIAS) == Carry(1, 0, 1, 0.9, canary=True)
    train_through_the_canary(service)
    assert rounds.trainer().loaded[-1] == rounds.store.path(ALIAS, 1)  # type: ignore[attr-defined]
    meta = rounds.store.meta(ALIAS, 2)
    assert (meta["parent_version"], meta["trained_from"], meta["rounds_beyond_parent"]) == (1, 1, 1)
    assert len(asked) == 1 and kinds(rounds)[-1] == "candidate"  # not gated during the canary
    assert rounds.redis.zscore(trained_key(ALIAS), "g3") is None  # nor settled

    assert service.held.settle(ALIAS) == []  # the canary still runs
    service.lifecycle.promote(ALIAS, 1, from_canary=True)
    service.lifecycle.pause(ALIAS, "manual")
    assert service.held.settle(ALIAS) == []  # no new canary while learning is paused
    service.lifecycle.resume(ALIAS)
    [report] = service.held.settle(ALIAS)
    assert (report.version, report.outcome) == (2, "canary")
    assert asked[-1][1:] == ("support@v2", "support@v1")  # against the version live now
    assert ALIAS not in service.held
    assert rounds.redis.zscore(trained_key(ALIAS), "g3") is not None
    assert read_carry(service.redis, ALIAS) == Carry(2, 1, 1, 0.9, canary=True)
    assert kinds(rounds)[-3:] == ["resume", "gate", "canary"]


def stages(service: LearnerService) -> dict[int, str]:
    return {c.version: c.stage.value for c in service.rounds.candidates.all(ALIAS)}


def test_a_restarted_learner_settles_the_candidate_it_held(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = on_canary(redis_url, tmp_path, monkeypatch)
    train_through_the_canary(service)
    assert stages(service) == {1: "canary", 2: "held"}
    # Killed here: nothing in memory survives; Redis and the store do, and the groups' offsets
    # were never committed past.
    restarted = make_service(redis_url, tmp_path, canary_weight=0.1, batch_groups=2, min_groups=1)
    asked = script_gate(restarted.rounds, monkeypatch, verdict(passed=True))
    for h in ("h1", "h2", "h3"):
        restarted.add_heldout(heldout(h))
    restarted.held.resume(restarted.settings.aliases)
    restarted.refresh_routes()
    for offset, gid in ((2, "g3"), (3, "g4")):  # read again: they wait, no round while it is held
        assert restarted.take(group(gid, version=1), TP, offset) == "waiting"
    assert not restarted.ready(ALIAS)
    assert restarted.held.settle(ALIAS) == []  # its canary still runs
    restarted.lifecycle.promote(ALIAS, 1, from_canary=True)
    [report] = restarted.held.settle(ALIAS)
    assert (report.version, report.outcome) == (2, "canary")
    assert asked[-1][1:] == ("support@v2", "support@v1")  # against the canary, live now
    assert report.stats.mean_reward == 0.25 and report.stats.kl is None  # as its round wrote
    assert stages(restarted) == {1: "promoted", 2: "canary"}
    assert restarted.rounds.trainer().trained == []  # type: ignore[attr-defined]
    # Its groups, read again, are spent: the next round drops them rather than train them twice.
    restarted.drop_trained(ALIAS)
    assert restarted.waiting[ALIAS] == []


def test_a_round_caught_before_its_outcome_is_dropped_by_the_next_round(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(redis_url, tmp_path, canary_weight=0.1, batch_groups=2, min_groups=1)
    script_gate(service.rounds, monkeypatch, RuntimeError("killed mid-gate"))
    for h in ("h1", "h2", "h3"):
        service.add_heldout(heldout(h))
    service.refresh_routes()
    for offset, gid in enumerate(("g1", "g2")):
        service.take(group(gid), TP, offset)
    assert service.leased_round(ALIAS) == []  # failed: the alias paused, v1 left gating
    assert stages(service) == {1: "gating"}
    service.lifecycle.resume(ALIAS)
    script_gate(service.rounds, monkeypatch, verdict(passed=False))
    assert [r.outcome for r in service.leased_round(ALIAS)] == ["rejected"]
    assert stages(service) == {1: "rejected", 2: "rejected"}
    assert service.rounds.candidates.get(ALIAS, 1).reason == (  # type: ignore[union-attr]
        "no outcome: its round did not finish"
    )


def test_a_held_round_killed_right_after_its_write_stays_held(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = on_canary(redis_url, tmp_path, monkeypatch)
    write = service.rounds.write

    def then_killed(*args: Any, **kwargs: Any) -> int:
        write(*args, **kwargs)
        raise RuntimeError("killed right after the write")

    monkeypatch.setattr(service.rounds, "write", then_killed)
    service.refresh_routes()
    for offset, gid in ((2, "g3"), (3, "g4")):
        assert service.take(group(gid, version=1), TP, offset) == "waiting"
    assert service.leased_round(ALIAS) == []  # failed
    # Written held in the one write: what it learned on the canary is settled once it ends,
    # not rejected as an orphan of a round.
    assert stages(service) == {1: "canary", 2: "held"}
    assert service.rounds.candidates.drop_orphans(ALIAS) == []
    assert stages(service) == {1: "canary", 2: "held"}


def test_a_round_held_on_a_canary_that_is_rolled_back_is_rejected_without_a_gate(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, asked = on_canary(redis_url, tmp_path, monkeypatch)
    train_through_the_canary(service)
    service.lifecycle.rollback(ALIAS, "ratings", canary=1)
    [report] = service.held.settle(ALIAS)
    assert (report.version, report.outcome) == (2, "rejected") and len(asked) == 1
    assert report.gate.reason == "trained on from canary v1, which was rolled back"
    service.refresh_routes()
    assert stages(service) == {1: "rejected", 2: "rejected"}
    assert service.store.is_rejected(ALIAS, 2)
    assert service.redis.zscore(trained_key(ALIAS), "g4") is not None  # spent: their outcome
    service.refresh_routes()
    route = service.routes[ALIAS]
    assert service.rounds.start_of_round(ALIAS, route.active, route.canary).version == 0
    assert service.take(group("g5", version=1), TP, 4) == "stale"  # the rolled-back version's


def test_with_training_during_canaries_off_no_round_runs_on_a_canary(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = on_canary(redis_url, tmp_path, monkeypatch, train_during_canary=False)
    assert read_carry(service.redis, ALIAS) is None
    service.refresh_routes()
    for offset, gid in ((2, "g3"), (3, "g4")):
        assert service.take(group(gid), TP, offset) == "waiting"
    assert not service.ready(ALIAS)


def test_a_held_round_whose_settling_breaks_pauses_the_alias_and_keeps_its_groups(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = on_canary(redis_url, tmp_path, monkeypatch)
    train_through_the_canary(service)
    script_gate(service.rounds, monkeypatch, RuntimeError("bug"))
    service.lifecycle.promote(ALIAS, 1, from_canary=True)
    assert service.held.settle(ALIAS) == []
    assert ALIAS not in service.held
    assert [w.group.group_id for w in service.waiting[ALIAS]] == ["g3", "g4"]  # uncommitted
    route = service.writer.read(ALIAS)
    assert route is not None and route.paused

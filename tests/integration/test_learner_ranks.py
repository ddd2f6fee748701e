"""`ratchet learner` on two ranks, as the chart starts it on a pod with two GPUs, here on the CPU:
`torchrun --nproc-per-node 2` (gloo). Rank 0 is the service: it reads the groups, leads the round
the other rank trains with it, gates the candidate and writes it once. That the two ranks
compute the one-rank adapter is tests/unit/learner/test_parallel.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from embedded.adapters import write_random_adapters
from embedded.processes import Stack, wait_until
from embedded.stack import learner_part
from learner.rank_failure import FAULT_ENV
from ratchet.registry import AliasRoute
from ratchet.settings import load_settings
from ratchet.store import AdapterStore
from tests.integration.conftest import BASE_MODEL, Embedded
from tests.integration.test_learner import (
    LONG_ROUND_S,
    SHORT_GATE,
    BasePolicy,
    better_groups,
    heldout_prompts,
    history,
    informative,
    learner_config,
    produce,
    wait_for_event,
)

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_a_learner_on_two_ranks_trains_gates_and_writes_one_candidate(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    alias = "lt-ranks"
    # Either verdict passes: a short gate.
    config = learner_config(
        embedded, tmp_path, alias, gate_tokens=16, gate=SHORT_GATE, min_groups=4,
        steps_per_round=4, device="cpu", cpu_threads=1,
    )  # fmt: skip
    settings = load_settings(config)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    groups = better_groups(policy, alias, base_answers, count=12)
    produce(embedded, [*heldout_prompts(alias), *groups])

    part = learner_part(settings, config)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    part.command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", *part.command[2:]]
    stack = Stack([part], tmp_path / "state")
    stack.start()
    try:
        [outcome] = wait_for_event(settings, alias, {"promote", "reject"}, timeout_s=LONG_ROUND_S)
        log = part.log_path.read_text() if part.log_path else ""
        assert "learner rank 0 of 2 (gloo)" in log and "learner rank 1 of 2 (gloo)" in log, log
    finally:
        stack.stop()
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    version = outcome["version"]
    assert store.versions(alias) == [version]  # written once, by rank 0
    assert sorted(store.meta(alias, version)["group_ids"]) == informative(groups)
    kinds = [e["kind"] for e in reversed(history(settings, alias))]
    assert kinds == ["candidate", "gate", outcome["kind"]]


@pytest.mark.timeout(600)
def test_an_adapter_that_fails_to_load_on_two_ranks_ends_the_round_on_both_and_pauses_once(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    """The live version is an adapter the learner cannot continue (rank 8 on q and v, where it
    trains every linear module): the round's load fails on both ranks, rank 0 pauses the alias
    once with the reason, rank 1 skips the round, and neither process dies (torchrun would
    restart the whole group, and the restarted group would fail again)."""
    alias = "lt-ranks-bad"
    config = learner_config(
        embedded, tmp_path, alias, gate_tokens=16, gate=SHORT_GATE, min_groups=4,
        steps_per_round=1, device="cpu", cpu_threads=1,
    )  # fmt: skip
    settings = load_settings(config)
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    write_random_adapters(embedded.model_path, store, alias, [1])
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL, active=1))
    produce(embedded, [*heldout_prompts(alias), *better_groups(policy, alias, base_answers, 4)])

    part = learner_part(settings, config)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    part.command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", *part.command[2:]]
    stack = Stack([part], tmp_path / "state")

    def log() -> str:
        return part.log_path.read_text() if part.log_path else ""

    stack.start()
    try:
        [pause] = wait_for_event(settings, alias, {"pause"}, timeout_s=LONG_ROUND_S)
        assert "round_failed" in pause["detail"]["reason"], pause
        # Rank 1 ended the round too, and waits for the next one rather than dying.
        wait_until(lambda: "round skipped" in log(), 60, "rank 1 to skip the round")
        assert part.process is not None and part.process.poll() is None, log()
    finally:
        stack.stop()
    text = log()
    # One group, started once: no rank died and no restart followed.
    for rank in (0, 1):
        assert text.count(f"learner rank {rank} of 2 (gloo)") == 1, text
    kinds = [e["kind"] for e in reversed(history(settings, alias))]
    assert kinds.count("pause") == 1 and "candidate" not in kinds, kinds
    assert store.versions(alias) == [1]


@pytest.mark.timeout(600)
def test_a_training_step_that_fails_on_one_rank_ends_the_round_on_both_and_pauses_once(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    """Rank 1's training step raises (the fault injected by RATCHET_LEARNER_FAULT_RANK, the
    real learner otherwise): both ranks stop at that step's sum (learner/rank_failure.py), rank
    0 pauses the alias once with the reason naming rank 1 and its error, rank 1 waits for the
    next round, and neither process dies (no torchrun restart)."""
    alias = "lt-ranks-step"
    config = learner_config(
        embedded, tmp_path, alias, gate_tokens=16, gate=SHORT_GATE, min_groups=4,
        steps_per_round=2, device="cpu", cpu_threads=1,
    )  # fmt: skip
    settings = load_settings(config)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    produce(embedded, [*heldout_prompts(alias), *better_groups(policy, alias, base_answers, 4)])

    part = learner_part(settings, config)
    part.env = {**part.env, FAULT_ENV: "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    part.command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", *part.command[2:]]
    stack = Stack([part], tmp_path / "state")

    def log() -> str:
        return part.log_path.read_text() if part.log_path else ""

    stack.start()
    try:
        [pause] = wait_for_event(settings, alias, {"pause"}, timeout_s=LONG_ROUND_S)
        reason = pause["detail"]["reason"]
        assert reason.startswith("round_failed: RanksFailed: training failed on rank 1: "), reason
        assert "RuntimeError: injected fault on rank 1" in reason, reason
        # Rank 1 ended the round at the same step, and waits for the next one rather than dying.
        wait_until(lambda: "round failed: training failed on rank 1" in log(), 60, "rank 1")
        assert part.process is not None and part.process.poll() is None, log()
    finally:
        stack.stop()
    text = log()
    # One group, started once: no rank died and no restart followed.
    for rank in (0, 1):
        assert text.count(f"learner rank {rank} of 2 (gloo)") == 1, text
    assert "data-parallel round failed" not in text, text
    kinds = [e["kind"] for e in reversed(history(settings, alias))]
    assert kinds.count("pause") == 1 and "candidate" not in kinds, kinds
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    assert store.versions(alias) == []

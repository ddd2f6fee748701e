"""The loop's mechanics on the real stack, with a tiny budget and every decision forced.

Demo prompts go through the proxy; the judge (a process) samples groups from vLLM with vLLM's
own logprobs and scores them with the demo verifier; the learner (a process) trains one round
with its default steps and learning rate on those groups, writes the candidate to the store,
gates it (threshold 0 on 8 pairs: anything not worse on every pair passes) and puts it on
canary; scripted users rate the canary's answers 1 and the live version's 0, so the canary is
promoted, and the proxy then serves the new version. What the round learned is not asserted:
that is the outcome lane's (`scripts/test --outcomes`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from console.views import ConsoleData
from embedded.processes import Stack, free_port
from embedded.stack import judge_part, learner_part
from judge.service import is_heldout
from ratchet.bill import Bill
from ratchet.progress import read_progress
from ratchet.records import GROUPS_TOPIC, ScoredGroup, prompt_hash
from ratchet.registry import AliasRoute
from ratchet.settings import RatchetSettings, load_settings
from ratchet.store import AdapterStore
from tasks.demo import load_prompts
from tests.integration.conftest import BASE_MODEL, Embedded, ratchet_cli
from tests.integration.scripted_users import (
    canary_favoured,
    first_event,
    rate_canary_until_decided,
    send,
)
from tests.integration.test_learner import served_by

if TYPE_CHECKING:
    from datasets import Dataset

pytestmark = pytest.mark.integration

ALIAS = "lm-loop"
PROMPTS = load_prompts()
HELDOUT_FRACTION = 0.5
GATE_PAIRS = 8
GROUPS = 12  # sampled; a round takes those whose answers scored differently
CANARY_TRAFFIC = PROMPTS[300:396]  # at most; rated 16 at a time until the canary is decided


def traffic(secret: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """GATE_PAIRS prompts the judge holds out (its keyed hash decides) and GROUPS it samples
    groups for."""
    held, grouped = [], []
    for prompt in PROMPTS[:200]:
        if is_heldout(secret, prompt_hash(prompt["messages"], None), HELDOUT_FRACTION):
            held.append(prompt)
        else:
            grouped.append(prompt)
    return held[:GATE_PAIRS], grouped[:GROUPS]


def mechanics_config(env: Embedded, home: Path, round_groups: int) -> Path:
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)  # where vLLM's resolver finds adapters
    config["judge"] = {"consumer_group": f"judge-{ALIAS}", "metrics_port": free_port()}
    config["learner"] = {
        "consumer_group": f"learner-{ALIAS}",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        # steps_per_round and learning_rate stay at their defaults: the round is a real one.
        "batch_groups": round_groups,
        "min_groups": round_groups,
        "seed": 0,
    }
    config["aliases"] = {
        ALIAS: {
            "base_model": BASE_MODEL,
            "reward": {"kind": "verifier", "verifier": "tasks.demo:extraction_reward"},
            "learning": {
                "group_size": 4,
                "heldout_fraction": HELDOUT_FRACTION,
                "dedup_window_s": 0,
            },
            # Long enough for the demo's JSON, so the verifier's scores of a group differ.
            "sampling": {"temperature": 1.0, "max_tokens": 48, "seed": 0},
            "gate": {
                "min_pairs": GATE_PAIRS,
                "max_pairs": GATE_PAIRS,
                "threshold": 0.0,
                "max_tokens": 16,
            },
            # Only the users' ratings decide (the wait for them is longer than the test).
            "canary": {
                "weight": 0.5,
                "min_requests": 16,
                "min_feedback": 4,
                "feedback_wait_s": 900,
            },
        }
    }
    path = home / f"loop-mechanics-{round_groups}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(600)
def test_a_round_of_judged_traffic_is_trained_gated_and_promoted_by_ratings(
    embedded: Embedded, tmp_path: Path
) -> None:
    embedded.registry.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))
    embedded.wait_for_proxy_route(ALIAS)
    held, grouped = traffic(embedded.secret)
    # The judge first, alone: the learner then takes exactly the groups it kept in one round.
    config = mechanics_config(embedded, tmp_path, round_groups=len(grouped))
    judge = Stack([judge_part(load_settings(config), config)], tmp_path / "judge")
    judge.start()
    try:
        send(embedded, ALIAS, held + grouped, max_tokens=8, concurrency=4)
        # 12 groups of 4 answers of 48 tokens: about a minute on a quiet 2-core machine.
        judged = embedded.find_records(
            GROUPS_TOPIC,
            lambda r: isinstance(r, ScoredGroup) and r.alias == ALIAS,
            count=len(grouped),
            timeout_s=240,
        )
        judge_counters = scrape(load_settings(config).judge.metrics_port)
    finally:
        judge.stop()
    groups = [g for g in judged if isinstance(g, ScoredGroup)]
    assert len(groups) == len(grouped), len(groups)
    kept = {g.group_id: g for g in groups if max(g.rewards) > min(g.rewards)}
    assert kept, [g.rewards for g in groups]  # sampled at temperature 1: some differ

    config = mechanics_config(embedded, tmp_path, round_groups=len(kept))
    settings = load_settings(config)
    learner = Stack([learner_part(settings, config)], tmp_path / "learner")
    learner.start()
    try:
        # A round of the default 8 steps on at most 12 groups and an 8-pair gate of 16 tokens.
        outcome = first_event(settings, ALIAS, {"canary", "reject", "promote"}, timeout_s=240)
        assert outcome["kind"] == "canary", outcome
        candidate = outcome["version"]
        learner_counters = scrape(settings.learner.metrics_port)
        decided, arms = rate_canary_until_decided(
            embedded, settings, ALIAS, CANARY_TRAFFIC, canary_favoured
        )
    finally:
        learner.stop()

    assert decided["kind"] == "promote" and decided["version"] == candidate, decided
    assert decided["detail"]["reason"].startswith("ratings: "), decided
    assert arms.get("canary", 0) >= 16, arms
    assert served_by(embedded, ALIAS) == f"{ALIAS}@v{candidate}"

    # The round trained on exactly the judge's groups that carry a signal: sampled from v0 by
    # vLLM, with its logprobs.
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    assert sorted(store.meta(ALIAS, candidate)["group_ids"]) == sorted(kept)
    for group in kept.values():
        assert group.version == 0 and group.judge_model is None, group
        assert all(s.logprobs and len(s.logprobs) == len(s.token_ids) for s in group.samples)

    # What the round cost, in its outcome's event, as the services counted it: the judge's
    # sampling of every group it produced (each group's own bill), the round's share (the groups
    # it trained on) and its training.
    bills = [g.bill for g in groups]
    assert all(b is not None and b.judge_calls == 0 for b in bills)  # a verifier: no judge calls
    for kind, field in (("input", "sample_input_tokens"), ("output", "sample_output_tokens")):
        spent = sum(getattr(b, field) for b in bills)
        counted = judge_counters[("ratchet_judge_sampled_tokens_total", ALIAS, kind)]
        assert spent == counted > 0, (kind, spent, counted)
    bill = Bill.model_validate(outcome["detail"]["bill"])
    assert bill.sample_output_tokens == sum(g.bill.sample_output_tokens for g in kept.values())  # type: ignore[union-attr]
    assert (
        bill.train_tokens == learner_counters[("ratchet_learner_trained_tokens_total", ALIAS, "")]
    )
    assert bill.train_seconds > 0 and bill.gate_seconds > 0 and bill.judge_cost_usd == 0
    status = ratchet_cli("status", ALIAS, "--config", str(config))
    assert status.returncode == 0 and f"cost: {bill.line()}" in status.stdout, status
    [row] = [r for r in ConsoleData(settings).detail(ALIAS).rounds if r.version == candidate]  # type: ignore[union-attr]
    assert row.bill == bill

    # The run's data, out as datasets: every group the learner read, its users' ratings joined
    # with the answers they rate, the gate's pairs and the traffic.
    progress = read_progress(embedded.registry.redis, ALIAS)
    assert progress is not None and progress.read == len(groups)
    exported = export_groups_interrupted_then_continued(config, settings, tmp_path / "groups")
    assert len(exported) == progress.read
    assert sorted(exported["group_id"]) == sorted(g.group_id for g in groups)
    assert exported.features["rewards"].feature.dtype == "float64"

    ratings = ratchet_export(config, tmp_path / "ratings", "--what", "ratings")
    assert len(ratings) == sum(arms.values())
    # The join is right: users liked every canary answer and no live one. The live arm is v0
    # until the canary is promoted, which can happen while a batch is still being answered.
    assert sum(r["score"] == 1.0 for r in ratings) == arms["canary"]
    rated = {(r["version"], r["score"]) for r in ratings}
    assert {(candidate, 1.0), (0, 0.0)} <= rated <= {(candidate, 1.0), (0, 0.0), (candidate, 0.0)}
    assert len(set(ratings["completion_id"])) == len(ratings)
    pairs = ratchet_export(config, tmp_path / "pairs", "--what", "pairs")
    assert set(pairs["version"]) == {candidate} and 1 <= len(pairs) <= GATE_PAIRS
    logged = ratchet_export(
        config, tmp_path / "traffic", "--what", "traffic", "--format", "jsonl", "--since", "1h"
    )
    assert set(logged["alias"]) == {ALIAS}
    assert len(logged) >= len(held) + len(grouped) + sum(arms.values())


def ratchet_export(config: Path, out: Path, *args: str) -> Dataset:
    """`ratchet export` as a user runs it, and what `datasets` loads from its folder."""
    from datasets import load_dataset

    run = ratchet_cli("export", ALIAS, "--out", str(out), "--config", str(config), *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return load_dataset(str(out), split="train")


def export_groups_interrupted_then_continued(
    config: Path, settings: RatchetSettings, out: Path
) -> Dataset:
    """A groups export stopped once its first shard is written, then continued by the CLI:
    what `datasets` loads has every group once."""
    from datasets import load_dataset

    from cli.exporter.run import begin, export

    def stop_after_a_shard(done: int, total: int) -> None:
        if any((out / "data").glob("part-*.parquet")):
            raise KeyboardInterrupt

    state = begin(settings, out, ALIAS, "groups", "parquet", None)
    with pytest.raises(KeyboardInterrupt):
        export(settings, out, state, 5, stop_after_a_shard)
    assert not (out / "README.md").exists()
    run = ratchet_cli(
        "export", ALIAS, "--out", str(out), "--shard-rows", "5", "--config", str(config)
    )
    assert run.returncode == 0 and "continuing the export" in run.stdout, run.stdout + run.stderr
    return load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    """A service's counters: (sample name, alias, kind) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("alias", ""), sample.labels.get("kind", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

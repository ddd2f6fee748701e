"""The learner against the real stack: `ratchet learner` trains on groups from Kafka, writes the
candidate to the store vLLM loads adapters from, gates it on held-out prompts through vLLM with
the demo verifier, and promotes or rejects it in Redis; the proxy then serves what it decided.

The groups are made here, not by the judge, so each test controls what is learned: for each
demo prompt, the right JSON answer and a wrong one, with the rewards pointing one way or the
other. Their behaviour logprobs are the base model's (scored in this process with
transformers), exactly what vLLM would have logged sampling them from v0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kafka import KafkaProducer

from cli.report import learner_lag
from embedded.processes import Stack, wait_until
from embedded.stack import learner_part
from ratchet.records import (
    EVENTS_TOPIC,
    GROUPS_TOPIC,
    HeldoutPrompt,
    LifecycleEvent,
    Record,
    Sample,
    ScoredGroup,
    prompt_hash,
)
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings, load_settings
from ratchet.store import AdapterStore
from tasks.demo import extraction_reward, load_prompts
from tests.integration.conftest import BASE_MODEL, Embedded, free_port

pytestmark = pytest.mark.integration

PROMPTS = load_prompts()
TRAIN, HELDOUT = PROMPTS[:32], PROMPTS[300:324]


class BasePolicy:
    """The base model in this process: chat-template tokenisation and per-token logprobs."""

    def __init__(self, model_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        # Every test builds its groups from the same answers: score each one once.
        self._samples: dict[tuple[tuple[int, ...], str], Sample] = {}

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding

    def sample(self, prompt_ids: list[int], text: str) -> Sample:
        key = (tuple(prompt_ids), text)
        if key not in self._samples:
            self._samples[key] = self._score(prompt_ids, text)
        return self._samples[key]

    def _score(self, prompt_ids: list[int], text: str) -> Sample:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end]
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([prompt_ids + ids])).logits[0]
        logprobs = logits[len(prompt_ids) - 1 : -1].log_softmax(-1)
        picked = logprobs.gather(1, self.torch.tensor(ids)[:, None])[:, 0].tolist()
        message = {"role": "assistant", "content": text}
        return Sample(
            message=message, text=text, token_ids=ids, logprobs=picked, finish_reason="stop"
        )


def right_answer(prompt: dict[str, Any]) -> str:
    return json.dumps(prompt["expected"])


WRONG_ANSWER = "Sorry, I cannot help with orders."  # no JSON at all: the verifier's 0

# (answer, reward) pairs of one group; a test builds one list per training prompt
Answers = list[tuple[str, float]]


def make_groups(
    policy: BasePolicy,
    alias: str,
    tag: str,
    answers: Callable[[int, dict[str, Any]], Answers],
    count: int = len(TRAIN),
) -> list[ScoredGroup]:
    """One group per training prompt (the first `count`), its samples and rewards from
    `answers(index, prompt)`."""
    groups = []
    for i, prompt in enumerate(TRAIN[:count]):
        prompt_ids = policy.prompt_ids(prompt["messages"])
        pairs = answers(i, prompt)
        groups.append(
            ScoredGroup(
                group_id=f"{alias}-{tag}-{i}",
                alias=alias,
                version=0,
                response_model=BASE_MODEL,
                prompt_messages=prompt["messages"],
                prompt_token_ids=prompt_ids,
                samples=[policy.sample(prompt_ids, text) for text, _ in pairs],
                rewards=[reward for _, reward in pairs],
                traffic_request_id=f"{alias}-{tag}-{i}",
            )
        )
    return groups


def worse_groups(policy: BasePolicy, alias: str, count: int = len(TRAIN)) -> list[ScoredGroup]:
    """A refusal rewarded over the right JSON: trained on, the model answers worse."""
    return make_groups(
        policy,
        alias,
        "worse",
        lambda _, p: [(WRONG_ANSWER, 1.0), (right_answer(p), 0.0)],
        count,
    )


def better_groups(
    policy: BasePolicy, alias: str, base_answers: list[str], count: int = len(TRAIN)
) -> list[ScoredGroup]:
    """The right JSON rewarded over the base model's own greedy answer, scored by the demo
    verifier: what GRPO sees when one sample of a group is right. (A refusal as the loser
    instead teaches the model to stop late: both end with the end-of-turn token.)"""

    def answers(i: int, prompt: dict[str, Any]) -> Answers:
        own = base_answers[i]
        own_reward = extraction_reward(prompt["messages"], {"content": own})
        return [(right_answer(prompt), 1.0), (own, own_reward)]

    return make_groups(policy, alias, "better", answers, count)


def informative(groups: list[ScoredGroup]) -> list[str]:
    """Ids of the groups the learner trains on: those whose rewards differ."""
    return sorted(g.group_id for g in groups if max(g.rewards) > min(g.rewards))


def heldout_prompts(alias: str) -> list[HeldoutPrompt]:
    return [
        HeldoutPrompt(
            prompt_hash=prompt_hash(p["messages"], None),
            alias=alias,
            prompt_messages=p["messages"],
            traffic_request_id=f"{alias}-held-{i}",
        )
        for i, p in enumerate(HELDOUT)
    ]


def produce(env: Embedded, records: list[Record]) -> None:
    producer = KafkaProducer(bootstrap_servers=env.settings.kafka_bootstrap_servers, acks="all")
    for record in records:
        key = record.alias.encode() if isinstance(record, ScoredGroup) else b"k"  # type: ignore[attr-defined]
        producer.send(record.TOPIC, key=key, value=record.to_json())
    producer.flush(30)
    producer.close()


def learner_config(
    env: Embedded,
    home: Path,
    alias: str,
    canary: dict[str, Any] | None = None,
    gate_tokens: int = 64,
    gate: dict[str, Any] | None = None,
    **learner: Any,
) -> Path:
    """The session stack's addresses and adapter store, one demo alias, its own consumer group;
    no canary unless `canary` says. The gate answers with up to `gate_tokens` (64: a whole JSON
    answer, so the verdict means something); `gate` overrides its other settings."""
    config = yaml.safe_load(env.config_path.read_text())
    config["home"] = str(home)
    config["store_dir"] = str(env.settings.store_dir)  # where vLLM's resolver finds adapters
    config["learner"] = {
        "consumer_group": f"learner-{alias}",
        "metrics_port": free_port(),
        "base_model_path": str(env.model_path),
        # A round takes everything produced at once: more groups than any test makes, so the
        # round starts when the first group has waited interval_s.
        "batch_groups": 64,
        "min_groups": 8,
        "interval_s": 5,
        # Measured on these groups (HF greedy on HELDOUT, base 0.44): ppo_clip at 5e-4 x 16 steps
        # lifts the score to 0.74. At 1e-3 (whole groups per step since the learner packs each
        # group as one row) the model stops answering in JSON and scores 0; CISPO, whose weight
        # grows to 5 on these off-policy right answers, makes it repeat keys.
        "steps_per_round": 16,
        "learning_rate": 5e-4,
        "lora": {"rank": 8, "alpha": 16},
        "loss": {"mode": "ppo_clip"},
        # The figures above are float32's (auto's on a CPU): in bf16 on an AMX host this round's
        # better candidate was rejected (learner/trainer.py uses_bf16).
        "precision": "fp32",
        "canary_check_s": 0.5,
        "seed": 0,
        **learner,
    }
    config["aliases"] = {
        alias: {
            "base_model": BASE_MODEL,
            "reward": {"kind": "verifier", "verifier": "tasks.demo:extraction_reward"},
            "gate": {
                "min_pairs": 16,
                "max_pairs": len(HELDOUT),
                "max_tokens": gate_tokens,
                # 24 held-out prompts can only show a very large gain at the default alpha
                # (0.05); these tests check the gate's mechanics, not its power, so they accept
                # a 30% false-pass rate (the better candidate wins 0.72 of its first 16 pairs).
                "alpha": 0.3,
                **(gate or {}),
            },
            "canary": canary or {"weight": 0.0},
        }
    }
    path = home / "learner.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running_learner(config: Path, state: Path) -> Iterator[Stack]:
    stack = Stack([learner_part(load_settings(config), config)], state)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def history(settings: RatchetSettings, alias: str) -> list[dict[str, Any]]:
    return RegistryWriter(settings.redis_url, settings.aliases).history(alias, limit=100)


def wait_for_event(
    settings: RatchetSettings, alias: str, kinds: set[str], count: int = 1, timeout_s: float = 600
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in history(settings, alias) if e["kind"] in kinds]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"no {kinds} event for {alias} in {timeout_s}s: {history(settings, alias)}")


# What ends a round's wait: any outcome (ratchet/rounds.py) or the learner pausing the alias.
ROUND_ENDS = {"promote", "canary", "reject", "rollback", "pause"}
# Fail-slow bounds sized from the rounds here on 2 loaded cores (measured: two 32-group rounds
# of 16 steps with their gates 163 s, a 12-group canary round under 111 s); a wrong outcome
# fails at once instead (wait_for_outcome).
LONG_ROUND_S = 420
SHORT_ROUND_S = 300


def wait_for_outcome(
    settings: RatchetSettings, alias: str, kind: str, nth: int = 1, timeout_s: float = 300
) -> dict[str, Any]:
    """The alias's `nth` round end (oldest first), which must be of `kind`: waits for whichever
    end comes, so a round that ends otherwise fails now, not at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        ends = [e for e in reversed(history(settings, alias)) if e["kind"] in ROUND_ENDS]
        if len(ends) >= nth:
            assert ends[nth - 1]["kind"] == kind, (kind, history(settings, alias))
            return ends[nth - 1]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no round end for {alias} in {timeout_s}s: {history(settings, alias)}"
            )
        time.sleep(0.05)


def served_by(env: Embedded, alias: str) -> str:
    response = httpx.post(
        f"{env.proxy_url}/v1/chat/completions",
        json={"model": alias, "messages": HELDOUT[0]["messages"], "max_tokens": 8},
        timeout=60,
    )
    response.raise_for_status()
    return response.headers["x-ratchet-served-name"]


def vllm_serves(env: Embedded, served_name: str) -> bool:
    """vLLM itself answers as `served_name` (its resolver loads the adapter from the store)."""
    response = httpx.post(
        f"{env.settings.vllm_url}/v1/chat/completions",
        headers=env.vllm_headers,
        json={"model": served_name, "messages": HELDOUT[0]["messages"], "max_tokens": 1},
        timeout=60,
    )
    return response.status_code == 200 and response.json()["model"] == served_name


# The fixtures `policy` and `base_answers` (the HF base model in this process, vLLM's greedy
# base answers to TRAIN) live in conftest.py, session-scoped: test_console uses them too, and a
# fixture imported into a second module would be built a second time there.


# The gate test's rounds: a dozen groups in one step at a learning rate too small to move a
# greedy answer, gated on 8 pairs of 16 tokens. The candidate ties the live version on every
# pair, so the gate's mechanics decide alone: at threshold 0.5 a tie is rejected, at 0 it
# passes. Whether training learns the right direction is the outcome lane's `loop` check
# (tests/outcomes/lane.py) and tests/unit/learner/test_trainer.py's.
TIED_ROUND = {"learning_rate": 1e-6, "steps_per_round": 1, "min_groups": 4}
# A gate of 8 pairs (with gate_tokens=16), for the tests that accept either verdict or force it.
SHORT_GATE = {"min_pairs": 8, "max_pairs": 8}


@pytest.mark.timeout(900)
def test_gate_rejects_a_tie_promotes_a_pass_and_rollback_restores(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    alias = "lt-gate"
    config = learner_config(
        embedded, tmp_path, alias, gate_tokens=16, gate=SHORT_GATE, **TIED_ROUND
    )
    settings = load_settings(config)
    port = settings.learner.metrics_port
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    produce(embedded, [*heldout_prompts(alias), *worse_groups(policy, alias, count=12)])
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]

    with running_learner(config, tmp_path / "state"):
        reject = wait_for_outcome(settings, alias, "reject", timeout_s=SHORT_ROUND_S)
        tied = reject["version"]
        gate = next(e for e in history(settings, alias) if e["kind"] == "gate")["detail"]
        # Rejected, whichever way a near-tie's few differing pairs fell: at threshold 0.5 a
        # pass needs most of the 8 pairs won. The gate stops once a pass is out of reach.
        assert not gate["passed"], gate
        assert gate["pairs"] == SHORT_GATE["max_pairs"] or gate["stopped_early"], gate
        assert store.is_rejected(alias, tied)
        # The rejected version is never served, though vLLM could serve it.
        assert vllm_serves(embedded, f"{alias}@v{tied}")
        assert served_by(embedded, alias) == BASE_MODEL
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'ratchet_learner_rounds_total{{alias="{alias}",result="rejected"}} 1.0' in metrics
        wait_until(lambda: learner_lag(settings) == 0, 30, "offsets committed after the round")

    # The same learner at threshold 0: a candidate not worse on every pair passes.
    config = learner_config(
        embedded,
        tmp_path,
        alias,
        gate_tokens=16,
        gate={**SHORT_GATE, "threshold": 0.0},
        **TIED_ROUND,
    )
    port = load_settings(config).learner.metrics_port
    improving = better_groups(policy, alias, base_answers, count=12)
    produce(embedded, improving)
    with running_learner(config, tmp_path / "state2"):
        promote = wait_for_outcome(settings, alias, "promote", nth=2, timeout_s=SHORT_ROUND_S)
        better = promote["version"]
        assert better > tied and promote["previous_version"] == 0
        gate = next(e for e in history(settings, alias) if e["kind"] == "gate")["detail"]
        assert gate["passed"] and gate["ci_low"] > 0.0, gate
        meta = store.meta(alias, better)
        assert meta["parent_version"] == 0
        assert sorted(meta["group_ids"]) == informative(improving)
        assert (store.path(alias, better) / "optimizer.pt").is_file()
        config_json = json.loads((store.path(alias, better) / "adapter_config.json").read_text())
        assert config_json["base_model_name_or_path"] == str(embedded.model_path)
        embedded.wait_for_proxy_route(alias, active_version=better)
        assert served_by(embedded, alias) == f"{alias}@v{better}"
        # Each learner process counts its own rounds.
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'ratchet_learner_rounds_total{{alias="{alias}",result="promoted"}} 1.0' in metrics

    started = time.monotonic()
    cli = subprocess.run(
        [sys.executable, "-m", "cli", "rollback", alias, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    route = embedded.registry.read(alias)
    assert route is not None and route.active == 0
    embedded.wait_for_proxy_route(alias, active_version=0)
    assert served_by(embedded, alias) == BASE_MODEL
    assert time.monotonic() - started < 30
    assert store.status(alias, better)["status"] == "rolled_back"  # type: ignore[index]

    kinds = [
        r.kind
        for r in embedded.find_records(
            EVENTS_TOPIC,
            lambda r: isinstance(r, LifecycleEvent) and r.alias == alias,
            count=7,
            timeout_s=30,
        )
    ]
    assert kinds == ["candidate", "gate", "reject", "candidate", "gate", "promote", "rollback"]


@pytest.mark.timeout(1200)
def test_learner_killed_mid_round_neither_loses_groups_nor_promotes_twice(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    alias = "lt-crash"
    # Either verdict will do here, so a short round: a dozen groups in 4 steps, started as soon
    # as they are in, and a gate of short answers (still seconds long: the kill lands while it
    # runs).
    config = learner_config(
        embedded, tmp_path, alias, gate_tokens=16, min_groups=4, steps_per_round=4
    )
    settings = load_settings(config)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    groups = better_groups(policy, alias, base_answers, count=12)
    produce(embedded, [*heldout_prompts(alias), *groups])

    # Killed mid-round: after the candidate is written, while it is being gated.
    stack = Stack([learner_part(settings, config)], tmp_path / "state1")
    stack.start()
    try:
        [candidate] = wait_for_event(settings, alias, {"candidate"})
        part = stack.part("learner")
        assert part.process is not None
        os.killpg(part.process.pid, signal.SIGKILL)
        part.process.wait(10)
    finally:
        stack.stop()
    assert not [e for e in history(settings, alias) if e["kind"] in {"promote", "reject", "gate"}]

    # Restarted: the same groups, trained again into a new version, gated once.
    with running_learner(config, tmp_path / "state2"):
        [outcome] = wait_for_event(settings, alias, {"promote", "reject"})
        store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
        assert outcome["version"] != candidate["version"]
        assert sorted(store.meta(alias, outcome["version"])["group_ids"]) == informative(groups)
        wait_until(lambda: learner_lag(settings) == 0, 30, "offsets committed after the round")

    # Killed after the outcome was stored but before the offsets were committed: rewind the
    # group's offsets to what they were, so the restarted learner reads every group again.
    rewind_offsets(settings)
    port = settings.learner.metrics_port
    with running_learner(config, tmp_path / "state3"):
        trained = len(informative(groups))
        expected = {"duplicate": trained, "zero_spread": len(groups) - trained}

        def counted() -> bool:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            return all(
                f'ratchet_learner_groups_total{{alias="{alias}",outcome="{outcome}"}} '
                f"{float(n)}" in metrics
                for outcome, n in expected.items()
            )

        # Joining the consumer group again can take a while: the broker waits out the old member.
        wait_until(counted, 180, f"re-read groups dropped as {expected}", 0.5)
    kinds = [e["kind"] for e in history(settings, alias)]
    assert kinds.count("promote") + kinds.count("reject") == 1, kinds
    assert kinds.count("candidate") == 2, kinds


def rewind_offsets(settings: RatchetSettings) -> None:
    """Set the learner's committed offsets on ratchet.groups back to the start of the topic."""
    from kafka import KafkaConsumer
    from kafka.structs import OffsetAndMetadata, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        group_id=settings.learner.consumer_group,
        enable_auto_commit=False,
    )
    try:
        partitions = [
            TopicPartition(GROUPS_TOPIC, p) for p in consumer.partitions_for_topic(GROUPS_TOPIC)
        ]
        starts = consumer.beginning_offsets(partitions)
        consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in starts.items()})
    finally:
        consumer.close()


@pytest.mark.timeout(1200)
def test_a_canary_users_dislike_is_rolled_back_by_itself(
    embedded: Embedded, policy: BasePolicy, base_answers: list[str], tmp_path: Path
) -> None:
    """A canary its users rate down is rolled back by the ratings' test; the round the learner
    trained on from it meanwhile is then rejected without a gate."""
    alias = "lt-canary"
    # Long enough a wait that only the ratings' sequential test can decide (all-0 against all-1
    # ratings fail it at 15 pairs).
    canary = {
        "weight": 0.5,
        "min_requests": 16,
        "min_feedback": 4,
        "max_feedback_drop": 0.1,
        "feedback_wait_s": 900,
    }
    # What is under test is the canary, not the candidate: any candidate the learner puts on
    # canary will do. So a round of a dozen groups (those whose rewards differ) in 2 steps, and
    # a gate of 8 short pairs that passes anything not worse on every pair (threshold 0); users
    # then decide.
    gate = {"min_pairs": 8, "max_pairs": 8, "threshold": 0.0}
    config = learner_config(
        embedded,
        tmp_path,
        alias,
        canary=canary,
        gate_tokens=16,
        gate=gate,
        steps_per_round=2,
        min_groups=4,
    )
    settings = load_settings(config)
    embedded.registry.write(AliasRoute(alias=alias, base_model=BASE_MODEL))
    groups = better_groups(policy, alias, base_answers, count=12)
    produce(embedded, [*heldout_prompts(alias), *groups])

    with running_learner(config, tmp_path / "state"):
        started = wait_for_outcome(settings, alias, "canary", timeout_s=SHORT_ROUND_S)
        candidate = started["version"]
        route = embedded.registry.read(alias)
        assert route is not None and (route.active, route.canary) == (0, candidate)
        embedded.wait_for_proxy_route(alias, active_version=0, canary_version=candidate)
        # The judge samples the next round's groups from the canary while it runs: the learner
        # trains on from it and holds the candidate, ungated, for the canary's end.
        on_canary = [
            g.model_copy(update={"group_id": f"{g.group_id}-on-canary", "version": candidate})
            for g in groups
        ]
        produce(embedded, on_canary)
        trained = wait_for_event(settings, alias, {"candidate"}, count=2, timeout_s=SHORT_ROUND_S)
        [held] = [e for e in trained if e["version"] != candidate]
        assert held["previous_version"] == candidate, held
        assert held["detail"]["trained_from"] == candidate, held
        # Users on the canary arm rate every answer 0, the others 1: the canary is worse. Sent
        # 32 at a time, 8 at once, until the canary is decided (one batch usually does).
        from tests.integration.scripted_users import canary_disliked, rate_canary_until_decided

        _, arms = rate_canary_until_decided(
            embedded, settings, alias, PROMPTS[200:296], canary_disliked
        )
        # A decision at 15 or more rating pairs had 15 or more answers from each arm.
        assert arms.get("canary", 0) >= 15 and arms.get("active", 0) >= 15, arms
        [rollback] = wait_for_event(settings, alias, {"rollback", "promote"}, timeout_s=120)
        [reject] = wait_for_event(settings, alias, {"reject"}, timeout_s=60)

    assert (reject["version"], reject["detail"]["reason"]) == (
        held["version"],
        f"trained on from canary v{candidate}, which was rolled back",
    ), reject
    assert [e["kind"] for e in history(settings, alias)].count("gate") == 1  # the canary's only
    assert rollback["kind"] == "rollback", rollback
    assert (rollback["previous_version"], rollback["version"]) == (candidate, 0), rollback
    # Decided by the sequential test on the live ratings, with its evidence.
    assert rollback["detail"]["reason"].startswith("ratings: "), rollback
    evidence = rollback["detail"]["ratings"]
    # At most the pairs of the batches sent: decided on the first, or on a later one when the
    # watcher looked only after a batch (a loaded host).
    assert evidence["decision"] == "fail" and 15 <= evidence["n"] <= 48, evidence
    assert evidence["upper"] < 0.45, evidence
    route = embedded.registry.read(alias)
    assert route is not None and (route.active, route.canary) == (0, None)
    embedded.wait_for_proxy_route(alias, active_version=0, canary_version=None)
    assert served_by(embedded, alias) == BASE_MODEL
    store = AdapterStore(embedded.settings.store_dir)  # type: ignore[arg-type]
    assert store.status(alias, candidate)["status"] == "rolled_back"  # type: ignore[index]

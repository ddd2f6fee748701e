"""Served equals trained, for real: two vLLM replicas, one of which serves a different adapter
under the candidate's name, as a replica whose adapter store was altered would.

The session's vLLM is the honest replica. The altered one is that same vLLM behind an HTTP
relay that answers every ``served-check@vN`` with ``served-check@v50``, a random adapter in the
store (a second vLLM CPU engine would double the suite's memory and start-up for the same
answers). A learner round on real groups, sampled from the base model by vLLM with their
logprobs, trains a candidate; before its gate every replica is asked for the candidate's probe:

- with both replicas the altered one is found: the candidate is rejected with a reason that names
  it (and not the honest one), and no canary starts;
- once the altered replica is mended (the relay stops renaming), the next candidate matches its
  fingerprint on both, is gated, passes (a tie at threshold 0) and its canary starts: the check
  is what stopped the first.

And a replica that cannot load the candidate (the relay answers vLLM's 404 for every
``served-check@vN``, and relays the base model): the candidate goes to canary on the honest
replica alone, its exclusion kept in Redis; through a proxy of the test's own in front of both
(round robin, so every other request would go to each), no request for the candidate ever
reaches the altered replica, the gate's included, and requests for the active version still do.

Each round also measures its groups' drift: vLLM's logged logprobs of the base model against the
learner's own, which must be within the float32 tolerance.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
import torch
import yaml
from aiohttp import web

from embedded.adapters import write_random_adapters
from embedded.processes import Stack
from embedded.stack import proxy_part
from learner.fingerprint import fingerprint, probe_token_ids
from learner.heldout import HeldoutPool
from learner.served_check import ServedCheck
from learner.service import LearnerService
from ratchet.records import HeldoutPrompt, Sample, ScoredGroup, prompt_hash
from ratchet.registry import AliasRoute
from ratchet.secrets import vllm_api_key
from ratchet.settings import (
    AliasConfig,
    CanaryConfig,
    GateConfig,
    LearnerSettings,
    LoraSettings,
    RewardConfig,
    ServedCheckSettings,
    load_settings,
)
from ratchet.store import AdapterStore
from ratchet.version_exclusion import read_excluded
from tasks.demo import load_prompts
from tests.integration.conftest import BASE_MODEL, Embedded, free_port, vllm_headers, write_config

pytestmark = pytest.mark.integration

ALIAS = "served-check"
OTHER = 50  # the version the altered replica serves, whatever version it is asked for
FLOAT32_TOLERANCE = ServedCheckSettings().tolerance_float32


class Relay:
    """An HTTP relay to the honest replica; while ``altered``, it serves ``served-check@v50``
    under every version's name; while ``refusing``, it answers vLLM's 404 for every version
    (not the base model). ``asked`` counts the requests it got by (path, model)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.altered = True
        self.refusing = False
        self.asked: Counter[tuple[str, str]] = Counter()


@contextlib.contextmanager
def altered_replica(vllm_url: str) -> Iterator[Relay]:
    """Start a :class:`Relay` to ``vllm_url``."""
    port = free_port()
    state = Relay(port)
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def relay(request: web.Request) -> web.Response:
        body = await request.json()
        model = str(body.get("model"))
        state.asked[request.path, model] += 1
        a_version = re.fullmatch(rf"{ALIAS}@v\d+", model)
        if state.refusing and a_version:
            error = {"message": f"The model `{model}` does not exist.", "code": 404}
            return web.json_response({"error": error}, status=404)
        if state.altered and a_version:
            body["model"] = f"{ALIAS}@v{OTHER}"
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{vllm_url}{request.path}",
                json=body,
                headers={"authorization": request.headers.get("authorization", "")},
            ) as upstream,
        ):
            return web.Response(
                status=upstream.status,
                body=await upstream.read(),
                content_type="application/json",
            )

    async def relay_get(request: web.Request) -> web.Response:  # /health, /v1/models
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{vllm_url}{request.path}",
                headers={"authorization": request.headers.get("authorization", "")},
            ) as upstream,
        ):
            return web.Response(status=upstream.status, body=await upstream.read())

    app = web.Application()
    app.router.add_post("/v1/{tail:.*}", relay)
    app.router.add_get("/{tail:.*}", relay_get)
    runner = web.AppRunner(app)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, name="altered-replica", daemon=True)
    thread.start()
    assert started.wait(30), "the altered replica did not start"
    try:
        yield state
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def sampled_groups(env: Embedded, count: int = 2) -> list[ScoredGroup]:
    """Groups of two answers the base model sampled through vLLM, with vLLM's logprobs of each
    sampled token, as the judge logs them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(env.model_path)
    groups = []
    for i, prompt in enumerate(load_prompts()[360 : 360 + count]):
        text = tokenizer.apply_chat_template(
            prompt["messages"], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        reply = httpx.post(
            f"{env.settings.vllm_url}/v1/completions",
            headers=vllm_headers(env.settings),
            timeout=120,
            json={
                "model": BASE_MODEL,
                "prompt": list(ids),
                "max_tokens": 8,
                "n": 2,
                "temperature": 1.0,
                "seed": i,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        reply.raise_for_status()
        samples = [
            Sample(
                message={"role": "assistant", "content": c["text"]},
                text=c["text"],
                token_ids=c["token_ids"],
                logprobs=c["logprobs"]["token_logprobs"],
            )
            for c in reply.json()["choices"]
        ]
        groups.append(
            ScoredGroup(
                group_id=f"served-check-{i}",
                alias=ALIAS,
                version=0,
                response_model=BASE_MODEL,
                prompt_messages=prompt["messages"],
                prompt_token_ids=list(ids),
                samples=samples,
                rewards=[0.0, 1.0],
                traffic_request_id=f"served-check-{i}",
            )
        )
    return groups


def heldout_pool() -> HeldoutPool:
    pool = HeldoutPool(capacity=16)
    for i, prompt in enumerate(load_prompts()[364:366]):
        pool.add(
            HeldoutPrompt(
                prompt_hash=prompt_hash(prompt["messages"], None),
                alias=ALIAS,
                prompt_messages=prompt["messages"],
                traffic_request_id=f"served-check-heldout-{i}",
            )
        )
    return pool


def learner(env: Embedded, endpoints: list[str]) -> LearnerService:
    """A learner on the session's stack whose gate and served check ask ``endpoints``."""
    settings = env.settings.model_copy(
        update={
            "vllm_endpoints": endpoints,
            "learner": LearnerSettings(
                base_model_path=str(env.model_path),
                device="cpu",
                steps_per_round=1,
                # Barely moves the weights: the gate's greedy answers tie, which passes.
                learning_rate=1e-6,
                lora=LoraSettings(rank=4, alpha=8),
                served_check=ServedCheckSettings(served_precision="float32", wait_s=4),
            ),
            "aliases": {
                ALIAS: AliasConfig(
                    base_model=BASE_MODEL,
                    reward=RewardConfig(
                        kind="verifier",
                        verifier="tests.integration.replica_reward:text_hash_reward",
                    ),
                    gate=GateConfig(min_pairs=2, max_pairs=2, max_tokens=8, threshold=0.0),
                    canary=CanaryConfig(weight=0.5),
                )
            },
        }
    )
    service = LearnerService(settings, base_model_path=env.model_path)
    service.lifecycle.sink = None  # Redis history only
    return service


def served_distance(env: Embedded, store: AdapterStore, replica: str) -> float:
    """The probe distance between ``served-check@v50`` under peft in this process and as the
    replica serves it (a LoRA that moves the logprobs, unlike a round's 1e-6 step)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(env.model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(store.path(ALIAS, OTHER)))
    probe = probe_token_ids(AutoTokenizer.from_pretrained(env.model_path))
    taken = fingerprint(model, probe, torch.device("cpu"), "float32")
    check = ServedCheck(vllm_api_key(env.settings), timeout_s=120, wait_s=0, limit=1.0)
    verdict = asyncio.run(check.verdict([replica], f"{ALIAS}@v{OTHER}", taken))
    [answer] = verdict.checks
    assert answer.distance is not None, answer
    return answer.distance.mean_abs


def route_of(service: LearnerService) -> AliasRoute:
    route = service.writer.read(ALIAS)
    assert route is not None
    return route


def sample(service: LearnerService, name: str, **labels: str) -> float | None:
    return service.metrics.registry.get_sample_value(name, labels)


def checks(service: LearnerService, replica: str, outcome: str) -> float:
    counted = sample(service, "ratchet_learner_served_checks_total",
                     alias=ALIAS, replica=replica, outcome=outcome)  # fmt: skip
    return counted or 0.0


def distance_of(service: LearnerService, replica: str) -> float:
    gap = sample(service, "ratchet_learner_served_distance", alias=ALIAS, replica=replica)
    assert gap is not None, replica
    return gap


@pytest.mark.timeout(1200)
def test_a_replica_serving_another_adapter_under_the_name_is_found_before_the_canary(
    embedded: Embedded, tmp_path: Path
) -> None:
    env = embedded
    assert env.settings.store_dir is not None
    store = AdapterStore(env.settings.store_dir)
    write_random_adapters(env.model_path, store, ALIAS, [OTHER])
    groups = sampled_groups(env)
    honest = env.settings.vllm_url.rstrip("/")

    # vLLM's LoRA and peft's agree: the random adapter, fingerprinted here and served there.
    lora_gap = served_distance(env, store, honest)
    assert lora_gap <= FLOAT32_TOLERANCE, lora_gap

    with altered_replica(honest) as relay:
        altered = relay.url
        service = learner(env, [honest, altered])
        writer = service.writer
        writer.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))
        report = service.rounds.run(ALIAS, route_of(service), groups, heldout_pool())
        reason = report.gate.reason
        print(f"\nan altered replica: v{report.version} {report.outcome}: {reason}")
        assert report.outcome == "rejected", reason
        assert f"{altered} serves other weights" in reason, reason
        assert honest not in reason, reason
        assert report.gate.pairs == 0  # never gated
        assert route_of(service).canary is None
        events = [e for e in writer.history(ALIAS, 100) if e["version"] == report.version]
        assert {e["kind"] for e in events} == {"candidate", "gate", "reject"}, events
        reject = next(e for e in events if e["kind"] == "reject")
        assert altered in reject["detail"]["reason"]
        assert checks(service, altered, "mismatch") >= 1
        assert checks(service, honest, "match") == 1
        honest_gap = distance_of(service, honest)
        altered_gap = distance_of(service, altered)
        assert honest_gap <= FLOAT32_TOLERANCE < 10 * FLOAT32_TOLERANCE < altered_gap
        # The round's groups were sampled from the base model, which the round started from.
        # Groups that do not name their replica (as the judge's before the field): unknown.
        drift = sample(service, "ratchet_learner_served_drift", alias=ALIAS, replica="unknown")
        assert drift is not None and drift <= FLOAT32_TOLERANCE, drift
        assert store.meta(ALIAS, report.version)["served_drift"]["tokens"] > 0

        # Mended: the next candidate is served as trained by both, gated, and goes to canary.
        relay.altered = False
        second = service.rounds.run(ALIAS, route_of(service), groups, heldout_pool())
        print(f"mended: v{second.version} {second.outcome}: {second.gate.reason}")
        assert second.outcome == "canary", second.gate.reason
        assert second.gate.pairs == 2
        assert route_of(service).canary == second.version
        # The counters are per replica and outcome, over both rounds.
        assert checks(service, honest, "match") == 2 and checks(service, altered, "match") == 1
    print(
        f"probe distance, float32 learner vs float32 vLLM: {honest_gap:.2e} per token; "
        f"the altered replica: {altered_gap:.3f}; drift of the sampled groups: {drift:.2e}; "
        f"a random rank-8 LoRA, peft vs vLLM: {lora_gap:.2e}"
    )


@contextlib.contextmanager
def fleet_proxy(env: Embedded, home: Path, endpoints: list[str]) -> Iterator[str]:
    """A proxy of the test's own in front of ``endpoints``, on the session's Kafka and Redis,
    serving ALIAS, each request to the next replica in turn (round robin)."""
    home.mkdir(parents=True, exist_ok=True)
    path, config = write_config(home, balance="round_robin", upstream_health_interval_s=0.5)
    config["kafka_bootstrap_servers"] = env.settings.kafka_bootstrap_servers
    config["redis_url"] = env.settings.redis_url
    config["vllm_url"] = endpoints[0]
    config["vllm_endpoints"] = endpoints
    config["vllm_api_key"] = vllm_api_key(env.settings)
    config["aliases"] = {ALIAS: {"base_model": BASE_MODEL}}
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    stack = Stack([proxy_part(settings, path)], home / "stack")
    stack.start()
    try:
        yield f"http://127.0.0.1:{settings.proxy.port}"
    finally:
        stack.stop()


def ask_proxy(proxy: str, user: str) -> tuple[int, str | None]:
    """(status, the version that answered) of one chat request for ALIAS."""
    response = httpx.post(
        f"{proxy}/v1/chat/completions",
        timeout=120,
        headers={"x-ratchet-sticky-key": user},
        json={
            "model": ALIAS,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 2,
        },
    )
    return response.status_code, response.headers.get("x-ratchet-version")


def chats(relay: Relay, model: str) -> int:
    return relay.asked["/v1/chat/completions", model]


@pytest.mark.timeout(1200)
def test_a_replica_that_cannot_load_the_candidate_is_out_of_its_rotation_only(
    embedded: Embedded, tmp_path: Path
) -> None:
    env = embedded
    groups = sampled_groups(env)
    honest = env.settings.vllm_url.rstrip("/")
    with altered_replica(honest) as relay:
        relay.altered, relay.refusing = False, True
        altered = relay.url
        service = learner(env, [honest, altered])
        service.writer.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))  # v0, no canary
        with fleet_proxy(env, tmp_path / "proxy", [honest, altered]) as proxy:
            # Both replicas in the proxy's turn: the base model's requests reach the relay.
            deadline = time.monotonic() + 60
            while chats(relay, BASE_MODEL) == 0:
                assert time.monotonic() < deadline, "the proxy never sent a request to the relay"
                assert ask_proxy(proxy, "warm-up")[0] == 200

            report = service.rounds.run(ALIAS, route_of(service), groups, heldout_pool())
            print(f"\na replica that cannot load it: v{report.version} {report.outcome}: "
                  f"{report.gate.reason}")  # fmt: skip
            candidate = f"{ALIAS}@v{report.version}"
            assert report.outcome == "canary", report.gate.reason
            assert report.gate.pairs == 2  # gated, on the honest replica
            assert route_of(service).canary == report.version
            excluded = read_excluded(service.writer.redis, ALIAS, report.version)
            assert list(excluded) == [altered], excluded
            assert "HTTP 404" in excluded[altered], excluded
            assert checks(service, altered, "unloaded") >= 1
            assert checks(service, honest, "match") >= 1
            # The relay was asked only the served check's probe, never a gate answer.
            assert relay.asked["/v1/completions", candidate] >= 1
            assert chats(relay, candidate) == 0

            # Through the proxy: each arm answered, the candidate never by the relay.
            before = chats(relay, BASE_MODEL)
            versions: Counter[str | None] = Counter()
            deadline = time.monotonic() + 300
            i = 0
            while versions[str(report.version)] < 4 or versions["0"] < 4:
                assert time.monotonic() < deadline, versions
                status, version = ask_proxy(proxy, f"user-{i}")
                assert status == 200, (status, version)
                versions[version] += 1
                i += 1
            assert chats(relay, candidate) == 0, relay.asked
            assert chats(relay, BASE_MODEL) > before, relay.asked  # the active version still
        print(f"answered by version: {dict(versions)}; the relay was asked {dict(relay.asked)}")

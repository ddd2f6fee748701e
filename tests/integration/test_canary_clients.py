"""The canary's test over clients (issue 53) on the real stack: a proxy with API keys, one of
them an app that vouches for its 50 users, another an attacker's key that tells the arms apart.
Traffic and ratings go through the real proxy to Kafka; the canary watcher reads the records as
its consumer would and decides in the shared Redis, through the real Lifecycle.

- A canary on an alias that learns from ratings is not decided before its first ratings arrive,
  however many requests it served.
- The attacker rates every canary answer it got 0 and every active one 1: alone, it decides
  nothing (one client, below canary.min_clients).
- The app's users like both arms: their ratings promote the candidate, with the attacker's
  ratings among them.
- An answer from the real vLLM has the same shape (status, header names, body keys, model)
  with and without a canary, on either arm.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
import yaml

from embedded.processes import Stack
from embedded.stack import proxy_part
from learner.canary import CanaryWatcher
from learner.metrics import LearnerMetrics
from proxy.generation import ARM_HEADER, SERVED_NAME_HEADER, VERSION_HEADER
from ratchet.canary_state import canary_key, read_ratings_summary, reset_counts
from ratchet.lifecycle import Lifecycle
from ratchet.records import FEEDBACK_TOPIC, TRAFFIC_TOPIC, FeedbackRecord, Record, TrafficRecord
from ratchet.registry import RegistryWriter
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, CanaryConfig, RatchetSettings, load_settings
from ratchet.store import AdapterStore
from tests.integration.conftest import ALIAS, BASE_MODEL, Embedded, write_config

APP, ATTACKER, ADMIN = "sk-canary-app", "sk-canary-attacker", "sk-canary-admin"
ARM_HEADERS = {ARM_HEADER, VERSION_HEADER, SERVED_NAME_HEADER}
USERS = 50
ATTACKER_ANSWERS = 16
# Small minimums so that 50 users decide: six clients an arm before any ratings verdict (looks at
# 6, 12, 24 clients), one rating a client; a wait far longer than the test. About 25 clients an
# arm, all thumbs up, show "not worse" only by a wide margin (0.5): thumbs are never read as
# exact (learner/canary_clients.py's padded), and the look at 24 is held to alpha/8 of alpha.
CANARY = CanaryConfig(
    weight=0.5,
    min_requests=10,
    min_clients=6,
    client_ratings=1,
    max_feedback_drop=0.5,
    feedback_wait_s=3600,
)


@dataclass
class Keyed:
    url: str
    settings: RatchetSettings


@pytest.fixture(scope="module")
def keyed(embedded: Embedded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    """A proxy beside the session's, against its vLLM, Kafka and Redis: the app's key vouches
    for its users (each user is a client), the attacker's key is one client."""
    home = tmp_path_factory.mktemp("canary-clients")
    proxy = {
        "api_keys": [APP, ATTACKER, ADMIN],
        "admin_key": ADMIN,
        "user_vouching_keys": [APP],
        "expose_arm": False,
    }
    path, config = write_config(home, **proxy)
    config["kafka_bootstrap_servers"] = embedded.settings.kafka_bootstrap_servers
    config["redis_url"] = embedded.settings.redis_url
    config["vllm_url"] = embedded.settings.vllm_url
    config["vllm_api_key"] = vllm_api_key(embedded.settings)
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    part = proxy_part(settings, path)
    part.name = "proxy-canary-clients"
    stack = Stack([part], tmp_path_factory.mktemp("canary-clients-stack"))
    stack.start()
    try:
        yield Keyed(f"http://127.0.0.1:{settings.proxy.port}", settings)
    finally:
        stack.stop()


@contextlib.contextmanager
def canary_of_v1(embedded: Embedded, keyed: Keyed) -> Iterator[None]:
    """v1 on canary beside v0 (half the traffic), its counts reset as the learner resets them;
    afterwards v0 alone again, whatever the watcher did."""
    embedded.set_route(active=0, canary=1, canary_weight=0.5)
    pipe = embedded.registry.redis.pipeline()
    reset_counts(pipe, ALIAS, 1)
    pipe.execute()
    deadline = time.monotonic() + 15
    url, headers = f"{keyed.url}/v1/models/{ALIAS}", {"Authorization": f"Bearer {ADMIN}"}
    while httpx.get(url, headers=headers).json()["ratchet"]["canary_version"] != 1:
        assert time.monotonic() < deadline, "the proxy never saw the canary"
        time.sleep(0.1)
    try:
        yield
    finally:
        embedded.set_route(active=0, canary=None, canary_weight=0.0)
        pipe = embedded.registry.redis.pipeline()
        reset_counts(pipe, ALIAS, 1)
        pipe.delete(canary_key(ALIAS))
        pipe.execute()


def answer(client: httpx.Client, key: str, **fields: Any) -> str:
    """One short generation on the alias; its completion id."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    reply = client.post(
        "/v1/chat/completions", json=body | fields, headers={"Authorization": f"Bearer {key}"}
    )
    assert reply.status_code == 200, reply.text[:300]
    return str(reply.json()["id"])


def rate(client: httpx.Client, key: str, completion: str, score: float) -> None:
    reply = client.post(
        "/v1/feedback",
        json={"completion_id": completion, "score": score},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert reply.status_code == 200, reply.text[:300]


def as_read(records: list[Record]) -> list[Any]:
    """Records as the watcher's consumer hands them over."""
    return [SimpleNamespace(topic=r.TOPIC, value=r.to_json()) for r in records]


def test_users_not_one_key_decide_the_canary(embedded: Embedded, keyed: Keyed) -> None:
    settings = load_settings(embedded.config_path)
    alias = AliasConfig(base_model=BASE_MODEL, reward={"kind": "feedback"}, canary=CANARY)
    settings = settings.model_copy(update={"aliases": {ALIAS: alias}})
    assert settings.store_dir is not None
    writer = RegistryWriter(settings.redis_url, settings.aliases)
    lifecycle = Lifecycle(writer, AdapterStore(settings.store_dir), sink=None)
    with canary_of_v1(embedded, keyed), httpx.Client(base_url=keyed.url, timeout=120) as client:
        watcher = CanaryWatcher(settings, lifecycle, LearnerMetrics(), threading.Event())
        watcher.routes = writer.read_all().routes
        # Each user is one client, on the arm its sticky `user` draws; the attacker's sticky
        # values reach both arms.
        users = {answer(client, APP, user=f"user-{i}"): i for i in range(USERS)}
        stolen = [answer(client, ATTACKER, user=f"probe-{i}") for i in range(ATTACKER_ANSWERS)]
        ids = set(users) | set(stolen)
        traffic = embedded.find_records(
            TRAFFIC_TOPIC,
            lambda r: isinstance(r, TrafficRecord) and r.response_id in ids,
            count=len(ids),
        )
        arms = {r.response_id: r.canary_arm for r in traffic if isinstance(r, TrafficRecord)}
        assert set(arms[c] for c in stolen) == {"active", "canary"}, arms
        watcher.count(as_read(traffic))
        # 66 answers on the two arms, 50 clients among them, and not one rating: an alias
        # that learns from ratings waits for them.
        watcher.check()
        assert writer.read(ALIAS) is not None
        route = writer.read(ALIAS)
        assert route is not None and (route.active, route.canary) == (0, 1)

        # The attacker tells the arms apart: the canary's answers 0, the active arm's 1.
        for completion in stolen:
            rate(client, ATTACKER, completion, 0.0 if arms[completion] == "canary" else 1.0)
        vetoes = embedded.find_records(
            FEEDBACK_TOPIC,
            lambda r: isinstance(r, FeedbackRecord) and r.completion_id in stolen,
            count=len(stolen),
        )
        watcher.count(as_read(vetoes))
        watcher.check()
        route = writer.read(ALIAS)
        assert route is not None and (route.active, route.canary) == (0, 1)
        summary = read_ratings_summary(writer.redis, ALIAS)
        assert summary is not None and summary["clients"] == {"active": 1, "canary": 1}

        # The users like what they got, on either arm.
        for completion in users:
            rate(client, APP, completion, 1.0)
        liked = embedded.find_records(
            FEEDBACK_TOPIC,
            lambda r: isinstance(r, FeedbackRecord) and r.completion_id in users,
            count=len(users),
        )
        watcher.count(as_read(liked))
        watcher.check()
        route = writer.read(ALIAS)
        assert route is not None and (route.active, route.canary) == (1, None), route
        event = writer.history(ALIAS)[0]
        assert event["detail"]["reason"].startswith("ratings: not worse"), event
        assert event["detail"]["ratings"]["decision"] == "pass", event


def shape(response: httpx.Response) -> tuple[Any, ...]:
    """What a client can compare between two answers to the same request: the status, the
    header names (values such as the request id differ by nature), and for the JSON object or
    each kind of stream event its keys and ``model``."""
    headers = tuple(sorted(response.headers.keys()))
    if response.headers["content-type"].startswith("application/json"):
        body = response.json()
        return response.status_code, headers, tuple(body), body["model"]
    events = [orjson.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    # Each kind of event once, in order: the two versions may stop after different numbers of
    # tokens, which no canary causes (the same versions differ so without one).
    kinds = dict.fromkeys((tuple(e), e.get("model")) for e in events)
    return response.status_code, headers, tuple(kinds)


def test_an_answer_has_the_same_shape_with_or_without_a_canary(
    embedded: Embedded, keyed: Keyed
) -> None:
    """Issue 53: nothing a client reads tells it that a canary runs or which arm answered it
    (proxy.expose_arm off), on the real vLLM: the same requests, without and with a canary."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    kinds: list[dict[str, Any]] = [{}, {"stream": True, "stream_options": {"include_usage": True}}]
    headers = {"Authorization": f"Bearer {APP}"}

    def answers(client: httpx.Client) -> list[httpx.Response]:
        return [
            client.post(
                "/v1/chat/completions", json=body | kind | {"user": f"shape-{i}"}, headers=headers
            )
            for i in range(8)
            for kind in kinds
        ]

    with httpx.Client(base_url=keyed.url, timeout=120) as client:
        plain = answers(client)
        with canary_of_v1(embedded, keyed):
            canary = answers(client)
    ids = {
        r.json()["id"] for r in canary if r.headers["content-type"].startswith("application/json")
    }
    traffic = embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.response_id in ids,
        count=len(ids),
    )
    assert {r.canary_arm for r in traffic if isinstance(r, TrafficRecord)} == {"active", "canary"}
    for response in [*plain, *canary]:
        assert response.status_code == 200, response.text[:300]
        assert not ARM_HEADERS & set(response.headers), response.headers
        assert b"@v" not in response.content
    assert [shape(r) for r in plain] == [shape(r) for r in canary]

"""The hostile-client test's parts beyond raw HTTP: the proxies under attack, what a case
expects, and the attacks that take more than one request (learning-signal abuse, rate limits,
a flood of connections)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import yaml
from kafka.structs import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from embedded.processes import Stack
from embedded.stack import proxy_part
from ratchet.bus import make_consumer
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord, decode
from ratchet.secrets import vllm_api_key
from ratchet.settings import load_settings
from tests.integration.conftest import Embedded, write_config
from tests.integration.hostile_http import (
    CHAT,
    Answer,
    Exchange,
    Proxy,
    Send,
    auth_headers,
    chat,
    chat_body,
    envelope_problems,
    exchange,
    head,
    leaks,
    post,
    request_bytes,
)

ONE, TWO, ADMIN = "sk-hostile-one", "sk-hostile-two", "sk-hostile-admin"
RL_A, RL_B, RL_C, RL_D, RL_NORMAL = "sk-rl-a", "sk-rl-b", "sk-rl-c", "sk-rl-d", "sk-rl-normal"
RL_E = "sk-rl-e"
TIMEOUT_S = 2.0  # the keyed proxy's header, body and keep-alive timeouts
MAX_CONCURRENCY = 16
KEYED = {
    "api_keys": [ONE, TWO],
    "admin_key": ADMIN,
    "metrics_auth": True,
    "header_timeout_s": TIMEOUT_S,
    "body_timeout_s": TIMEOUT_S,
    "keepalive_timeout_s": TIMEOUT_S,
    "max_body_bytes": 65536,
    "max_concurrency": MAX_CONCURRENCY,
    "max_n": 4,
    "max_choices": 8,
    "max_messages": 8,
    "max_tokens": 64,
    # The session's proxy shows arms to the tests; a public one must not.
    "expose_arm": False,
}
LIMITED = {
    "api_keys": [RL_A, RL_B, RL_C, RL_D, RL_E, RL_NORMAL],
    # A day budget of one token a second: what a key spent reads off its bucket's TTL. Redis is
    # given a second to answer: budgets fail closed, and the test machine is loaded.
    "rate_limit": {"requests_per_minute": 2, "tokens_per_day": 86_400, "timeout_s": 1.0},
}
ARM_HEADERS = ("x-ratchet-canary-arm", "x-ratchet-version", "x-ratchet-served-name")
FEEDBACK = "/v1/feedback"
GET_HEALTHZ = head("GET", "/healthz")


@dataclass
class Env:
    embedded: Embedded
    proxies: dict[str, Proxy]  # open (the session's), keyed, limited
    stack: Stack  # the keyed and limited proxies
    logs: dict[str, Path]  # each proxy's log
    log_start: dict[str, int]  # the size of each log when the module began

    def log_size(self, proxy: Proxy) -> int:
        return self.logs[proxy.name].stat().st_size

    def logged_since(self, proxy: Proxy, offset: int) -> str:
        with self.logs[proxy.name].open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


@contextlib.contextmanager
def hostile_proxies(embedded: Embedded, homes: Callable[[str], Path]) -> Iterator[Env]:
    """The keyed and limited proxies, started beside the session's against its vLLM, Kafka and
    Redis. Each has a home of its own (``homes(name)``), hence its own server secret; vLLM's key
    is the session's."""
    proxies = {"open": Proxy("open", embedded.settings.proxy.port, None)}
    session_proxy = embedded.stack.part("proxy")
    parts = []
    for name, proxy_settings, key in (("keyed", KEYED, ONE), ("limited", LIMITED, RL_NORMAL)):
        path, config = write_config(homes(name), **proxy_settings)
        config["kafka_bootstrap_servers"] = embedded.settings.kafka_bootstrap_servers
        config["redis_url"] = embedded.settings.redis_url
        config["vllm_url"] = embedded.settings.vllm_url
        config["vllm_api_key"] = vllm_api_key(embedded.settings)
        path.write_text(yaml.safe_dump(config))
        settings = load_settings(path)
        part = proxy_part(settings, path)
        part.name = f"proxy-{name}"  # a Stack finds its parts, and names their logs, by name
        parts.append(part)
        proxies[name] = Proxy(name, settings.proxy.port, key, ADMIN if name == "keyed" else None)
    stack = Stack(parts, homes("stack"))
    stack.start()
    try:
        logs: dict[str, Path] = {}
        for name, part in zip(proxies, [session_proxy, *parts], strict=True):
            assert part.log_path is not None
            logs[name] = part.log_path
        start = {name: log.stat().st_size for name, log in logs.items()}
        yield Env(embedded, proxies, stack, logs, start)
    finally:
        stack.stop()


# ---- what a case expects ------------------------------------------------------------------------

Check = Callable[[Exchange], None]


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # which proxy: open, keyed or limited
    send: Send
    status: int | None  # of the first answer; None: the connection ends without one
    code: str | None = None  # the envelope's code
    says: str | None = None  # in the envelope's message (a limit names its setting)
    check: Check | None = None
    bodiless: bool = False  # answers to HEAD: the envelope's headers, no body


def assert_answered(case: Case, result: Exchange) -> None:
    """Status, envelope and no leak, for every answer the connection gave; no redirect."""
    assert not leaks(result.raw), result.raw[:2000]
    for answer in result.answers:
        assert answer.header("server") is None and answer.header("location") is None
        if answer.status >= 400 and not case.bodiless:
            assert not envelope_problems(answer), (envelope_problems(answer), answer.body[:300])
    if case.status is None:
        assert not result.answers, result.raw[:300]
        return
    first = result.first
    assert first.status == case.status, first.body[:500]
    if case.code is not None or case.says is not None:
        error = first.json()["error"]
        assert case.code is None or error["code"] == case.code, error
        assert case.says is None or case.says in error["message"], error


def statuses(*expected: int) -> Check:
    def check(result: Exchange) -> None:
        assert [answer.status for answer in result.answers] == list(expected)

    return check


# What a loaded slow host adds to a timeout before the answer or close is seen (1.5 s was
# missed): 2 s + 3 s stays under the 3 x TIMEOUT_S a silent connection is read for.
SLACK_S = 3.0


def answered_within(seconds: float, slack_s: float = SLACK_S) -> Check:
    def check(result: Exchange) -> None:
        assert result.first_byte_s is not None and result.first_byte_s <= seconds + slack_s

    return check


def closed_within(seconds: float, slack_s: float = SLACK_S) -> Check:
    def check(result: Exchange) -> None:
        assert result.closed and result.elapsed_s <= seconds + slack_s

    return check


def header(name: str, predicate: Callable[[str], bool] = bool) -> Check:
    def check(result: Exchange) -> None:
        value = result.first.header(name)
        assert value is not None and predicate(value), f"{name}: {value!r}"

    return check


def body_has(text: bytes) -> Check:
    def check(result: Exchange) -> None:
        assert text in result.first.body, result.first.body[:300]

    return check


def choices(count: int) -> Check:
    def check(result: Exchange) -> None:
        assert len(result.first.json()["choices"]) == count

    return check


def wrong(field: str, *values: Any, send: Callable[..., Send] = chat) -> list[Case]:
    """One case per value of ``field`` of the wrong type or range, on the keyed proxy: 400,
    naming the field."""
    return [
        Case(f"bound-{field}={value!r}"[:50], "keyed", send(**{field: value}), 400, says=field)
        for value in values
    ]


def short_message(result: Exchange) -> None:
    """The message does not echo a huge input back."""
    assert len(result.first.json()["error"]["message"]) < 300


# ---- attacks that take more than one request ----------------------------------------------------


def generated(
    proxy: Proxy, key: str | None, headers: dict[str, str] | None = None, **fields: Any
) -> Exchange:
    """A normal generation, which must be served."""
    all_headers = {
        "Content-Type": "application/json",
        **auth_headers(proxy, key),
        **(headers or {}),
    }
    body = orjson.dumps(chat_body(max_tokens=2, **fields))
    result = exchange(proxy.port, [request_bytes("POST", CHAT, body, all_headers)])
    assert result.first.status == 200, result.first.body[:300]
    return result


def events(answer: Answer) -> list[dict[str, Any]]:
    lines = answer.body.split(b"\n")
    return [orjson.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


def completion_id(answer: Answer) -> str:
    first = events(answer)[0] if answer.body.startswith(b"data:") else answer.json()
    return str(first["id"])


def rating(rater: str | None, on: str = "keyed", stream: bool = False, again: bool = False) -> Send:
    """ONE gets a completion on the keyed proxy, then ``rater`` rates it on proxy ``on``;
    ``again``: ONE rated it already."""

    def send(env: Env, proxy: Proxy) -> Exchange:
        keyed = env.proxies["keyed"]
        feedback = {"completion_id": completion_id(generated(keyed, ONE, stream=stream).first)}
        feedback["score"] = 1.0
        if again:
            assert post(FEEDBACK, feedback, ONE)(env, keyed).first.status == 200
        return post(FEEDBACK, feedback, rater)(env, env.proxies[on])

    return send


def rate_after_reusing_its_id(env: Env, proxy: Proxy) -> Exchange:
    """TWO makes vLLM answer with ONE's completion id (vLLM takes ``request_id`` from the body),
    to claim that completion: its owner stays ONE."""
    taken = completion_id(generated(proxy, ONE).first)
    generated(proxy, TWO, request_id=taken.split("-", 1)[-1])
    return post(FEEDBACK, {"completion_id": taken, "score": 0.0}, TWO)(env, proxy)


def reused_request_id(env: Env, proxy: Proxy) -> Exchange:
    """Two keys send the same x-request-id: each gets it echoed, and the traffic log has two
    records with distinct ids made by the server (so neither group can drop the other's)."""
    client_id = f"hostile-{uuid.uuid4().hex}"
    first = generated(proxy, ONE, {"x-request-id": client_id})
    second = generated(proxy, TWO, {"x-request-id": client_id})
    assert first.first.header("x-request-id") == second.first.header("x-request-id") == client_id
    records = env.embedded.find_records(
        TRAFFIC_TOPIC,
        lambda r: isinstance(r, TrafficRecord) and r.client_request_id == client_id,
        count=2,
    )
    traffic = [r for r in records if isinstance(r, TrafficRecord)]
    assert len(traffic) == 2 and len({r.api_key_hash for r in traffic}) == 2
    server_ids = {r.request_id for r in traffic}
    assert len(server_ids) == 2 and client_id not in server_ids
    return second


@contextlib.contextmanager
def canary_running(env: Env) -> Iterator[None]:
    """v1 as a canary beside v0 while the block runs (as the keyed proxy sees it)."""
    keyed = env.proxies["keyed"]

    def wait_for(canary: int | None) -> None:
        deadline = time.monotonic() + 15
        # Only the admin key is told the canary (a client key's card does not name it).
        url, headers = f"{keyed.url}/v1/models/support", auth_headers(keyed, ADMIN)
        while httpx.get(url, headers=headers).json()["ratchet"]["canary_version"] != canary:
            assert time.monotonic() < deadline, "the proxy never saw the routing change"
            time.sleep(0.1)

    env.embedded.set_route(active=0, canary=1, canary_weight=0.5)
    try:
        wait_for(1)
        yield
    finally:
        env.embedded.set_route(active=0, canary=None, canary_weight=0.0)
        wait_for(None)


def arm_hidden(stream: bool = False, **headers: str) -> Send:
    """Under a canary, six requests on distinct sticky values (both arms are likely drawn): none
    tells the client its arm or version, whatever the client sends."""

    def send(env: Env, proxy: Proxy) -> Exchange:
        with canary_running(env):
            for index in range(6):
                sticky = {"x-ratchet-sticky-key": f"sticky-{index}", **headers}
                result = generated(proxy, ONE, sticky, stream=stream)
                answer = result.first
                assert [name for name in ARM_HEADERS if answer.header(name) is not None] == []
                shown = events(answer) if stream else [answer.json()]
                assert {event["model"] for event in shown} == {"support"}
                assert b"@v" not in answer.body
        return result

    return send


# What a client may send to each generation endpoint, and see back (2 tokens, whatever the arm).
SHAPED: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"ignore_eos": True}),
    (CHAT, {"ignore_eos": True, "stream": True}),
    (CHAT, {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Say hi", "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Say hi", "ignore_eos": True, "stream": True}),
    # Greedy: a sampled answer that ends at its first token has no text events, a shape of its
    # own on either arm (the Responses API has no ignore_eos).
    (
        "/v1/responses",
        {"input": "Say hi", "max_output_tokens": 2, "temperature": 0, "store": False},
    ),
    (
        "/v1/responses",
        {"input": "Say hi", "max_output_tokens": 2, "temperature": 0, "stream": True},
    ),
]


def models_in(value: Any) -> set[str]:
    """Every ``model`` a JSON value names, however deep (a Responses event nests it)."""
    if isinstance(value, dict):
        found = {str(value["model"])} if "model" in value else set()
        return found.union(*(models_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(models_in(v) for v in value))
    return set()


def answer_shape(answer: Answer) -> tuple[Any, ...]:
    """What a client can compare between answers: status, header names, and per JSON object or
    event its keys and the models it names (values such as ids and text differ by nature)."""
    names = tuple(sorted({name for name, _ in answer.headers}))
    streamed = (answer.header("content-type") or "").startswith("text/event-stream")
    shown = events(answer) if streamed else [answer.json()]
    assert shown, answer.body[:300]
    keys = tuple(sorted({(tuple(event), tuple(sorted(models_in(event)))) for event in shown}))
    return answer.status, names, keys


def shapes(proxy: Proxy) -> list[tuple[Any, ...]]:
    """Each SHAPED request, on six sticky values (both arms likely drawn under a canary): the
    set of shapes of its answers."""
    found = []
    for path, fields in SHAPED:
        seen = set()
        for index in range(6):
            body = {"model": "support", "max_tokens": 2, "messages": chat_body()["messages"]}
            if path != CHAT:
                body.pop("messages")
            if path == "/v1/responses":
                body.pop("max_tokens")
            headers = {
                "Content-Type": "application/json",
                "x-ratchet-sticky-key": f"shape-{index}",
                **auth_headers(proxy, ONE),
            }
            sent = request_bytes("POST", path, orjson.dumps({**body, **fields}), headers)
            # vLLM loads the canary's adapter on its first answer: slow on a loaded host.
            answer = exchange(proxy.port, [sent], read_timeout_s=120).first
            assert answer.status == 200, (path, answer.body[:300])
            assert b"@v" not in answer.body, (path, answer.body[:300])
            seen.add(answer_shape(answer))
        found.append((path, tuple(sorted(seen, key=repr))))
    return found


def same_shape_with_or_without_a_canary(env: Env, proxy: Proxy) -> Exchange:
    """Audit N-2: the version and served name were told outside a canary and vanished inside
    one, which told every client that one had started. Every generation endpoint, whole and
    streamed, now answers with the same headers, keys and model with a canary or without."""
    without = shapes(proxy)
    with canary_running(env):
        within = shapes(proxy)
    assert within == without, (without, within)
    return generated(proxy, ONE)


def over_the_limit(env: Env, proxy: Proxy) -> Exchange:
    """Two requests of RL_A are served (2 per minute), the third is refused."""
    for _ in range(2):
        generated(proxy, RL_A)
    return chat(RL_A)(env, proxy)


def stream_left_is_charged(env: Env, proxy: Proxy) -> Exchange:
    """RL_D leaves a long stream after a few tokens, before any usage event: its day budget is
    charged its prompt (estimated, a token per 4 bytes of body) and the tokens streamed, not
    nothing, nor all it reserved. Then it is still served."""
    max_tokens = 256
    body = orjson.dumps(chat_body(max_tokens=max_tokens, stream=True, ignore_eos=True))
    prompt = len(body) // 4 + 1
    server = redis.Redis.from_url(env.embedded.settings.redis_url)
    pattern = "ratchet:ratelimit:*:tokens_per_day"
    others = set(server.keys(pattern))
    headers = {"Content-Type": "application/json", **auth_headers(proxy, RL_D)}
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
        sock.sendall(request_bytes("POST", CHAT, body, headers))
        received = b""
        while received.count(b'"finish_reason"') < 4:  # the role, then three tokens
            data = sock.recv(65536)
            assert data, received[-300:]
            received += data
    assert b'"usage":{' not in received
    deadline = time.monotonic() + 30
    while True:  # until the stream is settled: less than the reservation left charged
        keys = set(server.keys(pattern)) - others
        spent = server.pttl(keys.pop()) / 1000 if keys else 0.0
        if 0 < spent < prompt + max_tokens / 2:
            break
        assert time.monotonic() < deadline, f"never settled: {spent} s"
        time.sleep(0.1)
    assert spent >= prompt + 3 - 10, (spent, prompt)  # 10 s of refill at most since
    return generated(proxy, RL_D)


def vllm_running(env: Env) -> float:
    """Requests vLLM is generating for now (its own gauge)."""
    settings = env.embedded.settings
    text = httpx.get(f"{settings.vllm_url}/metrics", headers=env.embedded.vllm_headers).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:num_requests_running"
    )


def slow_reader_is_charged_what_vllm_generated(env: Env, proxy: Proxy) -> Exchange:
    """Audit N-7: RL_E asks for 16 long answers with large events (top logprobs, about 6 MB in
    all), reads the first event, then a little a second (enough to keep its connection, too
    little to matter) while vLLM generates all of it, and leaves before the usage event. The
    proxy relays only as fast as the client's socket takes it, so it had relayed about half (the
    kernel holds some 3 MB for a slow reader on loopback). It is charged what vLLM generated
    (its counts, read on after the client left), not the events it relayed (the old charge,
    about half as much). Then the key is still served."""
    n, max_tokens = 16, 256
    fields = {"stream": True, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "n": n}
    body = orjson.dumps(chat_body(max_tokens=max_tokens, **fields))
    server = redis.Redis.from_url(env.embedded.settings.redis_url)
    pattern = "ratchet:ratelimit:*:tokens_per_day"
    others = set(server.keys(pattern))
    headers = {"Content-Type": "application/json", **auth_headers(proxy, RL_E)}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader's small window
        sock.settimeout(60)
        sock.connect(("127.0.0.1", proxy.port))
        sent_at = time.monotonic()  # the reservation is taken then; the bucket refills since
        sock.sendall(request_bytes("POST", CHAT, body, headers))
        received = b""
        while b'"finish_reason"' not in received:  # the first event
            data = sock.recv(4096)
            assert data, received[-300:]
            received += data
        deadline = time.monotonic() + 300
        while vllm_running(env) > 0:  # vLLM generates all of it meanwhile
            assert time.monotonic() < deadline, "vLLM still generating"
            received += sock.recv(256)  # a trickle: the proxy's write deadline is not reached
            time.sleep(1.0)
        # Leave with a reset, as a client that gives up does, before reading the usage event.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert b'"usage":{' not in received
    deadline = time.monotonic() + 30
    while True:  # until the stream is settled: less than its reservation left charged
        keys = set(server.keys(pattern)) - others
        spent = server.pttl(keys.pop()) / 1000 if keys else 0.0
        if 0 < spent < len(body) // 4 + 1 + n * max_tokens:
            break
        assert time.monotonic() < deadline, f"never settled: {spent} s"
        time.sleep(0.1)
    # vLLM's prompt (chat template included) and the 16 x 256 tokens it generated, less the
    # refill since the request (a token a second).
    refilled = time.monotonic() - sent_at
    assert spent + refilled >= n * max_tokens, (spent, refilled)
    return generated(proxy, RL_E)


def bad_requests_count(env: Env, proxy: Proxy) -> Exchange:
    """Requests refused for their body took from the key's bucket all the same."""
    for _ in range(2):
        assert post(CHAT, b"not json", RL_C)(env, proxy).first.status == 400
    return chat(RL_C)(env, proxy)


def over_concurrency(env: Env, proxy: Proxy) -> Exchange:
    """MAX_CONCURRENCY connections hold half-sent heads: the next request is refused with 503."""
    held = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(MAX_CONCURRENCY)]
    try:
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        deadline = time.monotonic() + TIMEOUT_S / 2
        while True:  # until the server has taken in the held connections
            result = exchange(proxy.port, [GET_HEALTHZ])
            if result.first.status == 503 or time.monotonic() > deadline:
                return result
    finally:
        for sock in held:
            sock.close()
        wait_healthy(proxy)


def wait_healthy(proxy: Proxy, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while exchange(proxy.port, [GET_HEALTHZ]).first.status != 200:
        assert time.monotonic() < deadline, f"the {proxy.name} proxy is not healthy"
        time.sleep(0.05)


def then_logged_within(attack: Send, within_s: float = 5.0) -> Send:
    """``attack``, then a normal exchange whose traffic record must reach Kafka within
    ``within_s`` of its answer: what the attack gave the log worker to redact did not stall it
    (audit C-1: one long token froze it, and all traffic logging, for hours). Under a second on
    a quiet host; 5 s leaves a loaded slow host room and still tells a stall."""

    def send(env: Env, proxy: Proxy) -> Exchange:
        result = attack(env, proxy)
        settings = env.embedded.settings
        consumer = make_consumer(settings.kafka_bootstrap_servers, settings.kafka, [], None)
        try:
            partitions = consumer.partitions_for_topic(TRAFFIC_TOPIC) or set()
            tps = [TopicPartition(TRAFFIC_TOPIC, p) for p in partitions]
            consumer.assign(tps)
            consumer.seek_to_end(*tps)
            for tp in tps:
                consumer.position(tp)  # resolve the end now: only what comes after counts
            client_id = f"after-{uuid.uuid4().hex}"
            generated(proxy, proxy.key, {"x-request-id": client_id})
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                for messages in consumer.poll(timeout_ms=100).values():
                    for message in messages:
                        record = decode(message.topic, message.value)
                        if isinstance(record, TrafficRecord) and (
                            record.client_request_id == client_id
                        ):
                            return result
            raise AssertionError(f"the next exchange was not logged within {within_s}s")
        finally:
            consumer.close()

    return send


# ---- after all cases ----------------------------------------------------------------------------


def metrics(proxy: Proxy) -> dict[str, float]:
    text = httpx.get(f"{proxy.url}/metrics", headers=auth_headers(proxy, proxy.admin_key)).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ratchet_")]
    return {name: float(value) for name, value in samples}


def assert_no_traceback(log: str) -> None:
    """What a proxy logged: no traceback, no unhandled error (log lines are the server's, but
    a client that can make the proxy log a traceback at will can also flood its log)."""
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


def assert_all_clean(env: Env) -> None:
    """No request left counted in flight, no 500 counted, no traceback logged by any proxy since
    the module began."""
    for proxy in env.proxies.values():
        deadline = time.monotonic() + 10
        while metrics(proxy)["ratchet_proxy_in_flight_requests"] != 0:
            assert time.monotonic() < deadline, f"{proxy.name}: requests left in flight"
            time.sleep(0.1)
        assert not metrics(proxy).get('ratchet_proxy_errors_total{code="internal_error"}')
    for proxy in env.proxies.values():
        assert_no_traceback(env.logged_since(proxy, env.log_start[proxy.name]))

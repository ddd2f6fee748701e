"""What a client can do to the learning signal through the proxy, and cannot: choose the request
id that groups derive from, learn or choose its canary arm, or rate a completion that is not its
own (or one twice).

The real proxy app in-process, a real Redis (routing, completion owners, ratings), and a small
aiohttp server answering as vLLM does (compact JSON that echoes the served name in ``model``).
Kafka's port is closed; the exchanges handed to the log worker are captured instead.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from aiohttp import web

from embedded.processes import free_port as closed_port
from proxy.app import create_app
from proxy.completions import completion_id_of, owner_of, owner_ttl_s
from proxy.log.exchange import Exchange, Redactor
from proxy.state import ProxyState
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.settings import RatchetSettings

KEY_A, KEY_B = "sk-alice-0123456789", "sk-bob-0123456789"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BASE = "smollm2-135m-instruct"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def vllm(request: web.Request) -> web.StreamResponse:
    """Answers as vLLM does: compact JSON, a fresh id, ``model`` = the served name asked for."""
    body = await request.json()
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": 1, "model": body["model"]}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if not body.get("stream"):
        choice = {"index": 0, "message": {"role": "assistant", "content": "hello"}}
        answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {**head, "object": "chat.completion.chunk"}
    first = event({**chunk, "choices": [{"index": 0, "delta": {"content": "hel"}}]})
    cut = first.index(b'"model":"') + 12  # a TCP segment may end inside the served name
    for part in (first[:cut], first[cut:]):
        await response.write(part)
        await asyncio.sleep(0.01)
    await response.write(event({**chunk, "choices": [{"index": 0, "delta": {"content": "lo"}}]}))
    await response.write(event({**chunk, "choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def unknown_adapter(request: web.Request) -> web.Response:
    body = await request.json()
    error = {"object": "error", "message": f"The model `{body['model']}` does not exist."}
    return web.Response(body=orjson.dumps(error), status=404, content_type="application/json")


class Running:
    """The proxy app, its client, and the exchanges it handed to the log worker."""

    def __init__(self, client: httpx.AsyncClient, state: ProxyState) -> None:
        self.client = client
        self.state = state
        self.metas: list[dict[str, Any]] = []

    async def chat(self, key: str = KEY_A, headers: dict[str, str] | None = None, **body: Any):
        payload = {"model": "support", "messages": MSG, **body}
        return await self.client.post(CHAT, json=payload, headers={**auth(key), **(headers or {})})


@asynccontextmanager
async def proxy_on(
    upstream: dict[str, Any], redis_url: str, home: Path, route: AliasRoute | None, **proxy: Any
) -> AsyncIterator[Running]:
    settings = RatchetSettings(
        home=home,
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=redis_url,
        vllm_url=upstream["url"],
        proxy={"api_keys": [KEY_A, KEY_B], **proxy},
    )
    if route is not None:  # the routing table the proxy loads at start
        RegistryWriter(redis_url, settings.aliases).write(route)
    upstream["handler"] = vllm
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        state: ProxyState = app.state.ratchet
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            running = Running(client, state)

            def capture(meta: bytes, request: bytes, answer: bytes) -> None:
                running.metas.append({**orjson.loads(meta), "_request": request, "_answer": answer})

            state.traffic_log.submit_exchange = capture  # type: ignore[method-assign]
            yield running


CANARY = AliasRoute(alias="support", base_model=BASE, active=1, canary=2, canary_weight=0.5)


@pytest.fixture
async def plain(upstream: dict[str, Any], redis_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    async with proxy_on(upstream, redis_url, tmp_path, AliasRoute("support", BASE, 1)) as running:
        yield running


@pytest.fixture
async def on_canary(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> AsyncIterator[Running]:
    async with proxy_on(upstream, redis_url, tmp_path, CANARY) as running:
        yield running


# --- request ids ------------------------------------------------------------------------------


async def test_the_request_id_is_the_servers_and_the_clients_is_only_echoed(
    plain: Running,
) -> None:
    """Two clients sending the same x-request-id get records with ids of the proxy's own, so
    neither's group can be dropped as a duplicate of the other's."""
    first = await plain.chat(KEY_A, {"x-request-id": "shared-id"})
    second = await plain.chat(KEY_B, {"x-request-id": "shared-id"})
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "shared-id"
    ids = [m["request_id"] for m in plain.metas]
    assert len(set(ids)) == 2 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert [m["client_request_id"] for m in plain.metas] == ["shared-id", "shared-id"]

    # The log worker makes the record from the same meta: the client's id is a field of it.
    meta = {k: v for k, v in plain.metas[0].items() if not k.startswith("_")}
    meta.pop("started_at")
    record = Exchange(
        **meta,
        request=orjson.loads(plain.metas[0]["_request"]),
        redactor=Redactor([]),
        response_body=plain.metas[0]["_answer"],
    ).to_record()
    assert (record.request_id, record.client_request_id) == (ids[0], "shared-id")

    # Without one, the client is told ours; a long one is cut to 128 characters.
    plain.metas.clear()
    bare = await plain.chat()
    assert bare.headers["x-request-id"] == plain.metas[0]["request_id"]
    long = await plain.chat(headers={"x-request-id": "x" * 500})
    assert long.headers["x-request-id"] == "x" * 128 == plain.metas[1]["client_request_id"]


# --- the canary arm ---------------------------------------------------------------------------


ARM_HEADERS = ("x-ratchet-canary-arm", "x-ratchet-version", "x-ratchet-served-name")


async def test_a_client_cannot_learn_its_arm(on_canary: Running) -> None:
    for i in range(12):
        sticky = {"x-ratchet-sticky-key": f"user-{i}"}
        whole = await on_canary.chat(headers=sticky)
        assert whole.status_code == 200
        assert whole.json()["model"] == "support"
        streams = [
            await on_canary.chat(headers=sticky, stream=True),
            await on_canary.chat(
                headers=sticky, stream=True, stream_options={"include_usage": True}
            ),
        ]
        for response in (whole, *streams):
            assert not any(name in response.headers for name in ARM_HEADERS)
            assert b"@v" not in response.content and BASE.encode() not in response.content
        for stream in streams:
            chunks = [e for e in stream.text.split("\n\n") if e.startswith("data: {")]
            assert stream.status_code == 200 and chunks, stream.text
            assert all(orjson.loads(e[6:])["model"] == "support" for e in chunks)
    # Both arms answered, and the log still says which version did.
    assert {m["served_name"] for m in on_canary.metas} == {"support@v1", "support@v2"}


async def test_an_error_does_not_name_the_version_either(
    on_canary: Running, upstream: dict[str, Any]
) -> None:
    upstream["handler"] = unknown_adapter
    for i in range(6):
        response = await on_canary.chat(headers={"x-ratchet-sticky-key": f"user-{i}"})
        assert response.status_code == 502 and "@v" not in response.text
        assert response.json()["error"]["code"] == "adapter_unavailable"


async def test_the_arm_is_sticky_per_key_and_sticky_value(on_canary: Running) -> None:
    async def arm(key: str, sticky: str) -> str:
        on_canary.metas.clear()
        await on_canary.chat(key, {"x-ratchet-sticky-key": sticky})
        return str(on_canary.metas[0]["canary_arm"])

    values = [f"user-{i}" for i in range(24)]
    alice = [await arm(KEY_A, v) for v in values]
    assert alice == [await arm(KEY_A, v) for v in values]  # sticky
    assert set(alice) == {"active", "canary"}
    bob = [await arm(KEY_B, v) for v in values]
    # The same values under another key are drawn afresh (24 equal draws: p = 2**-24).
    assert bob != alice


async def test_expose_arm_tells_the_arm_and_the_version(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    async with proxy_on(upstream, redis_url, tmp_path, CANARY, expose_arm=True) as running:
        for i in range(6):
            response = await running.chat(headers={"x-ratchet-sticky-key": f"user-{i}"})
            meta = running.metas[-1]
            assert response.headers["x-ratchet-canary-arm"] == meta["canary_arm"]
            assert response.headers["x-ratchet-version"] == str(meta["version"])
            assert response.json()["model"] == meta["served_name"]


async def test_without_auth_every_request_is_one_client(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """A bearer token nobody checks is no identity: counted as clients, a new token per rating
    would escape every per-client cap (the canary's among them). With keys, the key is."""
    route = AliasRoute("support", BASE, 1)
    async with proxy_on(upstream, redis_url, tmp_path, route, api_keys=[]) as running:
        await running.chat(KEY_A)
        await running.chat(KEY_B)
        assert [m["source"] for m in running.metas] == [ANONYMOUS_CLIENT] * 2
    async with proxy_on(upstream, redis_url, tmp_path, route) as running:
        await running.chat(KEY_A)
        await running.chat(KEY_B)
        sources = [m["source"] for m in running.metas]
        assert ANONYMOUS_CLIENT not in sources and len(set(sources)) == 2


async def test_model_cards_name_the_canary_only_to_the_admin(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """A client that knew a canary was running, and its share, could tell the arms apart."""
    admin = "sk-admin-0123456789"
    async with proxy_on(upstream, redis_url, tmp_path, CANARY, admin_key=admin) as running:
        for key, shown in ((KEY_A, False), (admin, True)):
            one = await running.client.get("/v1/models/support", headers=auth(key))
            listed = await running.client.get("/v1/models", headers=auth(key))
            for card in (one.json(), listed.json()["data"][0]):
                assert card["ratchet"]["active_version"] == 1
                assert ("canary_version" in card["ratchet"]) is shown, card
                assert ("canary_weight" in card["ratchet"]) is shown, card
                if shown:
                    assert card["ratchet"]["canary_version"] == 2


def shape(response: httpx.Response) -> tuple[Any, ...]:
    """What a client can compare between two answers to the same request: the status, the
    header names (values such as the request id differ by nature), and for each JSON object
    or stream event, its keys and ``model``."""
    headers = tuple(sorted(response.headers.keys()))
    if response.headers["content-type"].startswith("application/json"):
        body = response.json()
        return response.status_code, headers, tuple(body), body["model"]
    events = [orjson.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    return response.status_code, headers, tuple((tuple(e), e.get("model")) for e in events)


async def test_an_answer_has_the_same_shape_with_or_without_a_canary(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """Audit N-2: the version and served name were told outside a canary and vanished inside
    one, which told every client that a canary had started. Now neither is told either way."""
    bodies: list[dict[str, Any]] = [
        {},
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
    ]
    shapes: list[list[tuple[Any, ...]]] = []
    for route in (AliasRoute("support", BASE, 1), CANARY):
        async with proxy_on(upstream, redis_url, tmp_path, route) as running:
            # A sticky key a request: 24 draws of the arm, so both arms answer but once in 2^23
            # (8 keys were all drawn to one arm once in 256 runs).
            answers = [
                await running.chat(headers={"x-ratchet-sticky-key": f"user-{i}-{n}"}, **body)
                for i in range(8)
                for n, body in enumerate(bodies)
            ]
            for answer in answers:
                assert not any(name in answer.headers for name in ARM_HEADERS)
                assert b"@v" not in answer.content and BASE.encode() not in answer.content
            shapes.append([shape(answer) for answer in answers])
            served = {m["served_name"] for m in running.metas}  # the records still tell
            assert served == ({"support@v1", "support@v2"} if route.canary else {"support@v1"})
    assert shapes[0] == shapes[1]


# --- ratings ----------------------------------------------------------------------------------


async def rate(running: Running, key: str, completion_id: str) -> httpx.Response:
    body = {"completion_id": completion_id, "score": 0.0}
    return await running.client.post("/v1/feedback", json=body, headers=auth(key))


def error_code(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return str(error["code"])


async def test_only_the_key_that_got_a_completion_rates_it_and_only_once(
    plain: Running, redis_url: str
) -> None:
    completion_id = (await plain.chat(KEY_A)).json()["id"]
    # Another key gets the same answer as for an id that never existed: nothing tells them apart.
    stolen, unknown = await rate(plain, KEY_B, completion_id), await rate(plain, KEY_B, "nope")
    assert stolen.status_code == unknown.status_code == 404
    assert error_code(stolen) == error_code(unknown) == "completion_not_found"
    accepted = await rate(plain, KEY_A, completion_id)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["status"] == "accepted"
    again = await rate(plain, KEY_A, completion_id)
    assert again.status_code == 409 and error_code(again) == "already_rated"
    assert (await rate(plain, KEY_B, completion_id)).status_code == 404

    client = redis.Redis.from_url(redis_url)
    owner = client.get(f"ratchet:completion:{completion_id}")
    assert owner is not None and owner.decode() == owner_of(plain.metas[0]["api_key_hash"])
    # Kept only while a rating can still count (an hour by default), not for days.
    ttl = owner_ttl_s(plain.state.settings)
    assert ttl == 3600 and 0 < client.ttl(f"ratchet:completion:{completion_id}") <= ttl
    assert 0 < client.ttl(f"ratchet:completion:{completion_id}:rated") <= ttl
    assert client.exists(f"ratchet:completion:{completion_id}:rated")


async def test_a_streamed_completion_can_be_rated_at_once(plain: Running) -> None:
    streamed = await plain.chat(KEY_B, stream=True)
    completion_id = completion_id_of(streamed.content)
    assert completion_id is not None and completion_id.startswith("chatcmpl-")
    # Rated before the owner note went out: the rating waits for it rather than a 404.
    assert (await rate(plain, KEY_B, completion_id)).status_code == 200
    assert (await rate(plain, KEY_A, completion_id)).status_code == 404


async def test_a_rating_that_could_not_be_queued_can_be_sent_again(
    plain: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    completion_id = (await plain.chat(KEY_A)).json()["id"]
    monkeypatch.setattr(plain.state.traffic_log, "submit", lambda *a, **k: False)
    full = await rate(plain, KEY_A, completion_id)
    assert full.status_code == 503 and error_code(full) == "queue_full"
    monkeypatch.undo()
    assert (await rate(plain, KEY_A, completion_id)).status_code == 200


async def test_a_rating_needs_a_key(plain: Running) -> None:
    completion_id = (await plain.chat(KEY_A)).json()["id"]
    response = await plain.client.post("/v1/feedback", json={"completion_id": completion_id})
    assert response.status_code == 401


async def test_a_vouching_keys_users_are_clients_of_their_own_and_no_other_keys_are(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """One app key that vouches for its users: each `user` is a client for the per-client caps,
    on its exchanges and its ratings alike. Another key's `user` changes nothing: anyone could
    send any user, so a key not trusted to vouch stays one client however many it names."""
    route = AliasRoute("support", BASE, 1)
    async with proxy_on(
        upstream, redis_url, tmp_path, route, user_vouching_keys=[KEY_A]
    ) as running:
        for key, user in (
            (KEY_A, "u1"),
            (KEY_A, "u2"),
            (KEY_A, "u1"),
            (KEY_B, "u1"),
            (KEY_B, "u2"),
        ):
            assert (await running.chat(key, user=user)).status_code == 200
        await running.chat(KEY_A)  # no user: the key itself
        sources = [m["source"] for m in running.metas]
        hashes = [m["api_key_hash"] for m in running.metas]
        assert sources[0] == sources[2] != sources[1]
        assert {sources[0], sources[1]}.isdisjoint(hashes)
        assert sources[3] == sources[4] == hashes[3]
        assert sources[5] == hashes[5] == hashes[0]
        meta = {k: v for k, v in running.metas[1].items() if not k.startswith("_")}
        meta.pop("started_at")
        record = Exchange(**meta, request={}, redactor=Redactor([])).to_record()
        assert record.client == sources[1]

        captured: list[Any] = []

        def capture(record: Any, **_: Any) -> bool:
            captured.append(record)
            return True

        running.state.traffic_log.submit = capture  # type: ignore[method-assign]
        completion_id = (await running.chat(KEY_A, user="u2")).json()["id"]
        rated = await running.client.post(
            "/v1/feedback",
            json={"completion_id": completion_id, "score": 1, "user": "u2"},
            headers=auth(KEY_A),
        )
        assert rated.status_code == 200, rated.text
        assert captured[0].client == sources[1]
        # The rating counts for the user the answer was served to, whatever its body's `user`
        # (another user, or none): one user cannot rate as many clients (audit N-14).
        for rated_as in ({"user": "u1"}, {"user": "someone-else"}, {}):
            completion_id = (await running.chat(KEY_A, user="u2")).json()["id"]
            body = {"completion_id": completion_id, "score": 1, **rated_as}
            rated = await running.client.post("/v1/feedback", json=body, headers=auth(KEY_A))
            assert rated.status_code == 200, rated.text
            assert captured[-1].client == sources[1], rated_as
        # An answer served with no user counts for the key, even if its rating names one.
        completion_id = (await running.chat(KEY_A)).json()["id"]
        body = {"completion_id": completion_id, "score": 1, "user": "u2"}
        rated = await running.client.post("/v1/feedback", json=body, headers=auth(KEY_A))
        assert rated.status_code == 200, rated.text
        assert captured[-1].client == hashes[0]


def test_completion_id_of() -> None:
    assert completion_id_of(b'{"id":"chatcmpl-1","object":"chat.completion"}') == "chatcmpl-1"
    assert completion_id_of(b'data: {"id": "cmpl-2", "choices": []}\n\n') == "cmpl-2"
    # Only the answer's own first key: never an id further in, or inside an error.
    assert completion_id_of(b'{"object":"x","id":"late"}') is None
    assert completion_id_of(b'{"error":{"id":"inner"}}') is None
    assert completion_id_of(b"") is None


def test_a_completion_owner_is_kept_as_long_as_a_rating_can_join(tmp_path: Path) -> None:
    config = {"feedback": {"join_ttl_s": 7200}}
    settings = RatchetSettings(home=tmp_path, aliases={"slow": config, "support": {}})
    assert owner_ttl_s(settings) == 7200
    fast = {"feedback": {"join_ttl_s": 60}}
    assert owner_ttl_s(RatchetSettings(home=tmp_path, aliases={"fast": fast})) == 60
    assert owner_ttl_s(RatchetSettings(home=tmp_path, aliases={})) == 3600

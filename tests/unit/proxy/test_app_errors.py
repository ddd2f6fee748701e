"""The proxy app's error surface: every refusal is the OpenAI envelope with the right status.

The app runs in-process (ASGI transport, lifespan included) against closed loopback ports for
Kafka, Redis and vLLM, so every request that passes validation fails with 503 upstream_unavailable.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from fastapi import FastAPI
from kafka.errors import KafkaTimeoutError

from embedded.processes import free_port as closed_port
from proxy.app import create_app
from proxy.log.spool import OutgoingRecord, Spool
from ratchet import bus
from ratchet.records import TRAFFIC_TOPIC
from ratchet.secrets import hash_api_key, server_secret
from ratchet.settings import RatchetSettings

API_KEY = "sk-unit-test-0123456789"
MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def _refuse_fast(bootstrap: str, *_: Any) -> list[str]:
    # kafka-python takes 2 s to give up on a closed port; the result is the same error.
    raise KafkaTimeoutError(f"Unable to bootstrap from {bootstrap}")


@pytest.fixture(scope="module")
def module_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("ratchet-home")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("RATCHET_"):
                mp.delenv(name)
        mp.chdir(home)  # no ./ratchet.yaml here
        mp.setenv("RATCHET_HOME", str(home))
        mp.setattr(bus, "ensure_topics", _refuse_fast)
        yield home


def make_settings(**proxy: Any) -> RatchetSettings:
    return RatchetSettings(
        kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
        redis_url=f"redis://127.0.0.1:{closed_port()}/0",
        vllm_url=f"http://127.0.0.1:{closed_port()}",
        proxy={
            "max_body_bytes": 1024,
            "upstream_connect_timeout_s": 1.0,
            "upstream_health_interval_s": 0.5,
            **proxy,
        },
    )


async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client


@pytest_asyncio.fixture(scope="module")
async def open_client(module_env: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings()
    assert settings.home == module_env
    assert not settings.auth_enabled
    async for client in running(create_app(settings)):
        yield client


@pytest_asyncio.fixture(scope="module")
async def auth_client(module_env: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for client in running(create_app(make_settings(api_keys=[API_KEY]))):
        yield client


def assert_envelope(
    resp: httpx.Response, status: int, kind: str, param: str | None, code: str
) -> dict[str, Any]:
    text = resp.text
    assert resp.status_code == status, text
    assert resp.headers["content-type"].startswith("application/json")
    assert "Traceback" not in text and 'File "' not in text
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ENVELOPE_KEYS, error
    assert (error["type"], error["param"], error["code"]) == (kind, param, code), error
    assert isinstance(error["message"], str) and error["message"]
    return error


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "support", "messages": MSG, **fields}


BAD = "invalid_request_error"

# (id, method, path, body: bytes | JSON | None, status, type, param, code)
CASES: list[tuple[str, str, str, Any, int, str, str | None, str]] = [
    ("malformed-json", "POST", CHAT, b'{"model": "support",', 400, BAD, None, "invalid_json"),
    ("empty-body", "POST", CHAT, b"", 400, BAD, None, "invalid_json"),
    ("not-utf8", "POST", CHAT, b"\xff\xfe{}", 400, BAD, None, "invalid_json"),
    ("array-body", "POST", CHAT, b"[1, 2]", 400, BAD, None, "invalid_json"),
    ("string-body", "POST", CHAT, b'"hi"', 400, BAD, None, "invalid_json"),
    ("null-body", "POST", CHAT, b"null", 400, BAD, None, "invalid_json"),
    ("no-model", "POST", CHAT, {"messages": MSG}, 400, BAD, "model", "missing_required"),
    ("model-int", "POST", CHAT, chat(model=5), 400, BAD, "model", "invalid_type"),
    ("model-list", "POST", CHAT, chat(model=["a"]), 400, BAD, "model", "invalid_type"),
    ("bad-alias", "POST", CHAT, chat(model="Support!"), 400, BAD, "model", "invalid_model_name"),
    (
        "served-name",
        "POST",
        CHAT,
        chat(model="support@v1"),
        400,
        BAD,
        "model",
        "invalid_model_name",
    ),
    (
        "alias-newline",
        "POST",
        CHAT,
        chat(model="support\n"),
        400,
        BAD,
        "model",
        "invalid_model_name",
    ),
    ("unknown-alias", "POST", CHAT, chat(model="nope"), 404, BAD, "model", "model_not_found"),
    ("no-messages", "POST", CHAT, {"model": "support"}, 400, BAD, "messages", "missing_required"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), 400, BAD, "messages", "invalid_type"),
    ("messages-str", "POST", CHAT, chat(messages="hi"), 400, BAD, "messages", "invalid_type"),
    ("message-not-obj", "POST", CHAT, chat(messages=[1]), 400, BAD, "messages[0]", "invalid_type"),
    (
        "bad-role",
        "POST",
        CHAT,
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        BAD,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "role-list",
        "POST",
        CHAT,
        chat(messages=[{"role": ["user"], "content": "x"}]),
        400,
        BAD,
        "messages[0].role",
        "invalid_value",
    ),
    ("stream-str", "POST", CHAT, chat(stream="yes"), 400, BAD, "stream", "invalid_type"),
    ("n-zero", "POST", CHAT, chat(n=0), 400, BAD, "n", "invalid_type"),
    ("temperature-5", "POST", CHAT, chat(temperature=5), 400, BAD, "temperature", "invalid_type"),
    ("tools-obj", "POST", CHAT, chat(tools={"a": 1}), 400, BAD, "tools", "invalid_type"),
    (
        "tools-no-fn",
        "POST",
        CHAT,
        chat(tools=[{"type": "function"}]),
        400,
        BAD,
        "tools",
        "invalid_type",
    ),
    (
        "completion-no-prompt",
        "POST",
        "/v1/completions",
        {"model": "support"},
        400,
        BAD,
        "prompt",
        "missing_required",
    ),
    (
        "completion-bad-prompt",
        "POST",
        "/v1/completions",
        {"model": "support", "prompt": 5},
        400,
        BAD,
        "prompt",
        "invalid_type",
    ),
    (
        "oversize",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x" * 2000}]),
        413,
        BAD,
        None,
        "request_too_large",
    ),
    (
        "oversize-feedback",
        "POST",
        "/v1/feedback",
        {"completion_id": "c1", "score": 1, "comment": "x" * 2000},
        413,
        BAD,
        None,
        "request_too_large",
    ),
    ("load-lora", "POST", "/v1/load_lora_adapter", {"lora_name": "x"}, 404, BAD, None, "not_found"),
    (
        "unload-lora",
        "POST",
        "/v1/unload_lora_adapter",
        {"lora_name": "x"},
        404,
        BAD,
        None,
        "not_found",
    ),
    ("adapters-get", "GET", "/adapters", None, 404, BAD, None, "not_found"),
    ("adapters-post", "POST", "/adapters", {}, 404, BAD, None, "not_found"),
    ("unknown-v1", "GET", "/v1/nothing/here", None, 404, BAD, None, "not_found"),
    ("unknown-model", "GET", "/v1/models/nope", None, 404, BAD, "model", "model_not_found"),
    ("get-chat", "GET", CHAT, None, 405, BAD, None, "method_not_allowed"),
    ("put-completions", "PUT", "/v1/completions", {}, 405, BAD, None, "method_not_allowed"),
    ("delete-models", "DELETE", "/v1/models", None, 405, BAD, None, "method_not_allowed"),
    ("get-feedback", "GET", "/v1/feedback", None, 405, BAD, None, "method_not_allowed"),
    ("post-healthz", "POST", "/healthz", {}, 405, BAD, None, "method_not_allowed"),
    (
        "feedback-score",
        "POST",
        "/v1/feedback",
        {"completion_id": "c1", "score": 2},
        400,
        BAD,
        "score",
        "invalid_value",
    ),
    (
        "feedback-score-str",
        "POST",
        "/v1/feedback",
        {"completion_id": "c1", "score": "high"},
        400,
        BAD,
        "score",
        "invalid_value",
    ),
    (
        "feedback-no-id",
        "POST",
        "/v1/feedback",
        {"score": 1},
        400,
        BAD,
        "completion_id",
        "invalid_type",
    ),
    ("feedback-json", "POST", "/v1/feedback", b"{", 400, BAD, None, "invalid_json"),
]


def encode(body: Any) -> bytes | None:
    if body is None:
        return None
    return body if isinstance(body, bytes) else orjson.dumps(body)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind", "param", "code"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_error_envelope(
    open_client: httpx.AsyncClient,
    method: str,
    path: str,
    body: Any,
    status: int,
    kind: str,
    param: str | None,
    code: str,
) -> None:
    resp = await open_client.request(
        method, path, content=encode(body), headers={"content-type": "application/json"}
    )
    assert_envelope(resp, status, kind, param, code)


async def test_oversize_body_without_content_length(open_client: httpx.AsyncClient) -> None:
    """A chunked upload is cut off at the limit too, not read to the end."""
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            sent.append(1)
            yield b" " * 512

    resp = await open_client.post(
        CHAT, content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in resp.request.headers
    assert_envelope(resp, 413, BAD, None, "request_too_large")
    assert len(sent) < 64, "the proxy read the whole oversize body"


# What a web page can POST to any address without a CORS preflight, and other non-JSON types.
NOT_JSON = {
    "text-plain": "text/plain;charset=UTF-8",
    "form": "application/x-www-form-urlencoded",
    "multipart": "multipart/form-data; boundary=x",
    "none": None,
    "json-lookalike": "application/jsonx",
    "json-suffix": "application/ld+json",
}


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/feedback"])
@pytest.mark.parametrize("content_type", NOT_JSON.values(), ids=NOT_JSON.keys())
async def test_posts_not_sent_as_json_are_415(
    open_client: httpx.AsyncClient, path: str, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    resp = await open_client.post(path, content=orjson.dumps(chat()), headers=headers)
    error = assert_envelope(resp, 415, BAD, "content-type", "unsupported_media_type")
    assert "application/json" in error["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", " application/json "]
)
async def test_json_with_parameters_or_any_case_is_read(
    open_client: httpx.AsyncClient, content_type: str
) -> None:
    resp = await open_client.post(CHAT, content=b"{", headers={"content-type": content_type})
    assert_envelope(resp, 400, BAD, None, "invalid_json")  # read, and found not to be JSON


async def test_405_says_which_methods_are_allowed(open_client: httpx.AsyncClient) -> None:
    resp = await open_client.get(CHAT)
    assert_envelope(resp, 405, BAD, None, "method_not_allowed")
    assert "POST" in resp.headers.get("allow", ""), dict(resp.headers)


async def test_valid_request_with_vllm_down_is_503(open_client: httpx.AsyncClient) -> None:
    for path, body in ((CHAT, chat()), ("/v1/completions", {"model": "support", "prompt": "x"})):
        resp = await open_client.post(path, json=body)
        assert_envelope(resp, 503, "server_error", None, "upstream_unavailable")
        assert resp.headers.get("retry-after") == "1"
    resp = await open_client.post(CHAT, json=chat(stream=True))
    assert_envelope(resp, 503, "server_error", None, "upstream_unavailable")


async def test_feedback_without_redis_cannot_be_checked(open_client: httpx.AsyncClient) -> None:
    # Who got the completion, and whether it was rated, live in Redis (its port is closed here);
    # accepted feedback is tests/unit/proxy/test_learning_signal.py's.
    resp = await open_client.post("/v1/feedback", json={"completion_id": "c9", "thumbs": "up"})
    assert_envelope(resp, 503, "server_error", None, "feedback_unavailable")
    assert resp.headers.get("retry-after") == "5"


async def test_health_and_readiness(open_client: httpx.AsyncClient) -> None:
    assert (await open_client.get("/healthz")).status_code == 200
    resp = await open_client.get("/readyz")
    assert resp.status_code == 503
    body = resp.json()
    assert body["ready"] is False and body["vllm"] is False
    assert body["kafka"] is False and body["registry"] is False


async def test_models_lists_config_aliases_while_redis_is_down(
    open_client: httpx.AsyncClient,
) -> None:
    resp = await open_client.get("/v1/models")
    assert resp.status_code == 200
    data = resp.json()["data"]
    assert [m["id"] for m in data] == ["support"]
    assert data[0]["ratchet"]["active_version"] == 0
    assert data[0]["ratchet"]["served_name"] == "smollm2-135m-instruct"


# ---- auth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-wrong"},
        {"authorization": f"Bearer {API_KEY}x"},
        {"authorization": f"Basic {API_KEY}"},
        {"authorization": API_KEY},
        {"authorization": "Bearer "},
    ],
    ids=["none", "wrong", "prefix-of-longer", "basic", "no-scheme", "empty"],
)
async def test_auth_rejects(auth_client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    for method, path, body in (
        ("POST", CHAT, chat()),
        ("POST", "/v1/completions", {"model": "support", "prompt": "x"}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/support", None),
        ("POST", "/v1/feedback", {"completion_id": "c1", "score": 1}),
    ):
        resp = await auth_client.request(method, path, content=encode(body), headers=headers)
        error = assert_envelope(resp, 401, "authentication_error", None, "invalid_api_key")
        assert API_KEY not in resp.text
        assert "sk-wrong" not in error["message"]


async def test_auth_is_checked_before_the_body(auth_client: httpx.AsyncClient) -> None:
    resp = await auth_client.post(CHAT, content=b"{not json")
    assert_envelope(resp, 401, "authentication_error", None, "invalid_api_key")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
async def test_right_key_passes_auth_then_upstream_is_down(
    auth_client: httpx.AsyncClient, scheme: str
) -> None:
    headers = {"authorization": f"{scheme} {API_KEY}"}
    resp = await auth_client.post(CHAT, json=chat(), headers=headers)
    assert_envelope(resp, 503, "server_error", None, "upstream_unavailable")
    # Validation still applies once the key is accepted.
    resp = await auth_client.post(CHAT, json=chat(n=0), headers=headers)
    assert_envelope(resp, 400, BAD, "n", "invalid_type")
    resp = await auth_client.get("/v1/models", headers=headers)
    assert resp.status_code == 200


async def test_readyz_503_with_auth(auth_client: httpx.AsyncClient) -> None:
    # Probes carry no key.
    assert (await auth_client.get("/healthz")).status_code == 200
    resp = await auth_client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json()["ready"] is False


async def test_failed_exchange_is_logged_with_key_hash_only(
    auth_client: httpx.AsyncClient, module_env: Path
) -> None:
    request_id = "unit-req-hash-check"
    resp = await auth_client.post(
        CHAT,
        json=chat(user="end-user"),
        headers={"authorization": f"Bearer {API_KEY}", "x-request-id": request_id},
    )
    assert resp.status_code == 503
    secret = server_secret(RatchetSettings(home=module_env))  # the one the module's apps share
    # Kafka is down, so the log worker spools the record; wait for it on disk.
    spool_dir = module_env / "state" / "spool"
    record: OutgoingRecord | None = None
    # Each proxy spools under its own folder; search them all. The worker first waits out its
    # attempt to reach the broker.
    deadline = time.monotonic() + 30
    while record is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        for folder in spool_dir.glob("proxy-*"):
            for _, records in Spool(folder).drain():
                for r in records:
                    # Keyed by the proxy's own request id; the client's is a correlation field.
                    if orjson.loads(r.value).get("client_request_id") == request_id:
                        record = r
    assert record is not None, "the failed exchange was not logged"
    assert record.topic == TRAFFIC_TOPIC
    for path in spool_dir.rglob("*"):  # the spool and the log worker's journal
        assert path.is_dir() or API_KEY.encode() not in path.read_bytes()
    data = orjson.loads(record.value)
    assert data["api_key_hash"] == hash_api_key(secret, API_KEY)
    assert data["api_key_hash"] != hash_api_key(b"another secret", API_KEY)
    assert data["status"] == 503
    assert data["error"]["code"] == "upstream_unavailable"
    assert data["alias"] == "support" and data["version"] == 0
    assert data["gen_ai.response.model"] == "smollm2-135m-instruct"
    assert data["user"] == "end-user"

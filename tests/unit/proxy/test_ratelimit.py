"""Per-key rate limits and token budgets, against a real Redis shared by two "replicas".

Buckets refill on Redis's clock, so waits are asserted as retry-after values (whole seconds,
rounded up) and the one refill that is waited for is polled with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from aiohttp import web

from embedded.processes import free_port as closed_port
from proxy import ratelimit
from proxy.app import create_app
from proxy.buckets import (
    KEY_PREFIX,
    Limit,
    LocalBuckets,
    choice_events,
    prompt_estimate,
    reservation,
    total_tokens,
)
from proxy.errors import ProxyError
from proxy.metrics import ProxyMetrics
from proxy.ratelimit import RateLimiter
from proxy.validation import RequestLimits
from ratchet.settings import ConfigError, RateLimitSettings, load_settings

KEY_A, KEY_B, KEY_C = "hmac-sha256:aaaa", "hmac-sha256:bbbb", "hmac-sha256:cccc"
DAY_MS = 86_400_000


def answer_using(tokens: int) -> bytes:
    usage = {"prompt_tokens": tokens - 1, "completion_tokens": 1, "total_tokens": tokens}
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
    return orjson.dumps(
        {"id": "c1", "object": "chat.completion", "choices": [choice], "usage": usage}
    )


class Replicas:
    """Limiters made for one test, closed at its end; each is one proxy replica's."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.made: list[RateLimiter] = []
        self.metrics: dict[int, ProxyMetrics] = {}

    def __call__(self, per_key: bool = True, url: str | None = None, **limits: Any) -> RateLimiter:
        metrics = ProxyMetrics()
        # The test machine may be loaded; failing open is tested on its own.
        limits.setdefault("timeout_s", 5.0)
        limiter = RateLimiter(RateLimitSettings(**limits), url or self.redis_url, metrics, per_key)
        self.made.append(limiter)
        self.metrics[id(limiter)] = metrics
        return limiter

    def count(self, limiter: RateLimiter, metric: str, **labels: str) -> float | None:
        return self.metrics[id(limiter)].registry.get_sample_value(metric, labels)


@pytest.fixture
async def replica(redis_url: str) -> AsyncIterator[Replicas]:
    replicas = Replicas(redis_url)
    yield replicas
    for limiter in replicas.made:
        await limiter.close()


async def refusal(limiter: RateLimiter, key_hash: str | None, reserve: int = 0) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        await limiter.admit(key_hash, reserve)
    return caught.value


def retry_after(error: ProxyError) -> int:
    assert error.headers is not None
    return int(error.headers["retry-after"])


async def test_the_request_limit_holds_across_two_replicas(replica: Replicas) -> None:
    # One token every 10 s: a loaded machine (two test workers) may take a second over the
    # five calls, which at one a second would refill the bucket before it is found empty.
    first = replica(requests_per_minute=6, burst=3)
    second = replica(requests_per_minute=6, burst=3)
    for limiter in (first, second, first):
        await limiter.admit(KEY_A)
    for limiter in (second, first):
        error = await refusal(limiter, KEY_A)
        assert error.status == 429
        assert error.body()["error"]["code"] == "rate_limit_exceeded"
        assert error.body()["error"]["type"] == "requests"
        assert "proxy.rate_limit.requests_per_minute" in error.body()["error"]["message"]
        # The next token is at most 10 s away, rounded up to whole seconds.
        assert retry_after(error) in (9, 10)


async def test_concurrent_requests_on_two_replicas_get_exactly_the_burst(
    replica: Replicas,
) -> None:
    first = replica(requests_per_minute=1, burst=30)
    second = replica(requests_per_minute=1, burst=30)
    calls = [limiter.admit(KEY_A) for _ in range(50) for limiter in (first, second)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(outcome is None for outcome in outcomes) == 30
    assert all(isinstance(o, ProxyError) for o in outcomes if o is not None)


async def test_a_redis_that_forgot_the_scripts_or_dropped_us_is_used_again(
    replica: Replicas, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ratelimit, "UNAVAILABLE_BACKOFF_S", 0.0)
    limiter = replica(requests_per_minute=60, burst=2)
    await limiter.admit(KEY_A)
    server = redis.Redis.from_url(redis_url)
    server.script_flush()  # as after a restart
    server.client_kill_filter(_type="normal", skipme=True)
    deadline = time.monotonic() + 5
    while True:  # the first call may still find the dropped connection, and fail open
        try:
            await limiter.admit(KEY_A)
        except ProxyError:
            break
        assert time.monotonic() < deadline, "the limit was never enforced again"


async def test_a_key_far_from_its_limit_does_not_wait_and_is_still_counted(
    replica: Replicas,
) -> None:
    limiter = replica(requests_per_minute=1, burst=10)
    await limiter.admit(KEY_A)  # the first waits: nothing is known of the bucket yet
    assert limiter.ask(KEY_A) is None  # 9 of 10 left: no need to wait
    admitted = 2
    while True:
        try:
            await limiter.admit(KEY_A)
        except ProxyError:
            break
        admitted += 1
    assert admitted == 10  # every request was taken from the bucket in Redis
    overshoot = "ratchet_proxy_ratelimit_overshoot_total"
    assert replica.count(limiter, overshoot, limit="requests_per_minute") == 0


async def test_a_replica_serves_at_most_one_request_past_a_limit_others_drained(
    replica: Replicas,
) -> None:
    first = replica(requests_per_minute=1, burst=4)
    await first.admit(KEY_A)  # first's view: 3 of 4 left
    for _ in range(3):  # other replicas take the rest meanwhile
        await replica(requests_per_minute=1, burst=4).admit(KEY_A)
    assert first.ask(KEY_A) is None  # first still believes the key far from its limit
    overshoot = "ratchet_proxy_ratelimit_overshoot_total"
    deadline = time.monotonic() + 5
    while not replica.count(first, overshoot, limit="requests_per_minute"):
        assert time.monotonic() < deadline, "Redis's answer never came"
        await asyncio.sleep(0.01)
    await refusal(first, KEY_A)  # and no more


async def test_two_busy_replicas_pass_a_limit_by_at_most_their_unconfirmed_share(
    replica: Replicas,
) -> None:
    first = replica(requests_per_minute=1, burst=400)
    second = replica(requests_per_minute=1, burst=400)
    assert first.fast_max == 4  # 1% of the burst may be let through before Redis confirms
    admitted = 0

    async def hammer(limiter: RateLimiter) -> None:
        nonlocal admitted
        for _ in range(400):
            try:
                await limiter.admit(KEY_A)
                admitted += 1
            except ProxyError:
                pass
            await asyncio.sleep(0)  # answers come in between, as between real requests

    await asyncio.gather(hammer(first), hammer(second))
    assert 400 <= admitted <= 400 + 2 * first.fast_max
    await first.drain()
    await second.drain()
    overshoot = "ratchet_proxy_ratelimit_overshoot_total"
    counted = sum(
        replica.count(r, overshoot, limit="requests_per_minute") or 0 for r in (first, second)
    )
    assert (admitted > 400) <= (counted > 0)  # going past the limit is never silent


async def test_retry_after_is_the_wait_rounded_up(replica: Replicas) -> None:
    slow = replica(requests_per_minute=6, burst=1)  # one request every 10 s
    await slow.admit(KEY_A)
    assert retry_after(await refusal(slow, KEY_A)) == 10

    fast = replica(requests_per_minute=120, burst=1)  # one request every 0.5 s
    drained_at = time.monotonic()
    await fast.admit(KEY_B)
    refused_at = time.monotonic()
    assert retry_after(await refusal(fast, KEY_B)) == 1
    # Bounds from when each attempt started and ended, not from a loop's timing, so a loaded
    # machine cannot fail them: no attempt is admitted well before the bucket refilled (0.5 s
    # after it was drained), and none that starts after the retry-after (1 s) is refused.
    last_refused_start = refused_at
    while True:
        started = time.monotonic()
        assert started < refused_at + 5, "the bucket never refilled"
        try:
            await fast.admit(KEY_B)
            break
        except ProxyError:
            last_refused_start = started
            await asyncio.sleep(0.01)  # poll interval
    admitted_at = time.monotonic()
    assert admitted_at - drained_at > 0.3, admitted_at - drained_at
    assert last_refused_start - refused_at <= 1.0, last_refused_start - refused_at


async def test_a_token_budget_charged_after_the_answer_refuses_the_next_request(
    replica: Replicas,
) -> None:
    first = replica(tokens_per_minute=100)
    second = replica(tokens_per_minute=100)
    await first.admit(KEY_A)
    await first.admit(KEY_A)  # the budget is only charged after an answer
    first.charge(KEY_A, 0, 150)
    # No wait: the key's next request takes the charge to Redis ahead of its own check.
    for limiter in (first, second):
        error = await refusal(limiter, KEY_A)
        assert error.body()["error"]["type"] == "tokens"
        assert "proxy.rate_limit.tokens_per_minute" in error.body()["error"]["message"]
        # 150 of 100 spent: 51 tokens to refill at 0.6 s each, about 30.6 s.
        assert retry_after(error) in (30, 31)


async def test_a_charge_reaches_the_other_replicas_without_another_request(
    replica: Replicas,
) -> None:
    first = replica(tokens_per_minute=100)
    second = replica(tokens_per_minute=100)
    first.charge(KEY_A, 0, 150)
    charged_at = time.monotonic()
    while True:
        try:
            await second.admit(KEY_A)
        except ProxyError:
            break
        assert time.monotonic() < charged_at + 5, "the charge never reached Redis"
    assert time.monotonic() - charged_at < 1.0  # sent after CHARGE_DELAY_S, not much later


async def test_the_day_budget_waits_for_its_refill(replica: Replicas, redis_url: str) -> None:
    limiter = replica(tokens_per_minute=1_000, tokens_per_day=100)
    limiter.charge(KEY_A, 0, 150)
    await limiter.drain()
    error = await refusal(limiter, KEY_A)
    assert "proxy.rate_limit.tokens_per_day" in error.body()["error"]["message"]
    expected_s = math.ceil(51 * DAY_MS / 100 / 1000)
    assert expected_s - 2 <= retry_after(error) <= expected_s
    # Each bucket's key lives until the bucket is full again, and no longer.
    ttl_ms = redis.Redis.from_url(redis_url).pttl(f"{KEY_PREFIX}{KEY_A}:tokens_per_day")
    assert 149 * DAY_MS / 100 < ttl_ms <= 150 * DAY_MS / 100


async def test_no_key_spends_another_keys_budget(replica: Replicas) -> None:
    limiter = replica(requests_per_minute=60, burst=1, tokens_per_minute=100)
    await limiter.admit(KEY_A)
    await refusal(limiter, KEY_A)
    await limiter.admit(KEY_B)  # its own requests bucket

    tokens = replica(tokens_per_minute=100)
    tokens.charge(KEY_A, 0, 500)
    await tokens.drain()
    await refusal(tokens, KEY_A)
    await tokens.admit(KEY_B)  # its own token budget


async def test_without_auth_every_caller_shares_one_bucket(replica: Replicas) -> None:
    # Any key is accepted without auth: one per request must not buy a fresh bucket.
    limiter = replica(per_key=False, requests_per_minute=60, burst=1)
    await limiter.admit(KEY_A)
    error = await refusal(limiter, KEY_B)
    assert "all callers together" in error.body()["error"]["message"]
    await refusal(limiter, None)


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A port that accepts connections and never answers: Redis hung or the network lost."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"


@pytest.mark.parametrize("down", ["refused", "silent"])
async def test_redis_down_leaves_each_replica_its_own_limits_and_is_counted(
    replica: Replicas, silent_redis: str, down: str
) -> None:
    url = silent_redis if down == "silent" else f"redis://127.0.0.1:{closed_port()}/0"
    limiter = replica(url=url, requests_per_minute=1, burst=2, timeout_s=0.05)
    for _ in range(2):
        await limiter.admit(KEY_A)
    error = await refusal(limiter, KEY_A)  # not served unchecked: the burst holds here
    assert "proxy.rate_limit.requests_per_minute" in error.body()["error"]["message"]
    assert 55 <= retry_after(error) <= 60
    await limiter.admit(KEY_B)  # each key its own bucket still
    unavailable = "ratchet_proxy_ratelimit_unavailable_total"
    assert replica.count(limiter, unavailable, call="admit") == 4


async def test_token_budgets_fail_closed_without_redis_unless_set_local(
    replica: Replicas,
) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    closed = replica(url=url, tokens_per_minute=100, timeout_s=0.05)
    error = await refusal(closed, KEY_A)
    assert error.status == 503
    assert error.body()["error"]["code"] == "rate_limit_unavailable"
    assert "proxy.rate_limit.budgets_without_redis" in error.body()["error"]["message"]
    assert retry_after(error) == 1

    local = replica(url=url, tokens_per_minute=100, timeout_s=0.05, budgets_without_redis="local")
    await local.admit(KEY_A, reserve=60)
    error = await refusal(local, KEY_A, reserve=60)  # 40 left here
    assert (error.status, error.body()["error"]["type"]) == (429, "tokens")
    local.charge(KEY_A, reserved=60, used=10)  # settled here too: 50 back
    await local.admit(KEY_A, reserve=60)


async def test_a_stalled_redis_does_not_open_the_limits_nor_drop_the_connection(
    replica: Replicas, redis_url: str
) -> None:
    server = redis.Redis.from_url(redis_url)
    limiter = replica(requests_per_minute=1, burst=1, timeout_s=0.05)
    budget = replica(tokens_per_minute=100, timeout_s=0.05)
    await limiter.admit(KEY_A)  # connected
    await budget.admit(KEY_A)
    connections = [r._redis._connection for r in (limiter, budget)]
    server.execute_command("CLIENT", "PAUSE", 2000, "WRITE")  # scripts that write wait
    try:
        await limiter.admit(KEY_B)  # late: checked here, from a full bucket
        await refusal(limiter, KEY_B)  # and the burst of one holds
        assert (await refusal(budget, KEY_B)).status == 503  # budgets fail closed
    finally:
        server.execute_command("CLIENT", "UNPAUSE")
    # One late reply drops nothing: the same connections, asked again at once (no back-off).
    assert [r._redis._connection for r in (limiter, budget)] == connections
    assert not any(connection is None or connection.closed for connection in connections)
    await limiter.drain()
    await budget.admit(KEY_C, reserve=10)
    assert server.pttl(f"{KEY_PREFIX}{KEY_C}:tokens_per_minute") > 0


async def test_a_full_redis_does_not_open_the_limits(replica: Replicas, redis_url: str) -> None:
    server = redis.Redis.from_url(redis_url)
    limiter = replica(requests_per_minute=1, burst=1)
    await limiter.admit(KEY_A)  # connected, and KEY_A drained in Redis
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", 1)  # full: every write is refused
    try:
        await limiter.admit(KEY_B)  # an error reply: checked here
        await refusal(limiter, KEY_B)
        unavailable = "ratchet_proxy_ratelimit_unavailable_total"
        assert replica.count(limiter, unavailable, call="admit") == 2
    finally:
        server.config_set("maxmemory", 0)


async def test_admission_reserves_what_a_request_may_use_and_settles_after(
    replica: Replicas,
) -> None:
    first = replica(tokens_per_minute=100)
    second = replica(tokens_per_minute=100)
    await first.admit(KEY_A, reserve=60)
    error = await refusal(second, KEY_A, reserve=60)  # 40 left: not enough for 60
    assert error.body()["error"]["type"] == "tokens"
    assert retry_after(error) in (12, 13)  # 20 tokens at 0.6 s each
    await second.admit(KEY_A, reserve=30)  # 10 left
    first.charge(KEY_A, reserved=60, used=10)  # the answer used 10: 50 back
    await first.drain()
    await second.admit(KEY_A, reserve=55)
    await refusal(first, KEY_A, reserve=20)  # 5 left


async def test_a_request_larger_than_the_budget_waits_for_a_full_bucket(
    replica: Replicas,
) -> None:
    limiter = replica(tokens_per_minute=100)
    await limiter.admit(KEY_A, reserve=5_000)  # takes the whole budget, not forever refused
    error = await refusal(limiter, KEY_A, reserve=5_000)
    assert retry_after(error) in (60, 61)
    limiter.charge(KEY_A, reserved=5_000, used=130)  # 30 past the budget
    await limiter.drain()
    assert retry_after(await refusal(limiter, KEY_A, reserve=5_000)) in (78, 79)


async def test_refusals_are_remembered_and_counted_by_limit(
    replica: Replicas, redis_url: str
) -> None:
    limiter = replica(requests_per_minute=6, burst=1)
    server = redis.Redis.from_url(redis_url)
    server.config_resetstat()
    await limiter.admit(KEY_A)
    for _ in range(3):
        await refusal(limiter, KEY_A)
    refused = "ratchet_proxy_ratelimit_refused_total"
    assert replica.count(limiter, refused, limit="requests_per_minute") == 3
    # Only the admitted request asked Redis: its answer said the bucket was empty, and a key
    # that keeps knocking costs Redis nothing.
    assert server.info("commandstats")["cmdstat_evalsha"]["calls"] == 1


def test_total_tokens_reads_usage_without_parsing() -> None:
    assert total_tokens(answer_using(39)) == 39
    spaced = b'{"choices": [], "usage": {"prompt_tokens": 3, "total_tokens" : 12}}'
    assert total_tokens(spaced) == 12
    stream = (
        b'data: {"choices":[{"delta":{"content":"\\"total_tokens\\": 999"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"total_tokens":7}}\n\ndata: [DONE]\n\n'
    )
    assert total_tokens(stream) == 7
    # A client's text cannot pose as usage: inside a JSON string its quotes are escaped.
    cut_short = b'data: {"choices":[{"delta":{"content":"\\"total_tokens\\":999"}}]}\n\n'
    assert total_tokens(cut_short) == 0


def test_a_reservation_covers_every_choice_of_every_prompt() -> None:
    limits = RequestLimits.from_settings(load_settings().proxy)
    limits.set_model_context(2048)
    chat = {"messages": [], "n": 3, "max_tokens": 10, "max_completion_tokens": 20}
    assert reservation(chat, "chat.completions", limits, prompt=7) == 7 + 3 * 20
    prompts = {"prompt": ["a", "b"], "best_of": 4, "n": 2, "max_tokens": 5}
    assert reservation(prompts, "completions", limits, prompt=1) == 1 + 2 * 4 * 5
    token_ids = {"prompt": [1, 2, 3]}  # one prompt; no max_tokens: up to the model's context
    assert reservation(token_ids, "completions", limits, prompt=1) == 1 + 2048
    assert prompt_estimate(b"x" * 400) == 101


def test_settings_come_from_the_environment_and_burst_needs_a_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_PROXY__RATE_LIMIT__REQUESTS_PER_MINUTE", "600")
    monkeypatch.setenv("RATCHET_PROXY__RATE_LIMIT__TOKENS_PER_DAY", "1000000")
    limits = load_settings().proxy.rate_limit
    assert (limits.requests_per_minute, limits.tokens_per_day) == (600, 1_000_000)
    assert limits.tokens_per_minute is None
    monkeypatch.delenv("RATCHET_PROXY__RATE_LIMIT__REQUESTS_PER_MINUTE")
    monkeypatch.setenv("RATCHET_PROXY__RATE_LIMIT__BURST", "5")
    with pytest.raises(ConfigError, match="requests_per_minute is not"):
        load_settings()


# ---- through the proxy -------------------------------------------------------------------------


@pytest.fixture
async def limited_proxy(
    upstream: dict[str, Any], redis_url: str, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=answer_using(150), content_type="application/json")

    upstream["handler"] = answer
    app = create_app(
        load_settings(
            home=tmp_path,
            kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
            redis_url=redis_url,
            vllm_url=upstream["url"],
            proxy={
                "api_keys": ["sk-a", "sk-b"],
                "rate_limit": {"tokens_per_minute": 100, "timeout_s": 5.0},
            },
        )
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.ratchet


async def test_the_proxy_answers_429_with_retry_after_once_the_budget_is_spent(
    limited_proxy: tuple[httpx.AsyncClient, Any],
) -> None:
    client, state = limited_proxy
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}]}

    def as_key(key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    first = await client.post("/v1/chat/completions", json=body, headers=as_key("sk-a"))
    assert first.status_code == 200, first.text
    await state.rate_limiter.drain()
    refused = await client.post("/v1/chat/completions", json=body, headers=as_key("sk-a"))
    assert refused.status_code == 429
    # 150 of 100 spent, and the next request reserves the whole budget (no max_tokens: up to
    # the model's context), so 150 tokens to refill at 0.6 s each.
    assert int(refused.headers["retry-after"]) in (89, 90, 91)
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "proxy.rate_limit.tokens_per_minute" in error["message"]
    other = await client.post("/v1/chat/completions", json=body, headers=as_key("sk-b"))
    assert other.status_code == 200, other.text
    metrics = (await client.get("/metrics")).text
    assert 'ratchet_proxy_ratelimit_refused_total{limit="tokens_per_minute"} 1.0' in metrics


# ---- what a request is charged, through the proxy ----------------------------------------------

# One token a second, so what a key spent reads off its bucket's TTL in seconds.
PER_DAY = {"tokens_per_day": 86_400, "timeout_s": 5.0}
MAX_TOKENS = 50
BUDGET_KEY = "sk-budget"


def token_event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c1", "choices": [choice], "usage": None}) + b"\n\n"


@pytest.fixture
def budgeted(upstream: dict[str, Any], redis_url: str, tmp_path: Path) -> Any:
    """``async with budgeted(handler, **proxy) as state``: the app with a day budget of one
    token a second, and ``state.spent()``: the tokens its one key has spent, read in Redis."""

    @contextlib.asynccontextmanager
    async def running(handler: Any, **proxy: Any) -> AsyncIterator[Any]:
        upstream["handler"] = handler
        settings = load_settings(
            home=tmp_path,
            kafka_bootstrap_servers=f"127.0.0.1:{closed_port()}",
            redis_url=redis_url,
            vllm_url=upstream["url"],
            proxy={"api_keys": [BUDGET_KEY], "rate_limit": PER_DAY, **proxy},
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            yield app

    return running


async def spent(app: Any, redis_url: str) -> float:
    """Tokens the key has spent of its day budget (refilling at one a second)."""
    await app.state.ratchet.rate_limiter.drain()
    server = redis.Redis.from_url(redis_url)
    keys = server.keys(f"{KEY_PREFIX}*:tokens_per_day")  # none: a full bucket
    return max(0, server.pttl(keys[0])) / 1000 if keys else 0.0


def chat_body(**fields: Any) -> bytes:
    messages = [{"role": "user", "content": "count to fifty"}]
    return orjson.dumps({"model": "support", "messages": messages, **fields})


async def post(app: Any, body: bytes) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        headers = {"authorization": f"Bearer {BUDGET_KEY}", "content-type": "application/json"}
        return await client.post("/v1/chat/completions", content=body, headers=headers)


async def stream_and_leave(app: Any, body: bytes, events: int) -> None:
    """POST a stream straight to the ASGI app and leave (http.disconnect) once ``events``
    choice events have arrived, as a client closing its socket mid-answer."""
    received, enough = [b""], asyncio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await enough.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        received[0] += message.get("body", b"")
        if choice_events(received[0]) >= events:
            enough.set()

    headers = [
        (b"authorization", f"Bearer {BUDGET_KEY}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("proxy", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 30)


async def test_a_stream_the_client_leaves_is_charged_the_tokens_streamed(
    budgeted: Any, redis_url: str
) -> None:
    async def ten_tokens_then_more(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(10):
            await response.write(token_event("one "))
        await asyncio.sleep(30)  # generating still; the client leaves meanwhile
        return response

    body = chat_body(stream=True, max_tokens=MAX_TOKENS)
    async with budgeted(ten_tokens_then_more, upstream_timeout_s=30) as app:
        await stream_and_leave(app, body, events=10)
        charged = await spent(app, redis_url)
    # Its prompt as estimated and the 10 tokens streamed: not nothing (no usage event came), and
    # not the 50 it reserved either.
    expected = prompt_estimate(body) + 10
    assert expected - 5 <= charged <= expected, (charged, expected)


@pytest.mark.parametrize("failure", ["upstream_timeout", "answer_too_large"])
async def test_a_504_or_an_answer_too_large_is_charged_what_it_reserved(
    budgeted: Any, redis_url: str, failure: str
) -> None:
    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)  # past upstream_timeout_s; cancelled at teardown
        return web.json_response({})

    async def huge(_: web.Request) -> web.Response:
        content = "word " * 20_000  # past max_answer_bytes: its usage is never read
        choice = {"index": 0, "message": {"role": "assistant", "content": content}}
        return web.json_response({"id": "c1", "choices": [choice], "usage": None})

    handler = hang if failure == "upstream_timeout" else huge
    body = chat_body(max_tokens=MAX_TOKENS, n=2)
    async with budgeted(handler, upstream_timeout_s=0.5, max_answer_bytes=65_536) as app:
        response = await post(app, body)
        assert response.json()["error"]["code"] == failure, response.text
        charged = await spent(app, redis_url)
    # vLLM generated what the client never saw: all the request reserved, n x max_tokens too.
    expected = prompt_estimate(body) + 2 * MAX_TOKENS
    assert expected - 5 <= charged <= expected, (charged, expected)


@pytest.mark.parametrize("status", [400, 500])
async def test_a_request_vllm_refuses_is_refunded_and_an_answer_charged_its_usage(
    budgeted: Any, redis_url: str, upstream: dict[str, Any], status: int
) -> None:
    async def refuse(_: web.Request) -> web.Response:
        error = {"message": "too long or out of memory", "type": "Error", "code": status}
        return web.json_response({"error": error}, status=status)

    async with budgeted(refuse) as app:
        for stream in (False, True):
            answer = await post(app, chat_body(max_tokens=MAX_TOKENS, stream=stream))
            assert answer.status_code in (400, 502), answer.text
        assert await spent(app, redis_url) == 0

        async def answer(_: web.Request) -> web.Response:
            return web.Response(body=answer_using(150), content_type="application/json")

        upstream["handler"] = answer
        assert (await post(app, chat_body(max_tokens=MAX_TOKENS))).status_code == 200
        assert 145 <= await spent(app, redis_url) <= 150  # vLLM's usage, not the reservation


async def test_with_budgets_a_request_refused_for_its_body_still_counts(
    budgeted: Any, upstream: dict[str, Any]
) -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=answer_using(10), content_type="application/json")

    limits = {**PER_DAY, "requests_per_minute": 1, "burst": 1}
    async with budgeted(answer, rate_limit=limits) as app:
        assert (await post(app, b"not json")).status_code == 400  # its body checked first
        refused = await post(app, chat_body(max_tokens=MAX_TOKENS))
        assert refused.status_code == 429, refused.text
        assert "proxy.rate_limit.requests_per_minute" in refused.json()["error"]["message"]
        assert (await post(app, b"not json")).status_code == 429  # over the rate: 429 first


def test_a_full_bucket_of_one_admits_whatever_the_clock_reads() -> None:
    """A burst-1 limit, full: the local buckets admit its one request at any time. Computed as
    (now + need) - now - room, float rounding refused it at about 0.6% of clock readings (seen
    in CI at 4170767.042693 ms)."""
    one = Limit("requests_per_minute", "requests", 60_000.0, 1, 1, "1 request per minute")
    for now_ms in (4_170_767.042693, *(1e6 + i * 7_919.123457 for i in range(2_000))):
        local = LocalBuckets([one])
        assert local.admit("b", [60_000.0], now_ms, ([1.0], 0.0)) is None, now_ms
        assert local.admit("b", [60_000.0], now_ms, ([1.0], 0.0)) is not None  # now empty

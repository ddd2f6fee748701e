"""bench/redis_footprint.py's two short scenarios (``--scenario exchanges`` and ``responses``),
each on a Redis of its own with the project's own writers, no broker and no vLLM.

``exchanges``: what one exchange leaves in Redis on the default config (one alias, RULER with
the agreement probe on, so the learner notes every answer for its rating), by key family: the
proxy's owner note (``CompletionOwners``), the learner's join note (``RatingsJoin.on_traffic``),
the judge's done and seen marks for ``--judged`` of them (``JudgeMarks``; the judge takes only
what the learner can train on, so at most one each per exchange; each prompt sampled, the
costlier mark, and its done mark deleted when its batch of ``judge.poll_records`` is committed,
as the judge does), and with ``--canary`` the
canary watcher's claim (``learner/canary_claims.py``: a field of a sliced hash, while a canary
runs). Reported: ``used_memory`` per exchange, and per family its keys and mean
``MEMORY USAGE``.

``responses``: the Responses store (``proxy/response_store.py``) filled by its largest allowed
requests: ``metadata`` of 16 pairs, keys of 64 characters and values of 512, a ``--input-chars``
prompt and an answer of ``--answer-chars``, each translated by the route's own code
(``to_chat``, ``response_object``) and saved for one of ``--keys`` API keys, until the total
quota (``--store-mib``, default the setting's) refuses ``REFUSED_IN_A_ROW`` in a row. Reported:
outcomes, ``used_memory`` above the start against the quota, and Redis bytes per stored response;
and first, on the empty Redis, the p50 time of one save against the plain ``SET`` it replaced
(:func:`save_latency`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from embedded.processes import Stack, free_port
from embedded.stack import redis_part
from judge.marks import JudgeMarks, SeenMark
from learner.canary_claims import claim_answer
from learner.ratings import RatingsJoin
from proxy.completions import CompletionOwners, owner_ttl_s
from proxy.response_store import ResponseStore
from proxy.responses_api import assistant_message, response_object, to_chat
from ratchet.records import HeldoutPrompt, TrafficRecord, prompt_hash
from ratchet.secrets import hash_api_key
from ratchet.settings import AliasConfig, ProxySettings, RatchetSettings

ALIAS = "bench"
KEYS_SAMPLED = 200  # per family, for its mean MEMORY USAGE
REFUSED_IN_A_ROW = 200
LATENCY_SAMPLES = 2000  # saves timed, and as many plain SETs
FAMILIES = {
    "proxy owner note": "ratchet:completion:*",
    "learner join note": "ratchet:feedback:exchange:*",
    "judge done mark": "ratchet:judge:done:*",
    "judge seen mark (before the upgrade)": "ratchet:judge:seen:*",
    "judge seen sets": "ratchet:judge:seen-sets:*",
    "canary note (during a canary, before sliced claims)": "ratchet:canary:completion:*",
    "canary claim shards (during a canary)": "ratchet:canary:claims:*",
    "stored response": "ratchet:response:*",
    "store ledgers": "ratchet:responses:*",
}


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def census(client: redis.Redis) -> dict[str, dict[str, float]]:
    """Per key family: how many keys, and the mean MEMORY USAGE of up to KEYS_SAMPLED."""
    out: dict[str, dict[str, float]] = {}
    for name, pattern in FAMILIES.items():
        keys = list(client.scan_iter(match=pattern, count=1000))
        if not keys:
            continue
        sample = keys[:KEYS_SAMPLED]
        usage = [int(client.memory_usage(k, samples=0) or 0) for k in sample]
        out[name] = {"keys": len(keys), "mean_bytes": round(statistics.fmean(usage), 1)}
    return out


def traffic(i: int, completion_id: str, key_hash: str, prompt_chars: int) -> TrafficRecord:
    text = (f"Request {i}: summarise this. " + "The quick brown fox. " * prompt_chars)[
        :prompt_chars
    ]
    return TrafficRecord(
        request_id=uuid.uuid4().hex,
        endpoint="chat.completions",
        alias=ALIAS,
        request_model=ALIAS,
        response_model=f"{ALIAS}@v1",
        version=1,
        canary_arm="active",
        request={"messages": [{"role": "user", "content": text}], "max_tokens": 16},
        response_id=completion_id,
        choices=[{"index": 0, "message": {"role": "assistant", "content": "Sure, here it is."}}],
        status=200,
        latency_ms=5.0,
        api_key_hash=key_hash,
    )


async def write_exchanges(url: str, settings: RatchetSettings, args: argparse.Namespace) -> None:
    """``args.exchanges`` exchanges as each service notes them."""
    owners = CompletionOwners(url, CollectorRegistry(), owner_ttl_s(settings))
    join = RatingsJoin(settings, redis.Redis.from_url(url), fetch=lambda _p, _o: None)
    marks = JudgeMarks(aioredis.Redis.from_url(url), settings.judge.done_ttl_s)
    canary = redis.Redis.from_url(url)
    window = settings.aliases[ALIAS].learning.dedup_window_s
    batch = settings.judge.poll_records
    for i in range(args.exchanges):
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        key_hash = hash_api_key(b"bench", f"key-{i % args.keys}")
        assert key_hash is not None
        record = traffic(i, completion_id, key_hash, args.prompt_chars)
        owners.remember(orjson_id(completion_id), key_hash)
        join.on_traffic(record, 0, i)
        if args.canary:
            claims = canary.pipeline(transaction=False)
            claim_answer(claims, record, "canary")
            claims.execute()
        if i % 500 == 0:
            await owners.drain()
        if int((i + 1) * args.judged) == int(i * args.judged):
            continue  # the judge did not take this one
        messages = record.request["messages"]
        digest = prompt_hash(messages, None)
        held = HeldoutPrompt(
            prompt_hash=digest,
            alias=ALIAS,
            prompt_messages=messages,
            traffic_request_id=record.request_id,
        )
        await marks.mark_done([held])
        await marks.mark_seen([SeenMark(ALIAS, digest, window, 1)])
        if i % batch == batch - 1:
            await marks.settle(True)  # the batch's offsets committed
    await owners.close()
    await marks.redis.aclose()


def orjson_id(completion_id: str) -> bytes:
    return b'{"id":"' + completion_id.encode() + b'"}'


def exchanges(url: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    settings = RatchetSettings(
        home=home, redis_url=url, secret="redis-footprint-bench", aliases={ALIAS: AliasConfig()}
    )
    client = redis.Redis.from_url(url)
    before = used_memory(client)
    started = time.monotonic()
    asyncio.run(write_exchanges(url, settings, args))
    seconds = time.monotonic() - started
    after = used_memory(client)
    families = census(client)
    return {
        "exchanges": args.exchanges,
        "seconds": round(seconds, 1),
        "used_memory_start": before,
        "used_memory_end": after,
        "bytes_per_exchange": round((after - before) / args.exchanges, 1),
        "families": families,
        "dbsize": client.dbsize(),
    }


def largest_metadata() -> dict[str, str]:
    """OpenAI's bound on ``metadata``: 16 pairs, keys of 64 characters, values of 512."""
    return {f"{i:02d}".ljust(64, "k"): chr(ord("a") + i) * 512 for i in range(16)}


def chat_answer(i: int, chars: int) -> dict[str, Any]:
    text = ("Here is the answer. " * (chars // 20 + 1))[:chars]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": 1,
        "model": f"{ALIAS}@v1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 100, "total_tokens": 200 + i % 2},
    }


def largest_request(args: argparse.Namespace) -> dict[str, Any]:
    text = "Summarise the report below. " * (args.input_chars // 28 + 1)
    return {
        "model": ALIAS,
        "input": text[: args.input_chars],
        "metadata": largest_metadata(),
        "max_output_tokens": 256,
    }


async def save_latency(url: str, settings: ProxySettings, args: argparse.Namespace) -> Any:
    """p50 of one save (quotas checked in the Lua script) against the write it replaced (one
    SET with EX of the same entry, as before the quotas), alternated on the same client and
    Redis; the keys are removed after."""
    client = aioredis.Redis.from_url(url)
    store = ResponseStore(client, CollectorRegistry(), settings)
    translated = to_chat(largest_request(args), None)
    quota_s: list[float] = []
    plain_s: list[float] = []
    for i in range(LATENCY_SAMPLES):
        response = response_object(chat_answer(i, args.answer_chars), translated.echo)
        conversation = [*translated.conversation, assistant_message(response)]
        key_hash = hash_api_key(b"bench", f"key-{i % args.keys}")
        started = time.perf_counter()
        await store.save(response, conversation, key_hash)
        quota_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        entry = {"owner": key_hash, "response": response, "conversation": conversation}
        await client.set(
            f"plain:{response['id']}", orjson.dumps(entry), ex=settings.responses_store_ttl_s
        )
        plain_s.append(time.perf_counter() - started)
    await client.flushdb()
    await client.aclose()
    return {
        "save_p50_us": round(statistics.median(quota_s) * 1e6, 1),
        "plain_set_p50_us": round(statistics.median(plain_s) * 1e6, 1),
    }


async def fill_store(url: str, settings: ProxySettings, args: argparse.Namespace) -> Counter[str]:
    client = aioredis.Redis.from_url(url)
    store = ResponseStore(client, CollectorRegistry(), settings)
    payload = largest_request(args)
    outcomes: Counter[str] = Counter()
    refused = 0
    i = 0
    while refused < REFUSED_IN_A_ROW and i < args.max_responses:
        translated = to_chat(payload, None)
        response = response_object(chat_answer(i, args.answer_chars), translated.echo)
        conversation = [*translated.conversation, assistant_message(response)]
        key_hash = hash_api_key(b"bench", f"key-{i % args.keys}")
        stored = await store.save(response, conversation, key_hash)
        refused = 0 if stored else refused + 1
        i += 1
    for outcome in ("stored", "too_large", "key_quota", "total_quota", "redis_error"):
        outcomes[outcome] = int(store.saved.labels(outcome)._value.get())
    await client.aclose()
    return outcomes


def responses(url: str, args: argparse.Namespace) -> dict[str, Any]:
    total = args.store_mib * 2**20 if args.store_mib else None
    settings = ProxySettings(**({"responses_store_total_bytes": total} if total else {}))
    client = redis.Redis.from_url(url)
    latency = asyncio.run(save_latency(url, settings, args))
    before = used_memory(client)
    started = time.monotonic()
    outcomes = asyncio.run(fill_store(url, settings, args))
    seconds = time.monotonic() - started
    after = used_memory(client)
    charged = int(client.get("ratchet:responses:all:bytes") or 0)
    stored = outcomes["stored"]
    return {
        **latency,
        "outcomes": dict(outcomes),
        "seconds": round(seconds, 1),
        "store_total_bytes": settings.responses_store_total_bytes,
        "store_key_bytes": settings.responses_store_key_bytes,
        "charged_bytes": charged,
        "used_memory_start": before,
        "used_memory_end": after,
        "used_memory_growth": after - before,
        "growth_over_quota": round((after - before) / settings.responses_store_total_bytes, 3),
        "redis_bytes_per_stored_response": round((after - before) / stored, 1) if stored else None,
        "families": census(client),
    }


def run(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    url = f"redis://127.0.0.1:{free_port()}/0"
    stack = Stack([redis_part(url, home)], home / "state")
    stack.start()
    try:
        if args.scenario == "exchanges":
            return exchanges(url, home, args)
        return responses(url, args)
    finally:
        stack.stop()

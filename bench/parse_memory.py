"""What one accepted request body costs the proxy in memory while it is in flight, and what one
key can make a replica hold with the per-key bounds on (proxy/inflight.py).

Run it from the repository root (about two minutes)::

    .venv/bin/python bench/parse_memory.py [--held 16] [--flood 64]

Method: its own Tansu broker and Redis, and a *holding upstream* (this script with
``--serve-upstream``: it answers ``/v1/chat/completions`` only when told to, so requests stay in
flight in the proxy as long as the script likes). For each body shape, a fresh proxy (started the
production way, ``proxy.server.serve``, with one client key and the bounds off) gets ``--held``
requests of that shape at once from one key; when the upstream holds them all, the proxy's RSS
(``VmRSS``) is read, then they are released. Reported per shape: the body's size, the RSS each
held request added ((held - idle) / ``--held``) and that over what ``parse_charge`` charges it.
Then a proxy with the default bounds gets ``--flood`` of the largest bodies at once from one
key: how many it took and refused, and the RSS it reached over its idle RSS, against
``proxy.rate_limit.max_parse_bytes``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded.processes import Part, Stack, free_port, http_ok
from embedded.stack import kafka_part, redis_part
from proxy.inflight import parse_charge
from ratchet.settings.proxy import ProxySettings, RateLimitSettings

KEY = "bench-client-key"
MODEL = "bench-held-model"
MAX_BODY = ProxySettings().max_body_bytes
MAX_ITEMS = ProxySettings().max_json_items
DEFAULT_PARSE_BYTES = RateLimitSettings().max_parse_bytes


def shapes() -> dict[str, bytes]:
    """Bodies the proxy accepts: one long string; as many one-letter strings as max_json_items
    allows (a vendor field, passed through); a typical chat."""

    def chat(**extra: object) -> dict[str, object]:
        return {"model": "bench", "max_tokens": 8, **extra}

    room = MAX_BODY - 200
    return {
        "4 MiB string": orjson.dumps(chat(messages=[{"role": "user", "content": "a" * room}])),
        "262k one-letter strings": orjson.dumps(
            chat(messages=[{"role": "user", "content": "hi"}], x=["a"] * (MAX_ITEMS - 16))
        ),
        "262k-key object": orjson.dumps(
            chat(
                messages=[{"role": "user", "content": "hi"}],
                x={f"k{i}": "a" for i in range(MAX_ITEMS - 16)},
            )
        ),
        "131k one-key objects": orjson.dumps(
            chat(
                messages=[{"role": "user", "content": "hi"}],
                x=[{f"k{i}": 0} for i in range(MAX_ITEMS // 2 - 16)],
            )
        ),
        "2 KB chat": orjson.dumps(chat(messages=[{"role": "user", "content": "b" * 2000}])),
    }


# ---- the holding upstream -------------------------------------------------------------------


def serve_upstream(port: int) -> None:
    release = asyncio.Event()
    held = 0

    async def chat(request: web.Request) -> web.Response:
        nonlocal held
        await request.read()
        held += 1
        try:
            await release.wait()
        finally:
            held -= 1
        answer = {
            "id": "chatcmpl-held",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer)

    async def healthy(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def count(_: web.Request) -> web.Response:
        return web.json_response({"held": held})

    async def let_go(_: web.Request) -> web.Response:
        release.set()
        await asyncio.sleep(0)
        release.clear()
        return web.json_response({"released": True})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/held", count)
    app.router.add_post("/release", let_go)
    app.router.add_get("/health", healthy)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


# ---- the proxy ------------------------------------------------------------------------------


def start_proxy(stack: Stack, name: str, upstream: str, kafka: str, redis_url: str, bounded: bool):
    home = stack.state_dir / name
    home.mkdir()
    limits = (
        "" if bounded else "  rate_limit: {max_in_flight: 100000, max_parse_bytes: 1099511627776}\n"
    )
    (home / "ratchet.yaml").write_text(
        f"proxy:\n  api_keys: [{KEY}]\n{limits}aliases:\n  bench:\n    base_model: {MODEL}\n"
    )
    port = free_port()
    env = {
        "RATCHET_KAFKA_BOOTSTRAP_SERVERS": kafka,
        "RATCHET_REDIS_URL": redis_url,
        "RATCHET_VLLM_URL": upstream,
        "RATCHET_HOME": str(home),
        "RATCHET_PROXY__PORT": str(port),
        "RATCHET_CONFIG": str(home / "ratchet.yaml"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    run = "from ratchet.settings import load_settings; from proxy.server import serve; "
    part = Part(
        name=name,
        command=[sys.executable, "-c", run + "serve(load_settings())"],
        address=f"http://127.0.0.1:{port}",
        is_ready=lambda: http_ok(f"http://127.0.0.1:{port}/readyz"),
        ready_timeout_s=90,
        env=env,
    )
    stack.parts.append(part)
    return stack.start_part(name)


def rss(part: Part) -> int:
    assert part.process is not None
    for line in Path(f"/proc/{part.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def hold(proxy: Part, upstream: str, body: bytes, count: int) -> tuple[int, int, list[int]]:
    """Send ``count`` bodies at once; the proxy's RSS once the accepted ones are all held
    upstream (or answered), how many the upstream held at most, and every status."""
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> int:
            url = proxy.address + "/v1/chat/completions"
            async with session.post(url, data=body, headers=headers) as answer:
                await answer.read()
                return answer.status

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        deadline = time.monotonic() + 120
        peak = most = 0
        while time.monotonic() < deadline:
            async with session.get(upstream + "/held") as answer:
                held = (await answer.json())["held"]
            most = max(most, held)
            refused = sum(1 for t in tasks if t.done())
            peak = max(peak, rss(proxy))
            if held + refused >= count:
                break
            await asyncio.sleep(0.2)
        for _ in range(5):  # settle: the last ones' bytes may still be arriving
            peak = max(peak, rss(proxy))
            await asyncio.sleep(0.2)
        async with session.post(upstream + "/release") as answer:
            await answer.read()
        statuses = await asyncio.gather(*tasks)
    return peak, most, list(statuses)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", type=int, default=16)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--serve-upstream", type=int, default=0)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    bodies = shapes()
    with tempfile.TemporaryDirectory() as folder:
        stack = Stack([], Path(folder))
        try:
            kafka, redis_url = f"127.0.0.1:{free_port()}", f"redis://127.0.0.1:{free_port()}/0"
            stack.parts += [kafka_part(kafka), redis_part(redis_url, Path(folder))]
            up_port = free_port()
            upstream = f"http://127.0.0.1:{up_port}"
            stack.parts.append(
                Part(
                    name="holding-upstream",
                    command=[sys.executable, __file__, "--serve-upstream", str(up_port)],
                    address=upstream,
                    is_ready=lambda: http_ok(upstream + "/health"),
                    ready_timeout_s=60,
                )
            )
            stack.start()
            print(
                f"{'shape':26} {'body MiB':>9} {'RSS/held MiB':>13} {'charge MiB':>11} {'ratio':>6}"
            )
            for index, (name, body) in enumerate(bodies.items()):
                proxy = start_proxy(stack, f"proxy-{index}", upstream, kafka, redis_url, False)
                idle = rss(proxy)
                peak, most, statuses = asyncio.run(hold(proxy, upstream, body, args.held))
                if statuses.count(200) != args.held:  # the upstream too slow to connect: 503
                    print(f"  ({name}: {statuses.count(200)} answered, {most} held at once)")
                each = (peak - idle) / most
                charge = parse_charge(len(body), MAX_ITEMS)
                print(
                    f"{name:26} {len(body) / 2**20:9.2f} {each / 2**20:13.1f} "
                    f"{charge / 2**20:11.1f} {each / charge:6.2f}"
                )
                stack.stop_parts([proxy])
            proxy = start_proxy(stack, "proxy-bounded", upstream, kafka, redis_url, True)
            idle = rss(proxy)
            flood = bodies["4 MiB string"]
            peak, _, statuses = asyncio.run(hold(proxy, upstream, flood, args.flood))
            taken = statuses.count(200)
            print(
                f"default bounds, {args.flood} bodies of 4 MiB at once from one key: {taken} "
                "taken, "
                f"{statuses.count(413)} refused 413, {statuses.count(429)} refused 429; "
                f"idle RSS {idle / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB "
                f"(+{(peak - idle) / 2**20:.0f} MiB; max_parse_bytes "
                f"{DEFAULT_PARSE_BYTES / 2**20:.0f} MiB)"
            )
        finally:
            stack.stop()


if __name__ == "__main__":
    main()

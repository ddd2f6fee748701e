"""What the mid-stream stall check (proxy/stall.py's GapWatch) costs a streamed chunk, in process.

The proxy's client (proxy/upstream.py over proxy/http1.py) reads ``--streams`` streams at a time
of ``--events`` events each from a stand-in vLLM in a process of its own, which sends each event
as its own write ``--event-gap-ms`` apart, as tokens come: the reader waits for each, which is
where a timer per chunk would have cost. Rounds of each mode in turn (A B C C B A ...):

- ``off``: no gap deadline (``proxy.upstream_stream_gap_timeout_s: null``), the path as before;
- ``on``: the default deadline (30 s: a sweep every 7.5 s, so none within a round);
- ``sweeping``: a deadline of ``--sweep-gap-s`` (a sweep every quarter of it), to bound what
  the sweeps themselves cost with every stream followed.

Reported per mode: the client process's CPU per chunk (``time.process_time``, less exposed to a
loaded host than wall time) and wall time per chunk, median over its rounds. Then what the watch
adds apart from the chunks: following and unfollowing an answer (per request), and a sweep per
answer in flight (1,000 followed, half of them waiting). Run it against
another checkout too (``PYTHONPATH=<checkout>``: its proxy code; there only ``off`` runs if it
has no gap deadline)::

    .venv/bin/python bench/stream_gap_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'  # noqa: E501


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(port: int, events: int, gap_s: float) -> None:
    """The stand-in vLLM: a stream of ``events`` events ``gap_s`` apart per POST (one for the
    probe), /health answered."""

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                writer.write(HEAD)
                for _ in range(1 if b'"max_tokens":1' in body else events):
                    writer.write(chunk(EVENT))
                    await writer.drain()
                    await asyncio.sleep(gap_s)
                writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(one, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


async def one_round(url: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    from proxy.upstream import FaultPolicy, Upstream

    gaps = {"off": None, "on": 30.0, "sweeping": args.sweep_gap_s}
    faults: dict[str, Any] = {"first_byte_timeout_s": 60.0}
    if "stream_gap_timeout_s" in {f.name for f in dataclasses.fields(FaultPolicy)}:
        faults["stream_gap_timeout_s"] = gaps[mode]
    upstream = Upstream([url], 2.0, 120.0, faults=FaultPolicy(**faults))
    upstream.endpoints[url].healthy = True
    watch = getattr(upstream, "gap_watch", None)
    sweeping = asyncio.create_task(watch.run()) if watch is not None else None
    chunks = stalls = 0

    async def read_one() -> None:
        nonlocal chunks, stalls
        response = await upstream.post("chat.completions", b'{"stream":true}', key="m")
        try:
            async for _ in response.iter_any():
                chunks += 1
        except Exception:  # a stall found (at a short deadline on a loaded host, it can be)
            stalls += 1
        response.release()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(read_one() for _ in range(args.streams)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if sweeping is not None:
        sweeping.cancel()
    probes = watch.probes if watch is not None else 0
    await upstream.close()
    return {"cpu_us": cpu / chunks * 1e6, "wall_us": wall / chunks * 1e6, "chunks": chunks,
            "probes": probes, "stalls": stalls}  # fmt: skip


async def watch_costs(followed: int = 1000, repeats: int = 200) -> dict[str, float]:
    """ns per follow + unfollow, and per followed answer per sweep."""
    from proxy.http1 import UpstreamResponse
    from proxy.stall import GapWatch

    async def probe(_url: str, _key: str) -> bool:
        return True

    loop = asyncio.get_running_loop()
    watch = GapWatch(30.0, probe)
    answers = [UpstreamResponse(None, 0.0) for _ in range(followed)]  # type: ignore[arg-type]
    for i, answer in enumerate(answers):
        if i % 2:
            answer._waiter = loop.create_future()  # its reader waits for bytes
    started = time.perf_counter()
    for _ in range(repeats):
        for answer in answers:
            watch.follow(answer, "http://r", "m")
        for answer in answers:
            watch.unfollow(answer)
    follow_ns = (time.perf_counter() - started) / repeats / followed * 1e9
    for answer in answers:
        watch.follow(answer, "http://r", "m")
    started = time.perf_counter()
    for _ in range(repeats):
        watch.sweep()
    sweep_ns = (time.perf_counter() - started) / repeats / followed * 1e9
    return {"follow_unfollow_ns": follow_ns, "sweep_ns_per_answer": sweep_ns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--event-gap-ms", type=float, default=2.0)
    parser.add_argument("--sweep-gap-s", type=float, default=0.04)
    parser.add_argument("--rounds", type=int, default=6, help="per mode")
    parser.add_argument("--modes", default="off,on,sweeping")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.events, args.event_gap_ms / 1000))
        return 0
    sys.path.insert(0, str(HERE.parents[1]))
    from embedded.processes import free_port
    from proxy.upstream import FaultPolicy

    modes = args.modes.split(",")
    if "stream_gap_timeout_s" not in {f.name for f in dataclasses.fields(FaultPolicy)}:
        modes = ["off"]  # a checkout from before the gap deadline
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(HERE), "--serve", str(port), "--events", str(args.events),
         "--event-gap-ms", str(args.event_gap_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for i in range(args.rounds):
            for mode in modes if i % 2 == 0 else list(reversed(modes)):
                results[mode].append(asyncio.run(one_round(url, mode, args)))
    finally:
        server.terminate()
        server.wait()
    summary: dict[str, dict[str, Any]] = {
        mode: {
            "cpu_us_per_chunk": statistics.median(r["cpu_us"] for r in rounds),
            "wall_us_per_chunk": statistics.median(r["wall_us"] for r in rounds),
            "cpu_us_rounds": [round(r["cpu_us"], 2) for r in rounds],
            "chunks_per_round": rounds[0]["chunks"],
            "probes": sum(r["probes"] for r in rounds),
            "stalls": sum(r["stalls"] for r in rounds),
        }
        for mode, rounds in results.items()
    }
    for mode, row in summary.items():
        print(
            f"{mode:9s} cpu {row['cpu_us_per_chunk']:6.2f} us/chunk  wall "
            f"{row['wall_us_per_chunk']:6.2f} us/chunk  rounds {row['cpu_us_rounds']}  "
            f"probes {row['probes']}  stalls {row['stalls']}"
        )
    if "sweeping" in modes:
        costs = asyncio.run(watch_costs())
        summary["watch"] = costs
        print(
            f"follow + unfollow {costs['follow_unfollow_ns']:.0f} ns a request; a sweep "
            f"{costs['sweep_ns_per_answer']:.0f} ns per answer in flight"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "summary": summary}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

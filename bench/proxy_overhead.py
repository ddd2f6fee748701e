"""How much latency does the Ratchet proxy add, with traffic logging on?

Run it from the repository root::

    .venv/bin/python bench/proxy_overhead.py [--requests 3000] [--concurrency 1,8,32]
        [--modes json,responses] [--baseline-code /tmp/before]

Method
------
One run starts everything it measures, on free 127.0.0.1 ports, and stops it all again:

* a *fast upstream* (``bench/fast_upstream.py``, in its own process): canned OpenAI-shaped
  answers that cost a few microseconds a request, so what the proxy path adds over the direct
  path is the proxy's own cost;
* its own Tansu broker and Redis, so the proxy runs with logging on exactly as in production;
* one proxy per upstream, started the production way (``proxy.server.serve``: uvicorn, uvloop,
  httptools) with a config holding one alias, ``bench``, whose base model is the upstream's model
  name. The fast upstream always; the vLLM at ``--vllm-url`` too when it answers.

For every upstream, mode (JSON answer or SSE stream) and concurrency, the same requests go to the
upstream directly (``model`` = the served name) and through the proxy (``model`` = ``bench``)
from one aiohttp client with keep-alive connections. Both paths are warmed up first, then
measured in alternating blocks in A-B-B-A order (direct, proxy, proxy, direct, ...), so slow
drift of the machine (other load, CPU clocks) lands on both paths alike. ``concurrency`` workers
each send their next request as soon as the previous one is answered (a closed loop).

Modes ``responses`` and ``responses-stream`` send the same conversations through the proxy as
Responses API requests (``POST /v1/responses``, not stored), which it translates to the chat
request the direct path sends: their added latency against the chat modes' is what the
translation costs; ``responses-stored`` sends them with ``store: true`` (OpenAI's default), so
each answer is also saved in Redis under the key's quota. Modes ``messages`` and
``messages-stream`` do the same with Anthropic Messages API requests (``POST /v1/messages``, the
stream as Anthropic's events).

Before and after, in one run: ``--baseline-code`` starts a second proxy from another checkout
(``git worktree add /tmp/before <commit>``; the same venv, its Redis state in a database of its
own) on the same upstream, broker and Redis, and every block rotates over the three paths
(direct, this proxy, the baseline's; forward then backward), so both proxies see the same
machine. Reported besides: this proxy's p50 over the baseline's, overall and per round.

Per request latency is measured in the client, from send to the last byte of the answer.
Reported: p50 and p99 per path, the added latency (proxy minus direct, in ms, per percentile),
and the throughput ratio (requests per second through the proxy over direct; wall clock of the
blocks). Everything runs on one machine, so at high concurrency the proxy also competes with the
client and the upstream for the same cores: the c=1 numbers are the proxy's latency cost, the
c=32 numbers its cost when the machine is saturated.

After the run the proxy's ``/metrics`` must count records sent to Kafka
(``ratchet_proxy_log_records_total{outcome="sent"}`` > 0): logging really was on. Results go
to ``--out`` as JSON, and as a PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead_report import (
    Result,
    check_targets,
    console,
    print_table,
    write_json,
    write_plot,
)
from bench.overhead_workload import (
    MODES,
    Block,
    make_bodies,
    rotation,
    route_of,
    run_block,
    summarise,
)
from embedded.processes import Part, Stack, free_port
from embedded.stack import kafka_part, redis_part

REPO = Path(__file__).resolve().parent.parent
FAST_MODEL = "bench-echo-model"
VLLM_MODEL = "smollm2-135m-instruct"
ALIAS = "bench"
# ---- processes ------------------------------------------------------------------------------


def start(stack: Stack, part: Part) -> Part:
    """Add a part to the run's stack and wait until it is healthy (the stack stops it later)."""
    stack.parts.append(part)
    return stack.start_part(part.name)


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """A tiny blocking GET, used outside the event loop for readiness and metrics."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


# --rate-limit: every limit on, so each request is checked and charged, and none is ever hit.
RATE_LIMITS = (
    "  rate_limit:\n"
    "    requests_per_minute: 1000000\n"
    "    tokens_per_minute: 10000000000\n"
    "    tokens_per_day: 1000000000000\n"
)


def write_proxy_config(path: Path, base_model: str, rate_limit: bool = False) -> Path:
    # The default config's redaction pattern, so record building costs what it does in production.
    path.write_text(
        "proxy:\n"
        "  redact_patterns:\n"
        "    - '[\\p{L}\\p{N}_.+-]+@[\\p{L}\\p{N}_-]+\\.[\\p{L}\\p{N}_.]+'\n"
        + (RATE_LIMITS if rate_limit else "")
        + f"aliases:\n  {ALIAS}:\n    base_model: {base_model}\n    log_rate: 1.0\n"
    )
    return path


def proxy_env(
    upstream_url: str, kafka: str, redis_url: str, home: Path, port: int, code: Path = REPO
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_KAFKA_BOOTSTRAP_SERVERS=kafka,
        RATCHET_REDIS_URL=redis_url,
        RATCHET_VLLM_URL=upstream_url,
        RATCHET_HOME=str(home),
        RATCHET_PROXY__PORT=str(port),
        RATCHET_CONFIG=str(home / "ratchet.yaml"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")])),
    )
    return env


def proxy_command(profile_to: Path | None) -> list[str]:
    """The production entry point, ``proxy.server.serve``; optionally under cProfile. ``-P``:
    the checkout comes from ``PYTHONPATH`` alone, not from the bench's working directory."""
    run = "from ratchet.settings import load_settings; from proxy.server import serve; "
    if profile_to is None:
        return [sys.executable, "-P", "-c", run + "serve(load_settings())"]
    code = run + f"import cProfile; cProfile.run('serve(load_settings())', {str(profile_to)!r})"
    return [sys.executable, "-P", "-c", code]


def start_proxy(
    stack: Stack,
    name: str,
    upstream_url: str,
    base_model: str,
    kafka: str,
    redis_url: str,
    profile_to: Path | None,
    rate_limit: bool = False,
    code: Path = REPO,
) -> str:
    """Start one proxy for one upstream, from the checkout at ``code``; wait until it reaches
    the upstream and Kafka."""
    home = stack.state_dir / name
    home.mkdir()
    write_proxy_config(home / "ratchet.yaml", base_model, rate_limit)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        status, body = http_get(url + "/readyz")
        return status == 200 and json.loads(body).get("kafka") is True

    proxy = Part(
        name=name,
        command=proxy_command(profile_to),
        address=url,
        is_ready=ready,  # readyz with Kafka up
        ready_timeout_s=90,
        env=proxy_env(upstream_url, kafka, redis_url, home, port, code),
        # uvicorn re-raises the signal it caught after its graceful shutdown, and only
        # KeyboardInterrupt lets cProfile (--profile) write its file.
        stop_signal=signal.SIGINT,
    )
    start(stack, proxy)
    return url


@dataclass
class Plan:
    upstream: str
    mode: str  # "json" or "stream"
    concurrency: int
    requests: int  # per path
    block_size: int
    warmup: int  # per path
    max_tokens: int


async def measure(
    session: aiohttp.ClientSession, plan: Plan, target: Target, served: str
) -> Result:
    """One plan: the same conversations direct, through the proxy and, with a baseline,
    through the baseline's proxy, in rotating blocks; each path warmed up first."""
    paths = ("direct", "proxy") + (("baseline",) if target.baseline_url else ())
    chat = "stream" if plan.mode.endswith("stream") else "json"  # what the direct path sends
    bodies = {
        path: make_bodies(
            served if path == "direct" else ALIAS,
            plan.block_size,
            plan.max_tokens,
            chat if path == "direct" else plan.mode,
        )
        for path in paths
    }
    urls = {
        "direct": target.direct_url + "/v1/chat/completions",
        "proxy": target.proxy_url + route_of(plan.mode),
        "baseline": f"{target.baseline_url}{route_of(plan.mode)}",
    }
    for path in paths:
        warm = (bodies[path] * (plan.warmup // plan.block_size + 1))[: plan.warmup]
        await run_block(session, urls[path], warm, plan.concurrency)
    blocks: dict[str, list[Block]] = {path: [] for path in paths}
    rounds = max(1, plan.requests // plan.block_size)
    for path in rotation(paths, rounds):
        blocks[path].append(await run_block(session, urls[path], bodies[path], plan.concurrency))
    direct, proxy = summarise(blocks["direct"]), summarise(blocks["proxy"])
    baseline = summarise(blocks["baseline"]) if "baseline" in blocks else None
    return Result(
        upstream=plan.upstream,
        mode=plan.mode,
        concurrency=plan.concurrency,
        direct=direct,
        proxy=proxy,
        added_p50_ms=proxy.p50_ms - direct.p50_ms,
        added_p99_ms=proxy.p99_ms - direct.p99_ms,
        throughput_ratio=proxy.rps / direct.rps,
        added_p50_by_round_ms=round_gaps(blocks["direct"], blocks["proxy"]),
        baseline=baseline,
        over_baseline_p50_ms=proxy.p50_ms - baseline.p50_ms if baseline else None,
        over_baseline_by_round_ms=(
            round_gaps(blocks["baseline"], blocks["proxy"]) if baseline else []
        ),
    )


def round_gaps(base: list[Block], other: list[Block]) -> list[float]:
    """Per round, the median of ``other``'s block minus the median of ``base``'s, in ms."""
    return [
        round((statistics.median(o.latencies_s) - statistics.median(b.latencies_s)) * 1000, 4)
        for b, o in zip(base, other, strict=True)
        if b.latencies_s and o.latencies_s
    ]


@dataclass(frozen=True)
class Target:
    """One upstream's paths: the upstream itself, this checkout's proxy in front of it and,
    with ``--baseline-code``, the other checkout's proxy in front of it too."""

    direct_url: str
    proxy_url: str
    served: str  # the upstream's model name
    baseline_url: str | None = None


async def run_plans(plans: list[Plan], targets: dict[str, Target]) -> list[Result]:
    """``targets`` maps an upstream name to its paths."""
    # SIGTERM stops the run as Ctrl-C does: cancel this task; main() then stops the services.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=300)
    results = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for plan in plans:
            target = targets[plan.upstream]
            label = f"{plan.upstream} {plan.mode} c={plan.concurrency}"
            with console.status(f"measuring {label} ({plan.requests} requests per path)"):
                result = await measure(session, plan, target, target.served)
            over = result.over_baseline_p50_ms
            console.print(
                f"  {label}: added p50 {result.added_p50_ms:+.3f} ms, "
                f"p99 {result.added_p99_ms:+.3f} ms"
                + ("" if over is None else f"; p50 over the baseline proxy {over:+.3f} ms")
            )
            results.append(result)
    return results


LOG_METRICS = (
    'ratchet_proxy_log_records_total{outcome="sent"}',
    'ratchet_proxy_log_records_total{outcome="dropped"}',
    'ratchet_proxy_log_records_total{outcome="spooled"}',
    "ratchet_proxy_log_queue_depth",
    # --rate-limit: requests served unchecked because Redis did not answer in time (must be 0).
    'ratchet_proxy_ratelimit_unavailable_total{call="admit"}',
)
SENT = LOG_METRICS[0]
UNCHECKED = LOG_METRICS[-1]


def log_metrics(proxy_url: str) -> dict[str, float]:
    _, body = http_get(proxy_url + "/metrics")
    found = {}
    for name in LOG_METRICS:
        match = re.search(rf"^{re.escape(name)} (\S+)$", body.decode(), re.MULTILINE)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def drained_log_metrics(proxy_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Wait for the proxy's log queue to empty, then read the producer's counters."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = log_metrics(proxy_url)
        if found["ratchet_proxy_log_queue_depth"] == 0 or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_metadata(args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # called before the measurements
        "git_commit": commit or None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "args": vars(args),
    }


# ---- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8401")
    parser.add_argument("--require-vllm", action="store_true", help="fail instead of skipping vLLM")
    parser.add_argument(
        "--requests", type=int, default=3000, help="per path and concurrency (fast upstream)"
    )
    parser.add_argument(
        "--vllm-requests", type=int, default=48, help="per path and concurrency (vLLM)"
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated list")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"of {', '.join(MODES)} (all but the first two: the Responses or the Messages API "
        "through the proxy against chat direct, fast upstream only; responses-stored with "
        "store: true)",
    )
    parser.add_argument("--vllm-max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the proxies under cProfile; writes proxy-<upstream>.prof to --out",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the c=1 targets are not met"
    )
    parser.add_argument(
        "--rate-limit",
        action="store_true",
        help="turn proxy.rate_limit on (limits no request reaches) to measure what it costs",
    )
    parser.add_argument(
        "--baseline-code",
        type=Path,
        help="another checkout (git worktree add /tmp/before <commit>) whose proxy is measured "
        "in the same run, on the same upstream, in turn with this one's: the before/after gap",
    )
    return parser.parse_args()


def make_plans(args: argparse.Namespace, with_vllm: bool) -> list[Plan]:
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    plans = []
    for mode in modes:
        for c in concurrencies:
            block = max(250, 4 * c)
            plans.append(
                Plan("fast", mode, c, args.requests, block, warmup=max(200, 10 * c), max_tokens=8)
            )
    if with_vllm:
        for mode in modes:
            if mode.startswith(("responses", "messages")):
                continue  # its bodies cannot ask vLLM for exact lengths (no ignore_eos)
            for c in concurrencies:
                n = max(args.vllm_requests, 4 * c)
                block = max(8, 2 * c)
                plans.append(Plan("vllm", mode, c, n, block, c, args.vllm_max_tokens))
    return plans


def vllm_reachable(url: str) -> bool:
    status, _ = http_get(url.rstrip("/") + "/health", timeout_s=3)
    return status == 200


def start_stack(
    stack: Stack,
    with_vllm: bool,
    vllm_url: str,
    profile_dir: Path | None,
    rate_limit: bool = False,
    baseline_code: Path | None = None,
) -> dict[str, Target]:
    """Broker, Redis, fast upstream and one proxy per upstream (two with ``baseline_code``: the
    baseline's keeps its Redis state in a database of its own); return the targets."""
    kafka_port, redis_port, fast_port = free_port(), free_port(), free_port()
    start(stack, kafka_part(f"127.0.0.1:{kafka_port}"))
    start(stack, redis_part(f"redis://127.0.0.1:{redis_port}/0", stack.state_dir))
    fast_url = f"http://127.0.0.1:{fast_port}"
    fast = Part(
        name="fast-upstream",
        command=[sys.executable, str(REPO / "bench" / "fast_upstream.py"), str(fast_port)],
        address=fast_url,
        is_ready=lambda: http_get(fast_url + "/health")[0] == 200,
        ready_timeout_s=60,
    )
    start(stack, fast)

    kafka, redis_url = f"127.0.0.1:{kafka_port}", f"redis://127.0.0.1:{redis_port}/0"
    upstreams = {"fast": (fast_url, FAST_MODEL)}
    if with_vllm:
        upstreams["vllm"] = (vllm_url.rstrip("/"), VLLM_MODEL)
    targets = {}
    for name, (url, model) in upstreams.items():
        prof = profile_dir / f"proxy-{name}.prof" if profile_dir else None
        proxy_url = start_proxy(
            stack, f"proxy-{name}", url, model, kafka, redis_url, prof, rate_limit
        )
        console.print(f"proxy for {name} upstream ({url}) at {proxy_url}, logging to {kafka}")
        baseline_url = None
        if baseline_code is not None:
            baseline_redis = f"redis://127.0.0.1:{redis_port}/1"
            baseline_url = start_proxy(
                stack,
                f"baseline-{name}",
                url,
                model,
                kafka,
                baseline_redis,
                None,
                rate_limit,
                baseline_code,
            )
            console.print(f"baseline proxy ({baseline_code}) for {name} at {baseline_url}")
        targets[name] = Target(url, proxy_url, model, baseline_url)
    return targets


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    with_vllm = vllm_reachable(args.vllm_url)
    if not with_vllm:
        message = f"vLLM at {args.vllm_url} is not reachable (GET /health failed)"
        if args.require_vllm:
            console.print(f"[red]{message}; --require-vllm was given")
            return 2
        console.print(f"[yellow]{message}: skipping the vLLM part, measuring the fast upstream")
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM stops the run like Ctrl-C does, so the finally below always cleans up (inside the
    # event loop, run_plans installs its own handler).
    signal.signal(signal.SIGTERM, _interrupt)

    meta = run_metadata(args)
    workdir = Path(tempfile.mkdtemp(prefix="ratchet-bench-"))
    stack = Stack([], workdir)
    try:
        profile_dir = args.out.resolve() if args.profile else None
        targets = start_stack(
            stack, with_vllm, args.vllm_url, profile_dir, args.rate_limit, args.baseline_code
        )
        plans = make_plans(args, with_vllm)
        results = uvloop.run(run_plans(plans, targets))
        stack.check()
        print_table(results)
        met = check_targets(results)
        logging = {name: drained_log_metrics(t.proxy_url) for name, t in targets.items()}
        for name, found in logging.items():
            sent = found[SENT]
            verdict = "[green]logging was on" if sent > 0 else "[red]NOTHING WAS LOGGED"
            if args.rate_limit and found[UNCHECKED] > 0:
                verdict += f" [red]({found[UNCHECKED]:g} requests not rate-limit checked)"
            details = ", ".join(
                f"{k.removeprefix('ratchet_proxy_')}={v:g}" for k, v in found.items()
            )
            console.print(f"proxy-{name} /metrics: {details} -> {verdict}")
        meta.update(log_metrics=logging, targets_met=met)
        console.print(f"results: {write_json(args.out, results, meta)}")
        plot = write_plot(args.out, results)
        if plot:
            console.print(f"plot: {plot}")
        if any(found[SENT] <= 0 for found in logging.values()):
            return 1
        return 1 if args.check and not met else 0
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("[yellow]interrupted; stopping everything this run started")
        return 130
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Does Redis stay flat under a flood of huge prompts? Redis ``used_memory`` over time.

Run it from the repository root (10 minutes, as docs/results/benchmarks.md's figure)::

    .venv/bin/python bench/redis_footprint.py [--minutes 10] [--ttl 3600] [--rated 0.1]

Two shorter scenarios (bench/redis_scenarios.py, a minute each) answer what one exchange leaves
in Redis on the default config, by key family, and whether the Responses store stays within its
quota under its largest allowed requests::

    .venv/bin/python bench/redis_footprint.py --scenario exchanges [--exchanges 20000]
    .venv/bin/python bench/redis_footprint.py --scenario responses [--store-mib 256]

What follows is the default scenario, ``flood``.

Method
------
One run starts its own Redis and Tansu broker on free 127.0.0.1 ports and drives the two
writers that Redis sees per exchange, with the project's own code:

* the proxy's side: each answer's owner note (``proxy/completions.py`` ``CompletionOwners``,
  kept ``owner_ttl_s``), and for a rated answer the rating's claim (``claim_rating``);
* the learner's side: the ratings collector (``learner/reward_training.py``
  ``RatingsCollector``, in its thread) reading ``ratchet.traffic`` and ``ratchet.feedback`` from
  the broker, keeping a join note per answer, reading a rated answer's record back from Kafka,
  and appending the joined rating to the alias's bounded ratings list.

Every exchange is a ``TrafficRecord`` whose prompt is 900 KiB (``--prompt-kib``; text that
gzip shrinks, so the in-memory broker holds the run), from one of 50 clients; ``--rated`` of
them get a ``FeedbackRecord``. The alias learns from ratings (``reward.kind: feedback``, never
due to retrain) with ``feedback.join_ttl_s`` = ``--ttl`` (at least 60, the setting's floor), so
the owner notes (which take the longest join TTL) expire with the join notes.

Rate: the highest this machine sustains. For ``PROBE_S`` the producer sends as fast as the
collector keeps up (it waits whenever more than ``LAG_LIMIT`` exchanges are unread), so that rate
is what the whole path (encode, broker, decode, join) sustains, not what the producer could push;
then it holds ``PACE`` (90%) of it, steadily, for the rest of the run.

Every second Redis's ``INFO memory`` ``used_memory`` and ``DBSIZE`` are sampled. Reported: the
rate; ``used_memory`` at the start, at the first TTL, and its min, max and slope after the first
TTL plus a settling margin (the ratings list fills to its own byte bound, ``--ratings-mib``, in
that window too); and Redis bytes per live exchange. Results go to ``--out`` as JSON, and a PNG
of used_memory over time beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import redis_scenarios
from embedded.processes import Stack, free_port
from embedded.stack import kafka_part, redis_part
from learner.leases import AliasLeases
from learner.metrics import LearnerMetrics
from learner.ratings import ratings_bookkeeping_keys, ratings_key
from learner.reward_training import RatingsCollector, RewardTrainer
from proxy.completions import CompletionOwners, owner_ttl_s
from ratchet.bus import ensure_topics
from ratchet.lease import LeaseKeeper
from ratchet.records import (
    DEADLETTER_TOPIC,
    FEEDBACK_TOPIC,
    TRAFFIC_TOPIC,
    FeedbackRecord,
    TrafficRecord,
)
from ratchet.secrets import redis_connection_url
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.store import AdapterStore

ALIAS = "bench"
CLIENTS = 50
LAG_LIMIT = 64  # exchanges the producer may be ahead of the collector
SETTLE_S = 25.0  # after the first TTL, for the keys of the faster probe to be expired
PROBE_S = 20.0  # at full speed first, to find the rate this machine sustains ...
PACE = 0.9  # ... then this much of it, steadily: a rate that wanders with the machine's other
# load would make the number of live keys (and so used_memory) wander with it
console = Console()


def settings_for(home: Path, redis_url: str, bootstrap: str, args: argparse.Namespace) -> Any:
    feedback = {
        "join_ttl_s": args.ttl,
        "retrain_every": 10**9,  # the bench measures Redis, not reward-model training
        "max_ratings_bytes": args.ratings_mib * 1024 * 1024,
    }
    alias = AliasConfig(reward={"kind": "feedback"}, feedback=feedback)
    return RatchetSettings(
        home=home,
        redis_url=redis_url,
        kafka_bootstrap_servers=bootstrap,
        secret="redis-footprint-bench",
        aliases={ALIAS: alias},
    )


def prompt(i: int, kib: int) -> str:
    head = f"Request {i}: summarise the following. "
    filler = "The quick brown fox jumps over the lazy dog. "
    return (head + filler * (kib * 1024 // len(filler) + 1))[: kib * 1024]


def traffic(i: int, cid: str, key: str, kib: int) -> TrafficRecord:
    return TrafficRecord(
        request_id=uuid.uuid4().hex,
        endpoint="chat.completions",
        alias=ALIAS,
        request_model=ALIAS,
        response_model=f"{ALIAS}@v1",
        version=1,
        canary_arm="active",
        request={"messages": [{"role": "user", "content": prompt(i, kib)}], "max_tokens": 1},
        response_id=cid,
        choices=[{"index": 0, "message": {"role": "assistant", "content": "Sure."}}],
        status=200,
        latency_ms=5.0,
        api_key_hash=key,
    )


class OwnerNotes:
    """The proxy's CompletionOwners on its own event loop, fed from the producer's thread."""

    def __init__(self, settings: RatchetSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.owners = self.call(self._make(settings))

    async def _make(self, settings: RatchetSettings) -> CompletionOwners:
        return CompletionOwners(
            redis_connection_url(settings), CollectorRegistry(), owner_ttl_s(settings)
        )

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def remember(self, cid: str, key: str) -> None:
        answer = json.dumps({"id": cid}).encode()
        self.loop.call_soon_threadsafe(self.owners.remember, answer, key)

    def close(self) -> None:
        self.call(self.owners.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


class Counting(RatingsCollector):
    """The collector, counting the exchanges it has read."""

    read = 0

    def take(self, messages: list[Any]) -> None:
        super().take(messages)
        self.read += sum(1 for m in messages if m.topic == TRAFFIC_TOPIC)


def start_collector(settings: RatchetSettings, client: redis.Redis, home: Path) -> Any:
    metrics = LearnerMetrics()
    leases = AliasLeases(client, 30.0, LeaseKeeper(), metrics, "reward_model")
    trainer = RewardTrainer(settings, client, AdapterStore(home / "store"), home / "no-model")
    stopping = threading.Event()
    collector = Counting(settings, client, trainer, leases, metrics, stopping)
    thread = threading.Thread(target=collector.run, name="ratings", daemon=True)
    thread.start()
    return collector, stopping, thread


def drive(
    settings: RatchetSettings, collector: Counting, args: argparse.Namespace, until: float
) -> tuple[int, float, float]:
    """Send exchanges (and some ratings) for ``PROBE_S`` as fast as the collector reads them,
    then steadily at :data:`PACE` of the rate that reached (``--rate``: that rate from the
    start); return how many were sent, the rate found and the rate held."""
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        compression_type="gzip",
        max_request_size=4 * 1024 * 1024,
        linger_ms=5,
    )
    owners = OwnerNotes(settings)
    sent = sent_before = 0
    rated_every = max(1, round(1 / args.rated)) if args.rated > 0 else 0
    started = time.monotonic()
    rate: float = args.rate
    found = args.rate
    try:
        while (now := time.monotonic()) < until:
            if not rate and now - started >= PROBE_S:
                found = sent / (now - started)
                rate = PACE * found
                console.print(f"sustained {found:.1f}/s; now {rate:.1f}/s")
                started, sent_before = now, sent
            if rate and sent - sent_before > rate * (now - started):
                time.sleep(0.002)
                continue
            if sent - collector.read > LAG_LIMIT:
                producer.flush()
                time.sleep(0.005)
                continue
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            key = f"hmac-sha256:{sent % CLIENTS:064x}"
            record = traffic(sent, cid, key, args.prompt_kib)
            producer.send(TRAFFIC_TOPIC, key=record.request_id.encode(), value=record.to_json())
            owners.remember(cid, key)
            if rated_every and sent % rated_every == 0:
                owners.call(owners.owners.claim_rating(cid, key))
                rating = FeedbackRecord(completion_id=cid, score=float(sent % 2), api_key_hash=key)
                producer.send(FEEDBACK_TOPIC, key=cid.encode(), value=rating.to_json())
            sent += 1
        producer.flush()
    finally:
        owners.close()
        producer.close()
    return sent, found, rate


class Sampler:
    """used_memory and DBSIZE every second, in its own thread."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.samples: list[tuple[float, int, int]] = []  # (seconds, used_memory, keys)
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            used = int(self.client.info("memory")["used_memory"])
            self.samples.append((time.monotonic() - self.started, used, self.client.dbsize()))
            self.stopping.wait(1.0)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def slope_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of bytes over seconds, in bytes per minute."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def summarise(
    samples: list[tuple[float, int, int]], rate: float, ttl: int, ratings_bytes: int
) -> Any:
    """The figures; per live exchange: what is above the start and the (full, bounded)
    ratings list, over the exchanges of one TTL."""
    baseline = samples[0][1]
    steady = [(t, m) for t, m, _ in samples if t >= ttl + SETTLE_S]
    at_ttl = min(samples, key=lambda s: abs(s[0] - ttl))
    result: dict[str, Any] = {
        "rate_per_s": round(rate, 2),
        "prompt_mib_per_s": None,
        "used_memory_start": baseline,
        "used_memory_at_ttl": at_ttl[1],
        "keys_at_ttl": at_ttl[2],
        "used_memory_end": samples[-1][1],
    }
    if len(steady) >= 5:
        values = [m for _, m in steady]
        result |= {
            "steady_window_s": round(steady[-1][0] - steady[0][0], 1),
            "steady_min": min(values),
            "steady_max": max(values),
            "steady_slope_bytes_per_min": round(slope_per_min(steady)),
            "bytes_per_live_exchange": round(
                (statistics.fmean(values) - baseline - ratings_bytes) / (rate * ttl)
            ),
        }
    return result


def plot(samples: list[tuple[float, int, int]], ttl: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot([s[0] for s in samples], [s[1] / 2**20 for s in samples], label="used_memory")
    axis.axvline(ttl, color="grey", linestyle="--", label=f"first TTL ({ttl} s)")
    axis.set_xlabel("seconds")
    axis.set_ylabel("Redis used_memory (MiB)")
    axis.set_ylim(bottom=0)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    table = Table(title=f"Redis footprint, {args.prompt_kib} KiB prompts, join TTL {args.ttl} s")
    table.add_column("figure")
    table.add_column("value", justify="right")
    mib = 2**20
    rows = [
        ("exchanges/s sustained (found)", f"{result['rate_found_per_s']:.1f}"),
        (f"exchanges/s held ({PACE:.0%})", f"{result['rate_per_s']:.1f}"),
        ("prompt MiB/s through Kafka", f"{result['prompt_mib_per_s']:.1f}"),
        ("used_memory at start", f"{result['used_memory_start'] / mib:.1f} MiB"),
        ("used_memory at first TTL", f"{result['used_memory_at_ttl'] / mib:.1f} MiB"),
        ("keys at first TTL", str(result["keys_at_ttl"])),
        ("keys without a TTL at the end", ", ".join(result["keys_without_ttl"]) or "none"),
        (
            "ratings kept (bytes, bound)",
            f"{result['ratings_kept']} ({result['ratings_bytes'] / mib:.1f} of "
            f"{args.ratings_mib} MiB)",
        ),
    ]
    if "steady_min" in result:
        rows += [
            (
                f"after TTL + {SETTLE_S:.0f} s: min .. max",
                f"{result['steady_min'] / mib:.1f} .. {result['steady_max'] / mib:.1f} MiB",
            ),
            ("  slope", f"{result['steady_slope_bytes_per_min'] / 1024:+.0f} KiB/min"),
            ("  bytes per live exchange (less ratings)", str(result["bytes_per_live_exchange"])),
        ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--ttl", type=int, default=60, help="feedback.join_ttl_s (>= 60)")
    parser.add_argument("--rate", type=float, default=0.0, help="exchanges/s (0: find it)")
    parser.add_argument("--prompt-kib", type=int, default=900)
    parser.add_argument("--rated", type=float, default=0.1, help="share of answers rated")
    parser.add_argument("--ratings-mib", type=int, default=8, help="feedback.max_ratings_bytes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scenario", choices=("flood", "exchanges", "responses"), default="flood")
    parser.add_argument("--exchanges", type=int, default=20_000, help="exchanges: how many")
    parser.add_argument("--prompt-chars", type=int, default=7000, help="exchanges: prompt size")
    parser.add_argument("--judged", type=float, default=0.0, help="exchanges: share judged")
    parser.add_argument("--canary", action="store_true", help="exchanges: while a canary runs")
    parser.add_argument("--keys", type=int, default=50, help="exchanges, responses: API keys")
    parser.add_argument(
        "--store-mib", type=int, default=0, help="responses: total quota (0: default)"
    )
    parser.add_argument("--input-chars", type=int, default=2000, help="responses: input size")
    parser.add_argument("--answer-chars", type=int, default=2000, help="responses: answer size")
    parser.add_argument("--max-responses", type=int, default=200_000, help="responses: at most")
    args = parser.parse_args()
    name = "footprint" if args.scenario == "flood" else args.scenario
    args.out = args.out or Path(f"bench/results/redis_{name}.json")
    if args.scenario != "flood":
        scenario(args)
        return
    with tempfile.TemporaryDirectory(prefix="ratchet-redis-footprint-") as tmp:
        home = Path(tmp)
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
        bootstrap = f"127.0.0.1:{free_port()}"
        stack = Stack([kafka_part(bootstrap), redis_part(redis_url, home)], home / "state")
        stack.start()
        try:
            settings = settings_for(home, redis_url, bootstrap, args)
            ensure_topics(
                bootstrap, settings.kafka, [TRAFFIC_TOPIC, FEEDBACK_TOPIC, DEADLETTER_TOPIC]
            )
            client = redis.Redis.from_url(redis_url)
            collector, stopping, thread = start_collector(settings, client, home)
            sampler = Sampler(client)
            started = time.monotonic()
            sent, found, held = drive(settings, collector, args, started + args.minutes * 60)
            seconds = time.monotonic() - started
            sampler.stop()
            stopping.set()
            thread.join(timeout=10)
            ratings_bytes = int(client.get(ratings_bookkeeping_keys(ALIAS)[2]) or 0)
            kept: dict[str, Any] = {
                "ratings_kept": client.llen(ratings_key(ALIAS)),
                "ratings_bytes": ratings_bytes,
                "keys_without_ttl": [
                    k.decode() for k in client.scan_iter(count=1000) if client.ttl(k) == -1
                ],
            }
        finally:
            stack.stop()
    result = summarise(sampler.samples, held, args.ttl, ratings_bytes)
    result |= {"exchanges": sent, "seconds": round(seconds, 1), "rate_found_per_s": found}
    result["prompt_mib_per_s"] = round(result["rate_per_s"] * args.prompt_kib / 1024, 2)
    result |= kept
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    report(result, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "samples": sampler.samples}, indent=1))
    plot(sampler.samples, args.ttl, args.out.with_suffix(".png"))
    console.print(f"results: {args.out} (and {args.out.with_suffix('.png')})")


def scenario(args: argparse.Namespace) -> None:
    """A short scenario of bench/redis_scenarios.py: its figures printed and written to --out."""
    with tempfile.TemporaryDirectory(prefix="ratchet-redis-footprint-") as tmp:
        result = redis_scenarios.run(args, Path(tmp))
    families = result.pop("families")
    table = Table(title=f"Redis, scenario {args.scenario}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in result.items():
        table.add_row(name, str(value))
    for name, family in families.items():
        table.add_row(f"{name}: keys, mean bytes", f"{family['keys']:.0f}, {family['mean_bytes']}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result |= {"families": families, "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"results: {args.out}")


if __name__ == "__main__":
    main()

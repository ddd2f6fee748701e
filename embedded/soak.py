"""A chaos soak of the embedded stack: clients send traffic while its parts are killed in turn.

Clients send chat completions through the proxy (streamed and not, each with the official
``openai`` client) and rate some answers; a schedule kills and restarts the parts one at a
time, at random moments; one ~5 MB answer and a few poison records go in along the way. A
reader follows ``ratchet.traffic``, ``ratchet.feedback`` and ``ratchet.deadletter`` the whole
time. At the end every exchange a client got a whole answer for (and every rating the proxy
accepted) is looked up among what the reader saw: delivered, late, duplicated or lost.

The embedded broker (Tansu) keeps its topics in memory only, so a broker that is killed takes
what it had acknowledged with it, which no client of it could prevent; its fault here is a
freeze (SIGSTOP, then SIGCONT): to the proxy it is a broker that stopped answering, the harder
case for a producer, with nothing it had accepted lost. Every other part is SIGKILLed.

``bench/soak.py`` runs it on a stack of its own and reports; tests/integration runs it short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import openai
import redis
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from embedded.processes import Stack, wait_until
from ratchet.records import (
    DEADLETTER_TOPIC,
    FEEDBACK_TOPIC,
    GROUPS_TOPIC,
    HELDOUT_TOPIC,
    TRAFFIC_TOPIC,
    DeadLetter,
    FeedbackRecord,
    TrafficRecord,
    decode,
)
from ratchet.secrets import redis_connection_url
from ratchet.settings import RatchetSettings
from tasks.demo import load_prompts

FAULTS = ("broker", "redis", "vllm", "log_worker", "judge", "learner")
POISONED_TOPICS = (TRAFFIC_TOPIC, GROUPS_TOPIC, HELDOUT_TOPIC, FEEDBACK_TOPIC)
POISON_MARK = "ratchet-soak-poison"
# After vLLM is back, answers already failing in flight may still arrive for this long.
VLLM_GRACE_S = 5.0
# A record that reaches the topic this long after its answer was delivered late.
LATE_AFTER_S = 10.0


@dataclass
class Fault:
    part: str
    started: float  # seconds since the soak began
    ended: float | None = None  # back and ready


@dataclass
class Exchange:
    client: int
    stream: bool
    started: float
    finished: float
    status: int  # 0: no HTTP status (connection failed)
    cause: str = ""  # why it failed; empty when answered
    request_id: str | None = None
    completion_id: str | None = None
    rated: bool = False  # a rating for it was accepted


@dataclass
class SoakReport:
    seconds: float
    sent: int
    answered: int
    failed: dict[str, int]  # "<status> <cause>" -> count
    failed_outside_vllm_faults: list[dict[str, Any]]
    records_expected: int
    delivered: int
    delivered_late: int
    duplicated: int
    lost: list[str]
    ratings_accepted: int
    ratings_lost: list[str]
    poison_sent: dict[str, int]
    poison_dead_lettered: dict[str, int]  # by source topic, from every consumer group
    huge_answer: dict[str, Any]
    faults: list[dict[str, Any]]
    ready_share: dict[str, float]
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.ratings_lost and not self.failed_outside_vllm_faults

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class Reader:
    """Follows the topics from their start on a thread: the first time each record was seen."""

    def __init__(self, bootstrap: str, started: float) -> None:
        self.bootstrap = bootstrap
        self.started = started
        self.traffic: dict[str, float] = {}
        self.traffic_copies: Counter[str] = Counter()
        self.feedback: set[str] = set()
        self.poison: Counter[str] = Counter()
        self._positions: dict[TopicPartition, int] = {}  # where to read on from after a freeze
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception:  # the broker froze under us: read again from where we were
                time.sleep(0.5)

    def _follow(self) -> None:
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            request_timeout_ms=30_000,
            max_partition_fetch_bytes=8 * 1024 * 1024,
        )
        try:
            partitions = [
                TopicPartition(topic, p)
                for topic in (TRAFFIC_TOPIC, FEEDBACK_TOPIC, DEADLETTER_TOPIC)
                for p in consumer.partitions_for_topic(topic) or ()
            ]
            consumer.assign(partitions)
            for tp in partitions:
                consumer.seek(tp, self._positions.get(tp, 0))
            while not self._stop.is_set():
                for tp, messages in consumer.poll(timeout_ms=500).items():
                    for message in messages:
                        self._see(message.topic, message.value)
                    self._positions[tp] = messages[-1].offset + 1
        finally:
            consumer.close()

    def _see(self, topic: str, value: bytes) -> None:
        record = decode(topic, value)
        now = time.monotonic() - self.started
        if isinstance(record, TrafficRecord):
            self.traffic.setdefault(record.request_id, now)
            self.traffic_copies[record.request_id] += 1
        elif isinstance(record, FeedbackRecord):
            self.feedback.add(record.completion_id)
        elif isinstance(record, DeadLetter) and POISON_MARK in record.value:
            self.poison[record.source_topic] += 1


class Chaos:
    """Kills (or, for the broker, freezes) one part at a time and brings it back."""

    def __init__(self, stacks: dict[str, Stack], proxy_pid: Callable[[], int | None]) -> None:
        self.stacks = stacks  # part name -> the Stack that runs it
        self.proxy_pid = proxy_pid
        self.faults: list[Fault] = []

    def inject(self, part: str, started: float, hold_s: float, clock: Callable[[], float]) -> None:
        fault = Fault(part, started)
        self.faults.append(fault)
        if part == "broker":
            pid = self._pid("kafka")
            os.killpg(pid, signal.SIGSTOP)
            time.sleep(hold_s)
            os.killpg(pid, signal.SIGCONT)
        elif part == "log_worker":
            self._kill_log_worker()
        else:
            name = {"redis": "redis", "vllm": "vllm", "judge": "judge", "learner": "learner"}[part]
            stack = self.stacks[name]
            process = stack.part(name).process
            assert process is not None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
            stack.part(name).process = None
            time.sleep(hold_s)
            stack.start_part(name)
        fault.ended = clock()

    def _pid(self, name: str) -> int:
        process = self.stacks[name].part(name).process
        assert process is not None
        return process.pid

    def _kill_log_worker(self) -> None:
        proxy = self.proxy_pid()
        assert proxy is not None
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")  # noqa: SIM115
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                if b"proxy.log.worker" in cmdline and parent == proxy:
                    os.kill(int(entry), signal.SIGKILL)
                    return
        raise RuntimeError("no log worker found under the proxy")


class Soak:
    """One soak: ``run()`` it, then read its :class:`SoakReport`."""

    def __init__(
        self,
        settings: RatchetSettings,
        stacks: dict[str, Stack],
        alias: str,
        seconds: float,
        clients: int = 4,
        fault_every_s: float = 60.0,
        hold_s: float = 10.0,
        seed: int = 0,
        faults: tuple[str, ...] = FAULTS,
        huge_answer: bool = True,
    ) -> None:
        self.settings = settings
        self.alias = alias
        self.seconds = seconds
        self.clients = clients
        self.fault_every_s = fault_every_s
        self.hold_s = hold_s
        self.random = random.Random(seed)
        self.fault_order = list(faults)
        self.huge_answer = huge_answer
        self.proxy_url = f"http://{settings.proxy.host}:{settings.proxy.port}"
        self.started = time.monotonic()
        self.chaos = Chaos(stacks, lambda: _pid_of(stacks["proxy"], "proxy"))
        self.reader = Reader(settings.kafka_bootstrap_servers, self.started)
        self.exchanges: list[Exchange] = []
        self.huge: dict[str, Any] = {}
        self.poison_sent: Counter[str] = Counter()
        self.readiness: dict[str, list[bool]] = {}
        self.prompts = load_prompts()

    def clock(self) -> float:
        return time.monotonic() - self.started

    # ---- the run -----------------------------------------------------------------------------
    def run(self, on_progress: Callable[[float], None] | None = None) -> SoakReport:
        self.started = time.monotonic()
        self.reader.started = self.started
        self.reader.start()
        stop = threading.Event()
        chaos = threading.Thread(target=self._chaos_loop, args=(stop,), name="soak-chaos")
        probes = threading.Thread(target=self._probe_loop, args=(stop,), name="soak-probes")
        chaos.start()
        probes.start()
        try:
            asyncio.run(self._traffic(on_progress))
        finally:
            stop.set()
            chaos.join()
            probes.join()
        self._settle()
        self.reader.stop()
        return self.report()

    def _chaos_loop(self, stop: threading.Event) -> None:
        """One fault per period at a random moment in it, the parts in turn; none in the last
        period, so the stack has time to recover before the count. Poison records go in with
        the first fault and again with the first of each later round of the parts."""
        self.random.shuffle(self.fault_order)
        period = 0
        while True:
            start = (period + self.random.uniform(0.1, 0.6)) * self.fault_every_s
            if start + self.fault_every_s > self.seconds:
                return
            while self.clock() < start:
                if stop.wait(0.2):
                    return
            part = self.fault_order[period % len(self.fault_order)]
            if period % len(self.fault_order) == 0:
                self._poison()
            self.chaos.inject(part, self.clock(), self.hold_s, self.clock)
            period += 1

    def _probe_loop(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            for name, ready in self._probe().items():
                self.readiness.setdefault(name, []).append(ready)

    def _probe(self) -> dict[str, bool]:
        s = self.settings

        def ok(url: str) -> bool:
            try:
                return httpx.get(url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        ready: dict[str, bool] = {}
        try:
            body = httpx.get(f"{self.proxy_url}/readyz", timeout=1.0).json()
            ready["proxy"], ready["kafka"] = bool(body["ready"]), bool(body["kafka"])
        except (httpx.HTTPError, ValueError, KeyError):
            ready["proxy"] = ready["kafka"] = False
        ready["vllm"] = ok(f"{s.vllm_url}/health")
        try:
            ready["redis"] = bool(
                redis.Redis.from_url(redis_connection_url(s), socket_timeout=1).ping()
            )
        except redis.RedisError:
            ready["redis"] = False
        ready["judge"] = ok(f"http://{s.judge.metrics_host}:{s.judge.metrics_port}/metrics")
        learner = s.learner
        ready["learner"] = ok(f"http://{learner.metrics_host}:{learner.metrics_port}/metrics")
        return ready

    async def _traffic(self, on_progress: Callable[[float], None] | None) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.proxy_url}/v1", api_key="soak", max_retries=0, timeout=120
        )
        try:
            tasks = [asyncio.create_task(self._client(client, i)) for i in range(self.clients)]
            if self.huge_answer:
                tasks.append(asyncio.create_task(self._huge_answer(client)))
            while self.clock() < self.seconds:
                if on_progress:
                    on_progress(self.clock())
                await asyncio.sleep(1.0)
            await asyncio.gather(*tasks)
        finally:
            await client.close()

    async def _client(self, client: openai.AsyncOpenAI, number: int) -> None:
        rng = random.Random(number)
        while self.clock() < self.seconds:
            prompt = rng.choice(self.prompts)
            stream = rng.random() < 0.5
            exchange = await self._exchange(client, number, prompt["messages"], stream)
            self.exchanges.append(exchange)
            if exchange.completion_id and rng.random() < 0.5:
                exchange.rated = await self._rate(client, exchange.completion_id, rng.random())
            if exchange.status != 200:
                await asyncio.sleep(0.5)  # as a client backs off

    async def _exchange(
        self,
        client: openai.AsyncOpenAI,
        number: int,
        messages: list[dict[str, Any]],
        stream: bool,
        **extra: Any,
    ) -> Exchange:
        started = self.clock()
        body: dict[str, Any] = {
            "model": self.alias,
            "messages": messages,
            "max_tokens": 8,
            "user": f"soak-{number}",
        } | extra
        try:
            if stream:
                async with client.chat.completions.with_streaming_response.create(
                    stream=True, stream_options={"include_usage": True}, **body
                ) as response:
                    request_id = response.headers.get("x-request-id")
                    completion_id = None
                    async for chunk in await response.parse():
                        completion_id = chunk.id
                return Exchange(
                    number, True, started, self.clock(), 200, "", request_id, completion_id
                )
            raw = await client.chat.completions.with_raw_response.create(**body)
            completion = raw.parse()
            return Exchange(
                number,
                False,
                started,
                self.clock(),
                200,
                "",
                raw.headers.get("x-request-id"),
                completion.id,
            )
        except openai.APIStatusError as exc:
            code = ""
            with contextlib.suppress(Exception):
                code = exc.response.json()["error"]["code"] or ""
            return Exchange(number, stream, started, self.clock(), exc.status_code, code)
        except (openai.APIError, httpx.HTTPError) as exc:
            # A stream vLLM's death cut short, or no connection: no whole answer either way.
            return Exchange(number, stream, started, self.clock(), 0, type(exc).__name__)

    async def _rate(self, client: openai.AsyncOpenAI, completion_id: str, score: float) -> bool:
        try:
            await client.post(
                "/feedback",
                body={"completion_id": completion_id, "score": round(score, 3)},
                cast_to=httpx.Response,
            )
            return True
        except (openai.APIError, httpx.HTTPError):
            return False

    async def _huge_answer(self, client: openai.AsyncOpenAI) -> None:
        """One answer of about 5 MB (16 x 256 tokens, 20 top logprobs each), a third of the way
        in: its record is stored cut, and nothing queues behind it."""
        while self.clock() < self.seconds / 3:
            await asyncio.sleep(0.5)
        messages = [{"role": "user", "content": "Write a long story about a lighthouse."}]
        attempt = 0
        while self.clock() < self.seconds:  # vLLM may die under it: ask again once it is back
            exchange = await self._exchange(
                client,
                -1,
                messages,
                False,
                n=16,
                max_tokens=256,
                logprobs=True,
                top_logprobs=20,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            self.exchanges.append(exchange)
            attempt += 1
            self.huge = {"attempt": attempt, **asdict(exchange)}
            if exchange.status == 200:
                return
            while self.clock() < self.seconds and not await self._vllm_ready():
                await asyncio.sleep(2)

    async def _vllm_ready(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(f"{self.settings.vllm_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    def _poison(self) -> None:
        producer = KafkaProducer(bootstrap_servers=self.settings.kafka_bootstrap_servers)
        try:
            for topic in POISONED_TOPICS:
                value = f"\x00{POISON_MARK} {topic} {{not json".encode()
                producer.send(topic, key=b"poison", value=value).get(10)
                self.poison_sent[topic] += 1
        finally:
            producer.close(5)

    def _settle(self) -> None:
        """Wait for the stack to deliver what it holds: every part ready, the reader caught up
        with every answer and rating, and the poison on the judge's and the learner's topics
        dead-lettered (a learner in a round reads nothing until it ends)."""
        expected = {e.request_id for e in self.exchanges if e.status == 200 and e.request_id}
        ratings = {e.completion_id for e in self.exchanges if e.rated and e.completion_id}
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: all(self._probe().values()), 300, "every part ready", 1.0)
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: expected <= self.reader.traffic.keys() and ratings <= self.reader.feedback,
                180,
                "every record read",
                1.0,
            )
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: all(
                    self.reader.poison[t] >= self.poison_sent[t]
                    for t in (TRAFFIC_TOPIC, GROUPS_TOPIC)
                ),
                300,
                "the poison dead-lettered",
                1.0,
            )

    # ---- the count ---------------------------------------------------------------------------
    def report(self) -> SoakReport:
        answered = [e for e in self.exchanges if e.status == 200]
        failed = [e for e in self.exchanges if e.status != 200]
        vllm_down = [
            (f.started, (f.ended or self.seconds) + VLLM_GRACE_S)
            for f in self.chaos.faults
            if f.part == "vllm"
        ]
        outside = [
            asdict(e)
            for e in failed
            if not any(start <= e.finished and e.started <= end for start, end in vllm_down)
        ]
        seen = self.reader.traffic
        expected = [e for e in answered if e.request_id]
        lost = [e.request_id for e in expected if e.request_id not in seen]
        late = [
            e
            for e in expected
            if e.request_id in seen and seen[e.request_id] - e.finished > LATE_AFTER_S
        ]
        ratings = [e.completion_id for e in answered if e.rated and e.completion_id]
        return SoakReport(
            seconds=round(self.clock(), 1),
            sent=len(self.exchanges),
            answered=len(answered),
            failed=dict(Counter(f"{e.status} {e.cause}".strip() for e in failed)),
            failed_outside_vllm_faults=outside,
            records_expected=len(expected),
            delivered=len(expected) - len(lost),
            delivered_late=len(late),
            duplicated=sum(1 for n in self.reader.traffic_copies.values() if n > 1),
            lost=[r for r in lost if r is not None],
            ratings_accepted=len(ratings),
            ratings_lost=[c for c in ratings if c not in self.reader.feedback],
            poison_sent=dict(self.poison_sent),
            poison_dead_lettered=dict(self.reader.poison),
            huge_answer=self.huge,
            faults=[asdict(f) for f in self.chaos.faults],
            ready_share={
                name: round(sum(samples) / len(samples), 3)
                for name, samples in self.readiness.items()
                if samples
            },
            timeline=[
                {"t": round(e.finished, 2), "status": e.status, "stream": e.stream}
                for e in self.exchanges
            ],
        )


def _pid_of(stack: Stack, name: str) -> int | None:
    process = stack.part(name).process
    return process.pid if process is not None else None

"""`ratchet judge`: turns the traffic log into scored groups and held-out prompts.

One batch at a time: poll traffic records and classify each (filter, dedupe, split) without
sampling anything; produce the batch's held-out prompts (and dead letters) at once and wait for
the broker's acks, so the gate's pool never waits on sampling; then sample and score the rest
concurrently, as far as the learner needs groups (judge/backpressure.py), and produce those. Each
delivery marks its traffic records judged in Redis, and the batch's offsets are committed only
once everything it produced is acknowledged. A judge killed mid-batch therefore re-reads the
batch on restart (at least once), and so does the replica that takes its partitions over; a
record already marked judged (``ratchet:judge:done:<request id>``) is skipped, so only one killed
between its broker's acks and that mark is judged twice. Each group's id is derived from its
traffic record and version, so the learner drops such a repeat too.

A group is sampled from the version the alias's next round trains: the live one, or the rejected
candidate the learner carries on from (ratchet/carry.py), so GRPO learns from its own answers.

What a client controls does not steer the split: the traffic record's id is the proxy's own (not
the client's ``x-request-id``), and which prompts are held out for the gate is a keyed hash under
the server secret, so a client cannot craft prompts that land there more often than
``learning.heldout_fraction``. Groups and held-out prompts carry the client's key hash, which the
learner uses to cap any one key's share (``learning.max_key_share``). Sampling is fair across
clients (a record's ``client``): a batch asks for groups least-served client first
(:func:`fair_order`), and backpressure counts only the groups a round could use.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import statistics
import time
from collections import Counter, deque
from typing import Any, NamedTuple

import aiohttp
import redis
import redis.asyncio as aioredis
from prometheus_client import start_http_server

from judge.agreement import AgreementProbe
from judge.backpressure import Backpressure
from judge.kafka_io import JudgeKafka
from judge.marks import JudgeMarks, Sampled, SeenMark, repeat_reason
from judge.metrics import JudgeMetrics
from judge.reward_setup import reward_models
from judge.routes import JudgeRoutes
from judge.sampler import (
    LENGTH_WINDOW,
    SamplingError,
    group_seed,
    prompt_of,
    sample_from,
    sampling_body,
    sampling_max_tokens,
)
from judge.scoring import GroupScorer, ScoringError
from ratchet.bill import Bill
from ratchet.fleet import Replicas
from ratchet.records import (
    TRAFFIC_TOPIC,
    DeadLetter,
    HeldoutPrompt,
    Record,
    ScoredGroup,
    SourceMessage,
    TrafficRecord,
    parse,
    prompt_hash,
)
from ratchet.registry import AliasRoute, served_name
from ratchet.secrets import keyed_hash, redis_connection_url, server_secret, vllm_api_key
from ratchet.settings import AliasConfig, RatchetSettings
from ratchet.spend import budget_line, spend_key, today

log = logging.getLogger(__name__)


def fraction_of(text: str) -> float:
    """A stable number in [0, 1) from a string: the same input always falls on the same side."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64


def is_heldout(secret: bytes, prompt_digest: str, fraction: float) -> bool:
    """Whether a prompt is kept for the gate: stable, and unpredictable without the secret."""
    return int(keyed_hash(secret, "heldout", prompt_digest)[:16], 16) / 2**64 < fraction


def group_id_of(request_id: str, version: int) -> str:
    return hashlib.sha256(f"{request_id}\0{version}".encode()).hexdigest()[:32]


class Ready(NamedTuple):
    """A held-out prompt or a dead letter: produced before the batch samples anything."""

    record: Record
    seen: SeenMark | None


class ToSample(NamedTuple):
    """An eligible, training-side traffic record: its group is sampled after the held-out ones
    are delivered."""

    message: SourceMessage
    record: TrafficRecord
    config: AliasConfig
    prompt: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    digest: str
    seen: SeenMark


class Skip(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class JudgeService(JudgeKafka):
    def __init__(self, settings: RatchetSettings) -> None:
        self.settings = settings
        self.secret = server_secret(settings)
        self.vllm_key = vllm_api_key(settings)  # for sampling, and the judge model when it is vLLM
        self.metrics = JudgeMetrics()
        self.redis = aioredis.Redis.from_url(
            redis_connection_url(settings), socket_timeout=2, socket_connect_timeout=1
        )
        self.marks = JudgeMarks(self.redis, settings.judge.done_ttl_s)
        self.scorer = GroupScorer(
            settings.judge,
            settings.vllm_url.rstrip("/") + "/v1",
            self.redis,
            self.metrics,
            self.vllm_key,
            reward_models(settings),
        )
        # vLLM's replicas, each group sampled from the one its version's requests go to.
        self.replicas = Replicas.from_settings(settings)
        self.replicas.on_ejected = lambda url: self.metrics.replica_ejections.labels(url).inc()
        # Routes, carries and exclusions (handed to the replicas), read together per group.
        self.routing = JudgeRoutes(settings, self.redis, self.metrics, self.replicas.exclusions)
        self.limit = asyncio.Semaphore(settings.judge.concurrency)
        self.backpressure = Backpressure(
            self.redis,
            settings.judge.max_pending_rounds * settings.learner.batch_groups,
            settings.judge.pause_while_training,
        )
        self.answer_lengths: dict[str, deque[int]] = {}
        self._budget_logged: dict[str, str] = {}  # alias -> the day its budget ran out (logged)
        self.stopping = asyncio.Event()
        self.agreement = AgreementProbe(
            settings,
            self.redis,
            self.scorer,
            self.metrics,
            self._route,
            self._lengths,
            self.limit,
            self.vllm_key,
            self.replicas,
        )

    # ---- one traffic record: classified first, sampled later ----------------------------------
    async def classify(self, message: SourceMessage) -> Ready | ToSample | None:
        """What a traffic record becomes, without sampling anything: a held-out prompt or a dead
        letter (``Ready``, produced before the batch samples), a group to sample (``ToSample``),
        or nothing (skipped, counted).

        Whatever goes wrong with one record stays with it: a value that is not a traffic record,
        or one this code fails on, is counted and dead-lettered, and the batch goes on (its
        offsets are committed with the rest, so it is never read again)."""
        record = parse(TRAFFIC_TOPIC, message.value)
        if isinstance(record, str):  # malformed, invalid or another schema; counted by parse
            if record == "unknown_schema":  # a newer producer's record: skipped, per contract
                return None
            self.metrics.failures.labels("-", record).inc()
            return Ready(self._dead_letter(message, record), None)
        if not isinstance(record, TrafficRecord):
            return None
        try:
            return await self._classify(record, message)
        except Skip as skip:
            self.metrics.skipped.labels(self._label(record.alias), skip.reason).inc()
        except Exception as exc:
            return Ready(self._handler_error(message, record.alias, exc), None)
        return None

    async def _classify(self, record: TrafficRecord, message: SourceMessage) -> Ready | ToSample:
        config = self.settings.aliases.get(record.alias)
        prompt, tools = self._eligible(record, config)
        assert config is not None
        if await self.marks.done(record.request_id):
            raise Skip("already_judged")  # by a judge killed before committing, or rebalanced
        if record.output_tokens:
            self._lengths(record.alias).append(record.output_tokens)
        digest = prompt_hash(prompt, tools)
        seen = SeenMark(record.alias, digest, config.learning.dedup_window_s)
        if not is_heldout(self.secret, digest, config.learning.heldout_fraction):
            await self._check_repeat(seen, config)
            return ToSample(message, record, config, prompt, tools, digest, seen)
        if seen.window_s and await self.marks.seen(seen):
            raise Skip("recent_duplicate")
        self.metrics.heldout.labels(record.alias).inc()
        held = HeldoutPrompt(
            prompt_hash=digest,
            alias=record.alias,
            prompt_messages=prompt,
            tools=tools,
            tool_choice=record.request.get("tool_choice") if tools else None,
            traffic_request_id=record.request_id,
            api_key_hash=record.api_key_hash,
            source=record.source,
            served_output_tokens=record.output_tokens,
        )
        return Ready(held, seen)

    async def group_for(self, session: aiohttp.ClientSession, work: ToSample) -> Record | None:
        """The record's scored group (a dead letter if this code fails on it), or None: skipped
        (backpressure, a paused alias) or dropped (sampling or scoring failed), counted."""
        alias, client = work.record.alias, work.record.client
        async with self.limit:
            try:
                share = work.config.learning.max_key_share
                decision = await self.backpressure.clear(alias, client, share)
                if not decision.sample:
                    raise Skip(decision.reason)  # not marked seen: sampled when it comes again
                self.metrics.in_flight.inc()
                try:
                    return await self._sample_and_score(session, work)
                except BaseException:
                    self.backpressure.release(alias, client)
                    raise
                finally:
                    self.metrics.in_flight.dec()
            except Skip as skip:
                self.metrics.skipped.labels(alias, skip.reason).inc()
            except (SamplingError, ScoringError) as exc:
                self.metrics.failures.labels(alias, exc.cause).inc()
                log.warning("group for %s dropped: %s (%s)", work.record.request_id, exc.cause, exc)
            except Exception as exc:
                return self._handler_error(work.message, alias, exc)
        return None

    def _label(self, alias: str) -> str:
        # A poison record's alias must not become a metric label of its own.
        return alias if alias in self.settings.aliases else "-"

    def _handler_error(self, message: SourceMessage, alias: str, exc: Exception) -> DeadLetter:
        log.exception("traffic record %s could not be judged; dead-lettered", message.offset)
        self.metrics.failures.labels(self._label(alias), "handler_error").inc()
        return self._dead_letter(message, "handler_error", f"{type(exc).__name__}: {exc}")

    def _dead_letter(self, message: SourceMessage, reason: str, error: str = "") -> DeadLetter:
        return DeadLetter.of_message(message, self.settings.judge.consumer_group, reason, error)

    def _lengths(self, alias: str) -> deque[int]:
        """The alias's recent served answer lengths (tokens), for sampling's max_tokens."""
        return self.answer_lengths.setdefault(alias, deque(maxlen=LENGTH_WINDOW))

    async def _sample_and_score(
        self, session: aiohttp.ClientSession, work: ToSample
    ) -> ScoredGroup:
        record, config = work.record, work.config
        route = await self._route(record.alias, config)
        if route.paused:
            # The learner would drop the group: don't spend vLLM and judge time sampling it.
            raise Skip("learning_paused")
        if await self._over_budget(record.alias, config):
            raise Skip("daily_budget")  # learning.max_cost_per_day: sampled again tomorrow
        if config.reward.kind == "feedback":
            status = await self.scorer.reward_status(record.alias)
            if status is None or not status.usable:
                # Nothing could score it yet; not marked seen, so it is sampled when it recurs.
                raise Skip("no_reward_model")
        version = await self._policy(record.alias, route)
        served = served_name(record.alias, version, route.base_model)
        sampling = config.sampling
        seed = None if sampling.seed is None else group_seed(sampling.seed, work.digest, version)
        max_tokens = sampling_max_tokens(sampling, record.request, self._lengths(record.alias))
        body = sampling_body(
            served,
            work.prompt,
            record.request,
            config.learning.group_size,
            sampling,
            seed,
            max_tokens,
        )
        started = time.perf_counter()
        with self.metrics.sample_latency.labels(record.alias).time():
            group = await sample_from(
                self.replicas, session, body, self.settings.judge.sample_timeout_s, self.vllm_key
            )
        bill = Bill(
            sample_input_tokens=group.input_tokens,
            sample_output_tokens=group.output_tokens,
            sample_seconds=time.perf_counter() - started,
        )
        self.metrics.sampled_tokens.labels(record.alias, "input").inc(group.input_tokens)
        self.metrics.sampled_tokens.labels(record.alias, "output").inc(group.output_tokens)
        answers = [s.message for s in group.samples]
        score = await self.scorer.score(
            record.alias, config.reward, work.prompt, work.tools, answers, bill
        )
        self._observe(record.alias, score.rewards)
        self.metrics.groups.labels(record.alias).inc()
        return ScoredGroup(
            group_id=group_id_of(record.request_id, version),
            alias=record.alias,
            version=version,
            response_model=served,
            prompt_messages=work.prompt,
            tools=work.tools,
            prompt_token_ids=group.prompt_token_ids,
            samples=group.samples,
            rewards=score.rewards,
            explanations=score.explanations,
            judge_model=score.judge_model,
            rubric_hash=score.rubric_hash,
            traffic_request_id=record.request_id,
            api_key_hash=record.api_key_hash,
            source=record.source,
            bill=bill,
            replica=group.replica,
        )

    async def _over_budget(self, alias: str, config: AliasConfig) -> bool:
        """The alias's judge spend today has reached ``learning.max_cost_per_day``. Logged once
        a day; with Redis away the spend is unknown and sampling goes on."""
        cap = config.learning.max_cost_per_day
        if cap is None:
            return False
        day = today()
        try:
            raw = await self.redis.get(spend_key(alias, day))
        except (redis.RedisError, OSError):
            return False
        spent = float(raw) if raw else 0.0
        if spent < cap:
            return False
        if self._budget_logged.get(alias) != day:
            self._budget_logged[alias] = day
            log.warning("%s: %s", alias, budget_line(spent, cap))
        return True

    def _eligible(
        self, record: TrafficRecord, config: AliasConfig | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        if config is None or not config.learning.enabled:
            raise Skip("learning_disabled")
        if record.status != 200:
            raise Skip("failed_exchange")
        if record.endpoint != "chat.completions":
            raise Skip("not_chat")
        if record.request_cut:
            raise Skip("truncated_prompt")  # cut to fit Kafka: not the prompt the model saw
        if fraction_of("sample:" + record.request_id) >= config.learning.sample_rate:
            raise Skip("sampled_out")
        if (record.input_tokens or 0) > config.learning.max_prompt_tokens:
            raise Skip("prompt_too_long")
        prompt = prompt_of(record.request.get("messages") or [])
        if prompt is None:
            raise Skip("no_prompt")
        tools = record.request.get("tools") or None
        return prompt, tools

    def _observe(self, alias: str, rewards: list[float]) -> None:
        for reward in rewards:
            self.metrics.reward.labels(alias).observe(reward)
        spread = statistics.pstdev(rewards)
        self.metrics.reward_mean.labels(alias).set(statistics.fmean(rewards))
        self.metrics.reward_spread.labels(alias).set(spread)
        if spread == 0:
            self.metrics.zero_variance.labels(alias).inc()

    async def _check_repeat(self, seen: SeenMark, config: AliasConfig) -> None:
        """Skip a training prompt already sampled from the version a group would come from now,
        or one whose recent groups carried no signal (:func:`repeat_reason`). A prompt comes
        back once per version: the next round learns from the new policy's answers to it, as
        on-policy GRPO passes over its prompts again, and a client repeating a prompt gets it
        sampled at most once a version. Without Redis nothing is skipped; nothing is lost."""
        learning = config.learning
        if not learning.dedup_window_s:
            return
        seen_at_all, flat = await self.marks.prompt_marks(seen)
        at_version = False  # the version is read only where a mark makes it matter
        if seen_at_all:
            version = await self._policy(seen.alias, await self._route(seen.alias, config))
            at_version = await self.marks.seen(seen, version)
        reason = repeat_reason(at_version, flat, learning.skip_after_flat_groups)
        if reason is not None:
            raise Skip(reason)

    async def _route(self, alias: str, config: AliasConfig) -> AliasRoute:
        return await self.routing.route(alias, config)

    async def _policy(self, alias: str, route: AliasRoute) -> int:
        return self.routing.policy(alias, route)

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        s = self.settings
        start_http_server(
            s.judge.metrics_port, addr=s.judge.metrics_host, registry=self.metrics.registry
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await loop.run_in_executor(None, self._connect)
        log.info("judge consuming %s as group %s", TRAFFIC_TOPIC, s.judge.consumer_group)
        async with aiohttp.ClientSession() as session:
            probing = asyncio.create_task(self.agreement.run(session, self.stopping))
            while not self.stopping.is_set():
                batch = await loop.run_in_executor(None, self._poll)
                if batch and not await self.judge_batch(session, batch):
                    break
            self.stopping.set()
            await probing
        await loop.run_in_executor(None, self._close)
        await self.redis.aclose()

    async def judge_batch(self, session: aiohttp.ClientSession, batch: list[SourceMessage]) -> bool:
        """Classify every record, deliver the held-out prompts (and dead letters) at once, then
        sample and score the rest and deliver those groups; commit the batch's offsets only when
        everything it produced is acknowledged. False: stopped before that (nothing committed).

        Held-out prompts never wait on sampling: the learner starts no round before
        ``gate.min_pairs`` of them have arrived, and a batch's sampling takes minutes on a CPU."""
        loop = asyncio.get_running_loop()
        triaged = await asyncio.gather(*(self.classify(m) for m in batch))
        ready = [t for t in triaged if isinstance(t, Ready)]
        if not await self._deliver([r.record for r in ready]):
            return False
        await self.marks.mark_seen([r.seen for r in ready if r.seen is not None])
        work = fair_order([t for t in triaged if isinstance(t, ToSample)], self.backpressure)
        results = await asyncio.gather(*(self.group_for(session, w) for w in work))
        outputs = [r for r in results if r is not None]
        if not await self._deliver(outputs):
            return False
        await self.backpressure.count_produced(
            Counter(r.alias for r in outputs if isinstance(r, ScoredGroup))
        )
        await self.marks.settle(await loop.run_in_executor(None, self._commit))
        await self.marks.mark_sampled(
            [
                Sampled(w.seen, r)
                for w, r in zip(work, results, strict=True)
                if isinstance(r, ScoredGroup)
            ]
        )
        return True

    async def _deliver(self, outputs: list[Record]) -> bool:
        """Produce and wait for the broker's acks, then mark their traffic records judged. A
        batch not acknowledged (stopping during a broker outage) is neither marked nor
        committed: the next judge must read it again and not skip it."""
        if not outputs:
            return True
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._produce, outputs):
            return False
        await self.marks.mark_done(outputs)
        return True


def fair_order(work: list[ToSample], backpressure: Backpressure) -> list[ToSample]:
    """The batch's records in the order they ask for a group (first come, first cleared): each
    client's first record before any client's second, and clients with fewer groups among the
    alias's last ones first. When the learner needs only some groups, a flooding client's
    records then queue behind everyone else's instead of taking the budget in arrival order
    (audit M-1)."""
    served: dict[str, Counter[str]] = {}
    turns: Counter[tuple[str, str]] = Counter()
    keys: list[tuple[int, int]] = []
    for at, item in enumerate(work):
        alias, client = item.record.alias, item.record.client
        if alias not in served:
            served[alias] = backpressure.served(alias)
        keys.append((served[alias][client] + turns[alias, client], at))
        turns[alias, client] += 1
    return [work[at] for _, at in sorted(keys)]


def serve(settings: RatchetSettings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(JudgeService(settings).run())

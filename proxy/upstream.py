"""vLLM as the proxy sees it: forwarded calls, readiness, and its failures as ProxyErrors.

Only the paths in FORWARDED_PATHS, /health and ``GET /v1/models`` (once, for the model's context
length) are ever called: vLLM's adapter admin routes share its port and must stay unreachable
through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import orjson

from proxy.errors import ProxyError
from proxy.http1 import AnswerTooLarge, ConnectFailed, UpstreamPool, UpstreamResponse
from proxy.stall import GapWatch, Stalled, StallWatch
from proxy.upstream_errors import body_stalled
from proxy.upstream_errors import stream_dropped as stream_dropped
from proxy.upstream_errors import upstream_error as upstream_error
from ratchet.ejection import EjectionPolicy, Outliers
from ratchet.fleet import RESOLVE_TIMEOUT_S, Resolver, Router, candidates
from ratchet.settings.proxy import ProxySettings
from ratchet.version_exclusion import VersionExclusions

log = logging.getLogger(__name__)

# /v1/models is small; more than this is not vLLM's answer.
MODELS_ANSWER_MAX = 1 << 20
# What a probe of a replica's engine asks (proxy/stall.py): one token of any prompt.
PROBE_PROMPT = "ping"
# The whole list of upstream paths the proxy calls, by the proxy's own names for them (a client
# never names a path). /tokenize only counts a Responses request's input tokens
# (proxy/responses_tokens.py); vLLM's other non-generation routes (adapters, detokenize, ...)
# are never called.
FORWARDED_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "tokenize": "/tokenize",
}


class Endpoint:
    """One vLLM replica: its connections, whether it answers its health check, the requests in
    flight on it (what the choice of replica balances), and its faults so far."""

    def __init__(
        self, url: str, connect_timeout_s: float, total_timeout_s: float, api_key: str | None
    ) -> None:
        self.url = url.rstrip("/")
        self.pool = UpstreamPool(url, connect_timeout_s, total_timeout_s, api_key)
        self.healthy = False
        self.outstanding = 0
        self.connect_failures = 0  # no connection made
        self.first_byte_timeouts = 0  # answered 200, then nothing within the first-byte deadline
        self.stream_stalls = 0  # answers that went silent mid-way past the gap deadline
        self.retries = 0  # requests it could not take, sent on to another replica


@dataclass(frozen=True)
class FaultPolicy:
    """How the proxy treats a replica that fails (proxy.outlier_ejection and the upstream_*
    settings): the ejection policy, the first-byte deadline (None: none), how many other
    replicas a request that never reached one may try, the name lookup's timeout, and the
    deadline on a silence within an answer's body (None: none)."""

    ejection: EjectionPolicy = field(default_factory=lambda: EjectionPolicy(0))
    first_byte_timeout_s: float | None = None
    retries: int = 1_000  # every replica, as before ejection came
    resolve_timeout_s: float = RESOLVE_TIMEOUT_S
    stream_gap_timeout_s: float | None = None


def fault_policy(proxy: ProxySettings) -> FaultPolicy:
    ejection = proxy.outlier_ejection
    return FaultPolicy(
        EjectionPolicy(
            ejection.consecutive_failures,
            ejection.base_ejection_s,
            ejection.max_ejection_s,
            ejection.max_ejection_percent,
        ),
        proxy.upstream_first_byte_timeout_s,
        proxy.upstream_retries,
        proxy.upstream_resolve_timeout_s,
        proxy.upstream_stream_gap_timeout_s,
    )


class Upstream:
    """vLLM as the proxy sees it: one replica or several (``vllm_endpoints``), each request sent
    to the one :func:`ratchet.fleet.choose` picks for its served name and conversation among
    those that answer their health check; a replica that refuses a connection is out until its
    check passes again. Readiness, and errors as ProxyErrors."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        connect_timeout_s: float,
        total_timeout_s: float,
        api_key: str | None = None,
        resolve: bool = False,
        balance: str = "affinity",
        faults: FaultPolicy | None = None,
    ) -> None:
        """``resolve``: the URLs are re-resolved every health interval, off the health loop, a
        name standing for every address it has (:func:`ratchet.fleet.expand`: a headless
        Service's pods). ``balance``: proxy.balance. ``faults``: ejection, retries, deadlines."""
        configured = [base_url] if isinstance(base_url, str) else list(base_url)
        self.faults = faults or FaultPolicy()
        self.outliers = Outliers(self.faults.ejection)
        deadline = self.faults.first_byte_timeout_s
        self.stall_watch = None if deadline is None else StallWatch(deadline, self._probe)
        gap = self.faults.stream_gap_timeout_s
        self.gap_watch = (
            None
            if gap is None
            else GapWatch(gap, functools.partial(self._probe, deadline=gap), self._went_silent)
        )
        self.resolver = Resolver(configured, self.faults.resolve_timeout_s) if resolve else None
        self.balance = balance
        self._turn = 0
        self.router = Router()  # requests in flight per served name, and their widths
        # Replicas out of a version's rotation: the routing table's (proxy/routing.py).
        self.exclusions = VersionExclusions()
        # vLLM's key on every call; the client's own key never reaches vLLM.
        self._connection = (connect_timeout_s, total_timeout_s, api_key)
        self.endpoints = {u.rstrip("/"): Endpoint(u, *self._connection) for u in configured}
        # vLLM's max_model_len, read from /v1/models once it answers; told to this listener.
        self.model_context: int | None = None
        self.on_model_context: Callable[[int], None] | None = None
        # Each request's replica, counted as it is chosen (proxy/metrics.py), if set.
        self.on_choice: Callable[[str], None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._resolve_task: asyncio.Task[None] | None = None
        self._gap_task: asyncio.Task[None] | None = None

    async def refresh_endpoints(self) -> None:
        """With a resolver: the replicas the configured names stand for now; a new one joins
        (used once its health check passes), a gone one leaves."""
        if self.resolver is None:
            return
        wanted = await self.resolver.resolve()
        if not wanted:
            return
        for url in wanted:
            if url not in self.endpoints:
                self.endpoints[url] = Endpoint(url, *self._connection)
                log.info("vLLM replica %s joined", url)
        for url in [u for u in self.endpoints if u not in wanted]:
            self.endpoints.pop(url).pool.close()  # its requests in flight hold their replica
            log.info("vLLM replica %s left", url)
        self.outliers.forget(self.endpoints)

    @property
    def ready(self) -> bool:
        return any(e.healthy for e in self.endpoints.values())

    async def start(self, health_interval_s: float) -> None:
        await self.refresh_endpoints()
        await self.check_health()
        self._health_task = asyncio.create_task(self._watch(health_interval_s), name="vllm-health")
        if self.resolver is not None:
            self._resolve_task = asyncio.create_task(
                self._resolve_every(health_interval_s), name="vllm-resolve"
            )
        if self.gap_watch is not None:
            self._gap_task = asyncio.create_task(self.gap_watch.run(), name="vllm-gaps")

    async def close(self) -> None:
        if self.stall_watch is not None:
            self.stall_watch.close()
        if self.gap_watch is not None:
            await self.gap_watch.close()
        for task in (self._health_task, self._resolve_task, self._gap_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for endpoint in self.endpoints.values():
            endpoint.pool.close()

    async def check_health(self) -> bool:
        """Every replica's health check; True when one answers. (Names are resolved on a
        loop of their own: a slow DNS answer must not hold every replica's health.)"""
        await asyncio.gather(*(self._check(e) for e in self.endpoints.values()))
        if self.ready and self.model_context is None:
            await self._read_model_context()
        return self.ready

    async def _check(self, endpoint: Endpoint) -> None:
        try:
            response = await endpoint.pool.request(b"GET", "/health", timeout_s=2.0)
            await response.read()
            endpoint.healthy = response.status == 200
        except (OSError, TimeoutError):  # UpstreamClosed is an OSError
            endpoint.healthy = False

    async def _read_model_context(self) -> None:
        """The longest max_model_len vLLM lists (a LoRA adapter has its base model's), for the
        default max_tokens limit; left unknown if the answer has none, and asked again later."""
        pool = next(e.pool for e in self.endpoints.values() if e.healthy)
        try:
            response = await pool.request(b"GET", "/v1/models", timeout_s=2.0)
            answer = await response.read(MODELS_ANSWER_MAX)
            if response.status != 200:
                return
            models = orjson.loads(answer).get("data") or []
            lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)]
            context = max((n for n in lengths if isinstance(n, int) and n > 0), default=None)
        except (OSError, TimeoutError, AnswerTooLarge, orjson.JSONDecodeError, AttributeError):
            return
        if context is not None:
            self.model_context = context
            log.info("vLLM's context length is %d tokens", context)
            if self.on_model_context is not None:
                self.on_model_context(context)

    async def _resolve_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh_endpoints()
            except Exception:  # the loop must outlive whatever one lookup does
                log.exception("resolving vLLM's endpoints failed")

    async def _watch(self, interval_s: float) -> None:
        while True:
            was = {url: e.healthy for url, e in self.endpoints.items()}
            for endpoint in self.endpoints.values():
                endpoint.pool.prune()
            await self.check_health()
            for url, endpoint in self.endpoints.items():
                if was.get(url, False) != endpoint.healthy:
                    log.warning("vLLM at %s is %s", url, "up" if endpoint.healthy else "DOWN")
            await asyncio.sleep(interval_s if self.ready else min(interval_s, 0.5))

    @property
    def routes_by_conversation(self) -> bool:
        """Whether a request's conversation key is worth computing: several replicas to
        choose from, by affinity."""
        return len(self.endpoints) > 1 and self.balance == "affinity"

    def choose(
        self, key: str, exclude: Collection[str] = (), conversation: str | None = None
    ) -> Endpoint:
        """The replica for a request of served name ``key`` and ``conversation``
        (:func:`ratchet.fleet.conversation_key`), not one of ``exclude``: among those whose
        health check passed and that are not ejected (all of them when none is: the request
        then says whether any is up), never one out of ``key``'s rotation (a 503 when every
        one is: ratchet/version_exclusion.py)."""
        barred = self.exclusions.barred(key)
        if len(self.endpoints) == 1 and not barred:  # no fleet: nothing to choose
            return next(iter(self.endpoints.values()))
        now = time.monotonic()
        live = candidates(self.endpoints, lambda url: self._usable(url, now), exclude, barred)
        if not live:
            raise ProxyError(
                503,
                f"no model server can serve {key}",
                type="server_error",
                code="no_replica_for_version",
            )
        if self.balance == "round_robin":
            self._turn += 1
            return self.endpoints[live[self._turn % len(live)]]
        outstanding = {url: self.endpoints[url].outstanding for url in live}
        return self.endpoints[self.router.choose(key, live, outstanding, conversation)]

    def _allowed(self, key: str) -> set[str]:
        """The replicas a request for ``key`` may go to at all."""
        return self.endpoints.keys() - self.exclusions.barred(key)

    def _usable(self, url: str, now: float) -> bool:
        return self.endpoints[url].healthy and not self.outliers.is_ejected(url, now)

    async def post(
        self, endpoint: str, body: bytes, key: str = "", conversation: str | None = None
    ) -> UpstreamResponse:
        """POST to the replica chosen for ``key`` (the served name) and ``conversation``.

        A request that never reached its replica (no connection: refused, unreachable, or
        blackholed past the connect timeout) goes to the next one chosen, up to
        ``faults.retries`` others; that replica is out until its health check passes. Once
        the body went upstream it is never sent again. With none left, a 503. A 200 whose
        body's first byte does not come within ``faults.first_byte_timeout_s``, on a replica
        whose engine then fails a probe too, is a 504 ``upstream_stalled``: the replica's
        fault, never the client's (who has read nothing yet). No answer within the whole
        timeout is a 504 ``upstream_timeout``. Each outcome counts for or against the replica
        (:class:`ratchet.ejection.Outliers`). The replica counts the request as outstanding
        until its response is released (read whole, or relayed and released). A 200's body
        that then goes silent past ``faults.stream_gap_timeout_s`` while it is read, on a
        replica whose engine fails a probe too, is ended with :class:`proxy.stall.Stalled`
        (:class:`proxy.stall.GapWatch`): :func:`stream_dropped` and :meth:`read` make it a 504
        ``upstream_stalled``, counted against the replica."""
        tried: set[str] = set()
        while True:
            replica = self.choose(key, exclude=tried, conversation=conversation)
            if self.on_choice is not None:
                self.on_choice(replica.url)
            self._take(replica, key)
            try:
                response = await self._send(replica, FORWARDED_PATHS[endpoint], body, key)
            except ConnectFailed as exc:
                self._release(replica, key)
                error = self._unavailable(replica, exc)
                tried.add(replica.url)
                if len(tried) > self.faults.retries or tried >= self._allowed(key):
                    raise error from None
                replica.retries += 1
                continue
            except BaseException:
                self._release(replica, key)
                raise
            response.on_release = functools.partial(self._released, replica, key, response)
            if self.gap_watch is not None and response.status == 200:
                self.gap_watch.follow(response, replica.url, key)
            return response

    async def _send(self, replica: Endpoint, path: str, body: bytes, key: str) -> UpstreamResponse:
        """One POST to ``replica``: its response once the status and (for a 200) the body's
        first byte are in; its failures as ProxyErrors, counted against it. A request whose
        headers are slow (not streamed: they come with the whole answer), and a stream whose
        first byte is, are watched (:class:`proxy.stall.StallWatch`): only an engine that
        fails the probe counts against the replica, never one that is queueing or prefilling
        (a long prompt, a busy fleet)."""
        request = replica.pool.request(b"POST", path, body)
        try:
            if self.stall_watch is None:
                response = await request
            else:
                response = await self.stall_watch.wait(replica.url, key, request)
        except TimeoutError:
            raise ProxyError(
                504,
                "the model server did not answer in time",
                type="server_error",
                code="upstream_timeout",
            ) from None
        except ConnectFailed:
            replica.connect_failures += 1
            self._failed(replica)
            raise
        except OSError as exc:  # the request went: it is not sent again
            self._failed(replica)
            raise self._unavailable(replica, exc) from None
        except Stalled:
            raise self._stalled(replica) from None
        if response.status != 200 or self.stall_watch is None or response.begun:
            return response  # begun: no wait, so no timer (every whole answer, most streams')
        try:  # a stream's first byte: past the deadline, the engine is probed as above
            arrived = await self.stall_watch.wait(replica.url, key, response.first_byte())
        except Stalled:
            response.release()
            raise self._stalled(replica) from None
        except BaseException:  # the client left meanwhile: vLLM's answer is closed, not kept
            response.release()
            raise
        if arrived:
            return response
        response.release()  # the engine kept answering probes but never this: too slow
        raise ProxyError(
            504,
            "the model server did not answer in time",
            type="server_error",
            code="upstream_timeout",
        )

    def _stalled(self, replica: Endpoint) -> ProxyError:
        deadline = self.faults.first_byte_timeout_s
        replica.first_byte_timeouts += 1
        self._failed(replica)
        log.warning(
            "vLLM at %s sent nothing within %s s: its engine stalled", replica.url, deadline
        )
        return ProxyError(
            504,
            f"the model server sent nothing within {deadline} s (its engine stalled)",
            type="server_error",
            code="upstream_stalled",
        )

    async def _probe(self, url: str, key: str, deadline: float | None = None) -> bool:
        """Whether ``url``'s engine sends the first byte of a one-token stream of ``key`` in
        time (``deadline``, or else the first-byte deadline: :mod:`proxy.stall`). No
        connection, or one broken, is no first byte either (a replica that dropped off the
        network holds its requests as a hung engine does); an answer that is not 200 (its API
        server is alive) and a replica that left count as working."""
        replica = self.endpoints.get(url)
        deadline = deadline or self.faults.first_byte_timeout_s
        if replica is None or deadline is None:
            return True
        probe = {"model": key, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": True}
        path = FORWARDED_PATHS["completions"]
        try:
            response = await replica.pool.request(b"POST", path, orjson.dumps(probe), deadline)
        except OSError:  # TimeoutError and ConnectFailed among them
            return False
        try:
            return response.status != 200 or await response.first_byte(deadline)
        finally:
            response.release()

    def _failed(self, replica: Endpoint) -> None:
        if self.outliers.failed(replica.url, self.endpoints, time.monotonic()):
            record = self.outliers.replicas[replica.url]
            log.warning(
                "vLLM at %s ejected for %.0f s for failing requests (ejection %d)",
                replica.url,
                record.ejected_until - time.monotonic(),
                record.ejections,
            )

    def _released(self, replica: Endpoint, key: str, response: UpstreamResponse) -> None:
        """A response's end: a 5xx or a body vLLM broke off counts against its replica, any
        other answer for it; a client that left before the end says nothing of it."""
        self._release(replica, key)
        if self.gap_watch is not None:
            self.gap_watch.unfollow(response)
        if response.status >= 500 or response.broken:
            self._failed(replica)
        elif response.complete:
            self.outliers.succeeded(replica.url, time.monotonic())

    def _went_silent(self, url: str, answers: int) -> None:
        """``answers`` on ``url`` went silent mid-way and its probe too (proxy/stall.py): they
        end as stalled; each counts against the replica as its response is released."""
        replica = self.endpoints.get(url)
        if replica is not None:
            replica.stream_stalls += answers

    def _take(self, replica: Endpoint, key: str) -> None:
        replica.outstanding += 1
        self.router.taken(key)

    def _release(self, replica: Endpoint, key: str) -> None:
        replica.outstanding -= 1
        self.router.released(key)

    @staticmethod
    async def read(response: UpstreamResponse, max_bytes: int | None = None) -> bytes:
        """The whole answer; a connection dropped mid-body is a 502, a stalled one a 504, and one
        longer than ``max_bytes`` (proxy.max_answer_bytes) a 400: the client asked for it."""
        try:
            return await response.read(max_bytes)
        except Stalled as exc:
            raise body_stalled(exc) from None
        except AnswerTooLarge:
            raise ProxyError(
                400,
                f"the answer is larger than proxy.max_answer_bytes ({max_bytes} bytes); "
                "lower max_tokens or n, or stream it (stream: true)",
                param="max_tokens",
                code="answer_too_large",
            ) from None
        except TimeoutError:
            raise ProxyError(
                504,
                "the model server did not finish its answer in time",
                type="server_error",
                code="upstream_timeout",
            ) from None
        except OSError as exc:
            raise ProxyError(
                502,
                f"the model server dropped the answer: {exc}",
                type="server_error",
                code="upstream_error",
            ) from None

    def _unavailable(self, replica: Endpoint, exc: Exception) -> ProxyError:
        replica.healthy = False
        log.warning("vLLM at %s unreachable: %s", replica.url, exc)
        return ProxyError(
            503,
            "the model server is unavailable; retry shortly",
            type="server_error",
            code="upstream_unavailable",
            headers={"Retry-After": "1"},
        )

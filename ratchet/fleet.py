"""Which vLLM replica answers a request: consistent hashing with bounded loads. Pure.

A version's requests should go to the replicas that already hold its adapter (each holds at most
``max_loras`` on the GPU; a miss loads it from the store in the request's path) and share its
prefix cache, so the served name is hashed onto a ring of the replicas and its requests go to
the first one clockwise. A version that is hot would then pin one replica: with bounded loads
(Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018) a replica
takes a request only while its outstanding requests are under ``load_factor`` times the mean
(counting the new one), else the next one on the ring does, so a hot version spreads over a few
replicas and no replica carries more than that bound. A replica that leaves or comes back moves
only its own share of the keys.

A conversation's later turns repeat its earlier ones, which the replica that answered them holds
in its prefix cache. While a version fits one replica its conversations share it anyway; once it
spreads, each conversation (:func:`conversation_key`) is kept on one of the replicas the version
needs (:class:`Spread`: the first ``width`` on its ring, as many as its requests in flight fill
at the bound, held a minute), chosen by rendezvous hashing (Thaler and Ravishankar, 1998), so a
change of width moves only the conversations of the replica that joins or leaves.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hashlib
import ipaddress
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from ratchet.ejection import EjectionPolicy, Outliers
from ratchet.settings import RatchetSettings, is_ip_address
from ratchet.version_exclusion import VersionExclusions

log = logging.getLogger(__name__)

# Points per replica on the ring: enough that keys split evenly between a few replicas.
POINTS = 64
LOAD_FACTOR = 1.25


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=64)
def ring(endpoints: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The sorted ring of ``endpoints``' points, and the endpoint of each point."""
    points = sorted(
        (_point(f"{endpoint}#{i}"), endpoint) for endpoint in endpoints for i in range(POINTS)
    )
    return tuple(p for p, _ in points), tuple(e for _, e in points)


def capacity(outstanding: Mapping[str, int], endpoints: Sequence[str], factor: float) -> int:
    """The most outstanding requests a replica may hold and still take one more."""
    total = sum(outstanding.get(e, 0) for e in endpoints) + 1
    return max(1, math.ceil(factor * total / len(endpoints)))


@lru_cache(maxsize=4096)
def preference(key: str, endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """Every one of ``endpoints`` (sorted), in the order the ring meets them from ``key``'s
    point: the replicas a key's requests try, first to last."""
    points, owners = ring(endpoints)
    start = bisect.bisect(points, _point(key))
    order: dict[str, None] = {}
    for i in range(len(points)):
        order.setdefault(owners[(start + i) % len(points)])
        if len(order) == len(endpoints):
            break
    return tuple(order)


def choose(
    key: str,
    endpoints: Sequence[str],
    outstanding: Mapping[str, int],
    load_factor: float = LOAD_FACTOR,
    conversation: str | None = None,
    width: int = 1,
) -> str:
    """The replica for a request hashed by ``key`` (the served name): the first in its ring
    order whose outstanding requests are under the bound. With a ``conversation``, the first
    ``width`` replicas in that order (:class:`Spread`) are tried first, in the conversation's
    rendezvous order."""
    if not endpoints:
        raise ValueError("no endpoint to choose from")
    if len(endpoints) == 1:
        return endpoints[0]
    order = preference(key, tuple(sorted(endpoints)))
    bound = capacity(outstanding, endpoints, load_factor)
    width = min(width, len(order))
    if conversation is not None and width > 1:
        home = sorted(order[:width], key=lambda e: _point(f"{conversation}#{e}"))
        order = (*home, *order[width:])
    for endpoint in order:
        if outstanding.get(endpoint, 0) < bound:
            return endpoint
    return min(endpoints, key=lambda e: outstanding.get(e, 0))  # unreachable: the bound admits one


def needed_width(
    key_outstanding: int,
    outstanding: Mapping[str, int],
    endpoints: Sequence[str],
    load_factor: float = LOAD_FACTOR,
) -> int:
    """How many replicas a key's ``key_outstanding`` requests and one more fill at the bound."""
    if len(endpoints) < 2:
        return 1
    bound = capacity(outstanding, endpoints, load_factor)
    return min(len(endpoints), math.ceil((key_outstanding + 1) / bound))


# A version's width is held this long after it was last needed: a width that followed each
# moment's load would move a conversation between replicas as its version's traffic ebbs and
# flows (bench/fleet_turns.py: at half a conversation a second, 0.82 of later turns back on a
# replica they used unheld, 0.90 held a minute).
SPREAD_HOLD_S = 60.0


class Spread:
    """How many replicas each key's conversations are spread over: the most its requests in
    flight needed (:func:`needed_width`) within the last ``hold_s``."""

    def __init__(self, hold_s: float = SPREAD_HOLD_S) -> None:
        self.hold_s = hold_s
        self._held: dict[str, tuple[int, float]] = {}  # key -> (width, when last needed)

    def width(self, key: str, needed: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        held, since = self._held.get(key, (1, now))
        if needed >= held or now - since >= self.hold_s:
            if needed > 1:
                self._held[key] = (needed, now)
            else:  # a quiet key keeps no entry: versions come and go
                self._held.pop(key, None)
            return needed
        return held


class Router:
    """One client's choice of replica (the proxy's, or a :class:`Replicas`'): :func:`choose`
    for a request's served name and conversation, with the width :class:`Spread` holds for the
    served name given its requests in flight, which the caller counts with :meth:`taken` and
    :meth:`released`."""

    def __init__(self, hold_s: float = SPREAD_HOLD_S) -> None:
        self.in_flight: Counter[str] = Counter()  # per served name
        self.spread = Spread(hold_s)

    def choose(
        self,
        key: str,
        endpoints: Sequence[str],
        outstanding: Mapping[str, int],
        conversation: str | None = None,
        now: float | None = None,
    ) -> str:
        width = 1
        if conversation is not None:
            needed = needed_width(self.in_flight[key], outstanding, endpoints)
            width = self.spread.width(key, needed, now)
        return choose(key, endpoints, outstanding, LOAD_FACTOR, conversation, width)

    def taken(self, key: str) -> None:
        self.in_flight[key] += 1

    def released(self, key: str) -> None:
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]  # versions come and go: keep no zero counts


# Of a completion's prompt, the head that keys its conversation: a shared preamble keeps the
# prompts that open with it together, where their common prefix is cached.
PROMPT_HEAD_CHARS = 512


def conversation_key(payload: Mapping[str, Any]) -> str | None:
    """What a conversation's turns have in common, as a short digest: the client's
    ``prompt_cache_key`` (OpenAI's name for it); else a chat's messages up to its first user
    message, which every later turn repeats; else the first ``PROMPT_HEAD_CHARS`` of a text
    prompt. None when there is none (the request is keyed by its version alone)."""
    given, messages, prompt = (payload.get(k) for k in ("prompt_cache_key", "messages", "prompt"))
    if isinstance(given, str) and given:
        text = b"k:" + given.encode(errors="replace")
    elif isinstance(messages, list) and messages:
        users = (
            i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"
        )
        text = b"m:" + orjson.dumps(messages[: next(users, 0) + 1], option=orjson.OPT_SORT_KEYS)
    elif isinstance(prompt, str) and prompt:
        text = b"p:" + prompt[:PROMPT_HEAD_CHARS].encode(errors="replace")
    else:
        return None
    return hashlib.blake2b(text, digest_size=8).hexdigest()


# --- the replicas behind a name ----------------------------------------------------------------


async def expand(url: str) -> list[str]:
    """The replicas one configured endpoint stands for: an ``http`` URL whose host is a name,
    every address the name resolves to (a Kubernetes headless Service lists each ready pod), as
    its own URL, IPv4 ones where there are any; an address, or an ``https`` URL (its
    certificate names the host), itself. OSError when the name does not resolve."""
    parts = urlsplit(url.rstrip("/"))
    host = parts.hostname
    if parts.scheme != "http" or host is None or is_ip_address(host):
        return [url.rstrip("/")]
    port = parts.port or 80
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = {str(info[4][0]) for info in infos}
    v4 = sorted(a for a in found if ipaddress.ip_address(a).version == 4)
    addresses = v4 or sorted(found)
    return [
        urlunsplit(parts._replace(netloc=f"[{a}]:{port}" if ":" in a else f"{a}:{port}"))
        for a in addresses
    ]


def candidates(
    urls: Iterable[str],
    usable: Callable[[str], bool],
    exclude: Collection[str] = (),
    barred: Collection[str] = (),
) -> list[str]:
    """The replicas a request may go to: those not in ``exclude`` that are ``usable`` (passing
    their health check, not failed lately); all of them when none is, so the request itself
    says whether any is up. Never one in ``barred`` (out of the request's version's rotation,
    ratchet/version_exclusion.py): none when every replica is."""
    allowed = [u for u in urls if u not in barred] if barred else list(urls)
    left = [u for u in allowed if u not in exclude] or allowed
    return [u for u in left if usable(u)] or left


# How long one name's lookup may take; past it, its last answer stands. getaddrinfo has no
# timeout of its own, and one slow DNS answer must not hold up the fleet.
RESOLVE_TIMEOUT_S = 2.0


class Resolver:
    """The replicas the configured endpoints stand for now (:func:`expand`), each endpoint's
    last answer kept while it does not resolve, or not within ``timeout_s``: a DNS blip must
    not empty the fleet, nor a slow one stall it. A lookup that outlives its timeout runs on
    (getaddrinfo's thread cannot be stopped): the next resolve waits on it rather than start
    another, and its late answer still counts."""

    def __init__(self, configured: Sequence[str], timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
        self.configured = [u.rstrip("/") for u in configured]
        self.timeout_s = timeout_s
        self._last: dict[str, list[str]] = {}
        self._pending: dict[str, asyncio.Future[list[str]]] = {}

    async def resolve(self) -> list[str]:
        answers = await asyncio.gather(*(self._lookup(url) for url in self.configured))
        return [replica for found in answers for replica in found]

    async def _lookup(self, url: str) -> list[str]:
        pending = self._pending.get(url)
        if pending is None:
            pending = self._pending[url] = asyncio.ensure_future(expand(url))
            pending.add_done_callback(functools.partial(self._settled, url))
        try:
            await asyncio.wait_for(asyncio.shield(pending), self.timeout_s)
        except TimeoutError:
            log.warning("vLLM endpoint %s did not resolve within %s s", url, self.timeout_s)
        except OSError:
            pass  # said by _settled
        return self._last.get(url, [])

    def _settled(self, url: str, lookup: asyncio.Future[list[str]]) -> None:
        self._pending.pop(url, None)
        if lookup.cancelled():
            return
        error = lookup.exception()
        if error is None:
            self._last[url] = lookup.result()
        else:
            log.warning("vLLM endpoint %s did not resolve: %s", url, error)


class NoReplica(ConnectionError):
    """Every replica is out of the requested version's rotation."""


# A replica a client outside the proxy could not reach is avoided this long.
FAILED_S = 30.0
# How often a client outside the proxy resolves the replicas' names again.
REFRESH_S = 10.0


class Replicas:
    """The vLLM replicas a client outside the proxy (the judge's sampling, the learner's gate)
    spreads its requests over, as the proxy does: ``vllm_endpoints`` (names resolved again every
    ``REFRESH_S``), else ``vllm_url`` alone; each request to the replica :func:`choose` picks
    for its served name and conversation, counted in flight while it runs, among those usable.

    It has no health checks of its own: each request's outcome is told back. One that could not
    reach its replica (:meth:`failed` with ``connected`` False) leaves it out for ``FAILED_S``,
    as the proxy's failed health check would; and every failure (no connection, a 5xx, no answer
    within the caller's deadline) is a vote toward the replica's ejection under the proxy's own
    policy (ratchet/ejection.py, ``proxy.outlier_ejection``), so a replica whose engine stalls
    while it still accepts connections is left out for the judge and the learner too. The
    callers send a request that never connected to another replica, up to ``retries`` of them
    (``proxy.upstream_retries``), and never again one that reached vLLM."""

    def __init__(
        self,
        urls: Sequence[str],
        resolve: bool,
        ejection: EjectionPolicy | None = None,
        retries: int = 1_000,
        connect_timeout_s: float | None = None,
        resolve_timeout_s: float = RESOLVE_TIMEOUT_S,
    ) -> None:
        """``ejection`` None: never ejected (only ``FAILED_S`` after a failed connection).
        ``retries``: other replicas a request that never connected may go to.
        ``connect_timeout_s``: how long the callers' connection to a replica may take."""
        self.resolver = Resolver(urls, resolve_timeout_s) if resolve else None
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding: Counter[str] = Counter()
        self.router = Router()
        self.failed_until: dict[str, float] = {}
        self.outliers = Outliers(ejection or EjectionPolicy(0))
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.resolved_at = 0.0
        self.on_ejected: Callable[[str], None] | None = None  # told each ejection (a metric)
        # Replicas out of a version's rotation (learner/gating.py adds its candidate's).
        self.exclusions = VersionExclusions()

    @classmethod
    def of(cls, vllm_url: str, vllm_endpoints: Sequence[str]) -> Replicas:
        return cls(list(vllm_endpoints) or [vllm_url], resolve=bool(vllm_endpoints))

    @classmethod
    def from_settings(cls, settings: RatchetSettings) -> Replicas:
        """The replicas of ``vllm_endpoints`` (else ``vllm_url``) under the proxy's settings
        for failing replicas: its ejection policy, retries, connect and name lookup timeouts."""
        proxy = settings.proxy
        return cls(
            list(settings.vllm_endpoints) or [settings.vllm_url],
            resolve=bool(settings.vllm_endpoints),
            ejection=EjectionPolicy.of(proxy.outlier_ejection),
            retries=proxy.upstream_retries,
            connect_timeout_s=proxy.upstream_connect_timeout_s,
            resolve_timeout_s=proxy.upstream_resolve_timeout_s,
        )

    def usable(self, url: str, now: float) -> bool:
        """Neither unreachable in the last ``FAILED_S`` nor ejected."""
        return self.failed_until.get(url, 0.0) <= now and not self.outliers.is_ejected(url, now)

    @contextlib.asynccontextmanager
    async def use(
        self, key: str, exclude: Collection[str] = (), conversation: str | None = None
    ) -> AsyncIterator[str]:
        """The base URL of the replica for a request of served name ``key`` (and
        ``conversation``, :func:`conversation_key`), not one of ``exclude``, in flight until
        the block ends."""
        if self.resolver is not None and time.monotonic() - self.resolved_at > REFRESH_S:
            self.urls = await self.resolver.resolve() or self.urls
            self.outliers.forget(self.urls)
            self.resolved_at = time.monotonic()
        now = time.monotonic()
        barred = self.exclusions.barred(key)
        live = candidates(self.urls, lambda u: self.usable(u, now), exclude, barred)
        if not live:
            raise NoReplica(f"no vLLM replica serves {key}: each is out of its rotation")
        url = self.router.choose(key, live, self.outstanding, conversation)
        self.outstanding[url] += 1
        self.router.taken(key)
        try:
            yield url
        finally:
            self.outstanding[url] -= 1
            self.router.released(key)

    def may_retry(self, tried: Collection[str], key: str = "") -> bool:
        """Whether a request for ``key`` (a served name) that never connected to any of
        ``tried`` may go to another: one it may go to at all (not out of ``key``'s rotation),
        else :meth:`use` would pick a tried one again, and again."""
        gone = set(tried)
        allowed = set(self.urls) - self.exclusions.barred(key)
        return len(gone) <= self.retries and bool(allowed - gone)

    def failed(self, url: str, connected: bool = False) -> bool:
        """A request to ``url`` failed: a vote toward its ejection; True when this ejects it.
        ``connected`` False (it could not be reached): also avoided for ``FAILED_S``."""
        now = time.monotonic()
        if not connected:
            self.failed_until[url] = now + FAILED_S
        ejected = self.outliers.failed(url, self.urls, now)
        if ejected:
            record = self.outliers.record(url)
            log.warning(
                "vLLM at %s ejected for %.0f s for failing requests (ejection %d)",
                url,
                record.ejected_until - now,
                record.ejections,
            )
            if self.on_ejected is not None:
                self.on_ejected(url)
        return ejected

    def succeeded(self, url: str) -> None:
        """A request to ``url`` was answered: its run of failures ends."""
        self.outliers.succeeded(url, time.monotonic())

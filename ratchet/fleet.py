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
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import ipaddress
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from urllib.parse import urlsplit, urlunsplit

from ratchet.settings import is_ip_address

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


def choose(
    key: str,
    endpoints: Sequence[str],
    outstanding: Mapping[str, int],
    load_factor: float = LOAD_FACTOR,
) -> str:
    """The replica for a request hashed by ``key`` (the served name): the first on the ring from
    the key's point whose outstanding requests are under the bound."""
    if not endpoints:
        raise ValueError("no endpoint to choose from")
    if len(endpoints) == 1:
        return endpoints[0]
    points, owners = ring(tuple(sorted(endpoints)))
    bound = capacity(outstanding, endpoints, load_factor)
    start = bisect.bisect(points, _point(key))
    seen: set[str] = set()
    for i in range(len(points)):
        endpoint = owners[(start + i) % len(points)]
        if endpoint in seen:
            continue
        if outstanding.get(endpoint, 0) < bound:
            return endpoint
        seen.add(endpoint)
        if len(seen) == len(endpoints):
            break
    return min(endpoints, key=lambda e: outstanding.get(e, 0))  # unreachable: the bound admits one


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
    urls: Iterable[str], usable: Callable[[str], bool], exclude: Collection[str] = ()
) -> list[str]:
    """The replicas a request may go to: those not in ``exclude`` that are ``usable`` (passing
    their health check, not failed lately); all of them when none is, so the request itself
    says whether any is up."""
    left = [u for u in urls if u not in exclude] or list(urls)
    return [u for u in left if usable(u)] or left


class Resolver:
    """The replicas the configured endpoints stand for now (:func:`expand`), each endpoint's
    last answer kept while it does not resolve: a DNS blip must not empty the fleet."""

    def __init__(self, configured: Sequence[str]) -> None:
        self.configured = [u.rstrip("/") for u in configured]
        self._last: dict[str, list[str]] = {}

    async def resolve(self) -> list[str]:
        urls: list[str] = []
        for url in self.configured:
            try:
                self._last[url] = await expand(url)
            except OSError as exc:
                log.warning("vLLM endpoint %s did not resolve: %s", url, exc)
            urls += self._last.get(url, [])
        return urls


# A replica a client outside the proxy could not reach is avoided this long.
FAILED_S = 30.0
# How often a client outside the proxy resolves the replicas' names again.
REFRESH_S = 10.0


class Replicas:
    """The vLLM replicas a client outside the proxy (the judge's sampling, the learner's gate)
    spreads its requests over, as the proxy does: ``vllm_endpoints`` (names resolved again every
    ``REFRESH_S``), else ``vllm_url`` alone; each request to the replica :func:`choose` picks
    for its served name among those that did not fail in the last ``FAILED_S``, counted in
    flight while it runs. It has no health checks of its own: a failure marks the replica."""

    def __init__(self, urls: Sequence[str], resolve: bool) -> None:
        self.resolver = Resolver(urls) if resolve else None
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding: Counter[str] = Counter()
        self.failed_until: dict[str, float] = {}
        self.resolved_at = 0.0

    @classmethod
    def of(cls, vllm_url: str, vllm_endpoints: Sequence[str]) -> Replicas:
        return cls(list(vllm_endpoints) or [vllm_url], resolve=bool(vllm_endpoints))

    @contextlib.asynccontextmanager
    async def use(self, key: str, exclude: Collection[str] = ()) -> AsyncIterator[str]:
        """The base URL of the replica for a request of served name ``key``, not one of
        ``exclude``, in flight until the block ends."""
        if self.resolver is not None and time.monotonic() - self.resolved_at > REFRESH_S:
            self.urls = await self.resolver.resolve() or self.urls
            self.resolved_at = time.monotonic()
        now = time.monotonic()
        live = candidates(self.urls, lambda u: self.failed_until.get(u, 0.0) <= now, exclude)
        url = choose(key, live, self.outstanding)
        self.outstanding[url] += 1
        try:
            yield url
        finally:
            self.outstanding[url] -= 1

    def failed(self, url: str) -> None:
        """``url`` could not be reached: avoided for ``FAILED_S``."""
        self.failed_until[url] = time.monotonic() + FAILED_S

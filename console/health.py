"""Whether the parts the overview shows are up: Redis, the proxy, vLLM and Kafka.

Checked at most every :data:`HEALTH_TTL_S`, all at once: a part that does not answer costs the
page one timeout (:data:`CHECK_TIMEOUT_S`), not one per part, and the HTTP checks wait on the
event loop instead of holding a worker thread.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from console.stats import ThroughputReader, reachable
from console.views import ConsoleData
from ratchet.settings import RatchetSettings

HEALTH_TTL_S = 5.0
CHECK_TIMEOUT_S = 1.0


def proxy_url(settings: RatchetSettings) -> str:
    if settings.console.proxy_url:
        return settings.console.proxy_url.rstrip("/")
    return f"http://{reachable(settings.proxy.host)}:{settings.proxy.port}"


class Health:
    def __init__(
        self, settings: RatchetSettings, data: ConsoleData, throughput: ThroughputReader
    ) -> None:
        self.settings = settings
        self.data = data
        self.throughput = throughput  # its scrape of the proxy's metrics says whether Kafka is up
        self.checked = 0.0
        self.parts: dict[str, bool | None] = {}

    async def read(self) -> dict[str, bool | None]:
        if time.monotonic() - self.checked > HEALTH_TTL_S:
            self.parts = await self.check()
            self.checked = time.monotonic()
        return self.parts

    async def check(self) -> dict[str, bool | None]:
        # vLLM's /health needs no key: the console is given none (audit L-6).
        vllm = f"{self.settings.vllm_url.rstrip('/')}/health"
        timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as client:
            redis_up, _, proxy_up, vllm_up = await asyncio.gather(
                asyncio.to_thread(self.data.redis_up),
                self.throughput.read(),  # a fresh enough scrape of the proxy
                _ok(client, f"{proxy_url(self.settings)}/healthz"),
                _ok(client, vllm),
            )
        return {
            "Redis": redis_up,
            "proxy": proxy_up,
            "vLLM": vllm_up,
            "Kafka": self.throughput.kafka_up(),
        }


async def _ok(client: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with client.get(url) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False

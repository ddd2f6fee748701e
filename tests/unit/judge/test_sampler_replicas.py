"""The judge's own choice of replica (judge/sampler.py over ratchet.fleet.Replicas) under the
proxy's ejection policy: a group names the replica that sampled it; a replica that accepts
connections and never answers (a stalled engine: a fault the stand-in vLLM cannot show, so a
raw socket that reads and never writes) or answers 5xx is ejected after its consecutive
failures and the next groups go elsewhere; a request that never connected goes to another
replica, up to the retries allowed, and one that reached vLLM is never sent again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from embedded.processes import free_port
from judge.sampler import SampledGroup, SamplingError, sample_from
from ratchet.ejection import EjectionPolicy
from ratchet.fleet import Replicas, choose, preference
from ratchet.replica_calls import never_connected, replica_fault
from ratchet.settings import RatchetSettings
from tests.unit.embedded.keyed_vllm import KeyedVllm, keyed_vllm

KEY = "vllm-key"
PROMPT = [{"role": "user", "content": "q"}]
TIMEOUT_S = 0.5  # the sampling's deadline: past it a hung replica's request has failed


@contextmanager
def good_vllm() -> Iterator[KeyedVllm]:
    with keyed_vllm(KEY) as vllm:
        yield vllm


@asynccontextmanager
async def hung_replica() -> AsyncIterator[tuple[str, list[int]]]:
    """A replica that accepts connections and reads requests but never answers; the list
    counts the connections it took."""
    taken: list[int] = []
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(1)
        held.append(writer)
        await reader.read(65536)  # the request arrives; nothing is ever sent back

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", taken
    finally:
        for writer in held:
            writer.close()
        server.close()


@asynccontextmanager
async def failing_replica(status: int) -> AsyncIterator[tuple[str, list[int]]]:
    """A replica that answers every request with ``status``."""
    taken: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        taken.append(1)
        return web.json_response({"error": "engine dead"}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", taken
    finally:
        await runner.cleanup()


def served_name_first_on(first: str, fleet: list[str]) -> str:
    """A served name the ring sends to ``first`` before the others."""
    return next(f"support@v{i}" for i in range(200) if choose(f"support@v{i}", fleet, {}) == first)


async def sample(replicas: Replicas, served: str) -> SampledGroup:
    body: dict[str, Any] = {"model": served, "messages": PROMPT, "n": 2, "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        return await sample_from(replicas, session, body, TIMEOUT_S, KEY)


def policy(failures: int) -> EjectionPolicy:
    return EjectionPolicy(consecutive_failures=failures, base_s=60.0, max_s=60.0)


def test_the_replicas_follow_the_proxys_settings() -> None:
    settings = RatchetSettings.model_validate(
        {
            "vllm_endpoints": ["http://vllm:8000"],
            "proxy": {
                "upstream_retries": 1,
                "upstream_connect_timeout_s": 0.7,
                "outlier_ejection": {"consecutive_failures": 3, "max_ejection_percent": 100},
            },
        }
    )
    replicas = Replicas.from_settings(settings)
    assert replicas.outliers.policy == EjectionPolicy(3, 30.0, 300.0, 100.0)
    assert (replicas.retries, replicas.connect_timeout_s) == (1, 0.7)
    assert replicas.resolver is not None and replicas.urls == ["http://vllm:8000"]


def test_a_hung_replica_is_ejected_after_its_failures_and_its_groups_go_elsewhere() -> None:
    async def scenario(good: KeyedVllm) -> None:
        async with hung_replica() as (hung, taken):
            fleet = [hung, good.url]
            replicas = Replicas(fleet, resolve=False, ejection=policy(2), retries=2)
            ejected: list[str] = []
            replicas.on_ejected = ejected.append  # the judge's metric
            served = served_name_first_on(hung, fleet)
            for attempt in range(2):
                with pytest.raises(SamplingError) as failed:
                    await sample(replicas, served)
                # It reached vLLM and timed out: counted against the replica, not sent again.
                assert failed.value.replica_fault and not failed.value.never_connected
                assert len(taken) == attempt + 1 and not good.authorized()
            assert replicas.outliers.is_ejected(hung, time.monotonic()) and ejected == [hung]
            group = await sample(replicas, served)
            assert group.replica == good.url and len(taken) == 2
            assert replicas.outstanding[hung] == 0 and replicas.outstanding[good.url] == 0

    with good_vllm() as good:
        asyncio.run(scenario(good))


def test_a_replica_answering_5xx_is_ejected_and_a_4xx_is_not_its_fault() -> None:
    async def scenario(good: KeyedVllm) -> None:
        async with failing_replica(503) as (broken, taken):
            fleet = [broken, good.url]
            replicas = Replicas(fleet, resolve=False, ejection=policy(2))
            served = served_name_first_on(broken, fleet)
            for _ in range(2):
                with pytest.raises(SamplingError) as failed:
                    await sample(replicas, served)
                assert failed.value.cause == "http_503" and failed.value.replica_fault
            assert (await sample(replicas, served)).replica == good.url and len(taken) == 2
        async with failing_replica(400) as (refusing, _):
            fleet = [refusing, good.url]
            replicas = Replicas(fleet, resolve=False, ejection=policy(1))
            with pytest.raises(SamplingError) as failed:
                await sample(replicas, served_name_first_on(refusing, fleet))
            assert failed.value.cause == "http_400" and not failed.value.replica_fault
            assert replicas.outliers.replicas.get(refusing) is None

    with good_vllm() as good:
        asyncio.run(scenario(good))


def test_a_request_that_never_connected_goes_to_another_replica_within_the_retries() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def scenario(good: KeyedVllm) -> None:
        fleet = [*dead, good.url]
        served = next(
            f"support@v{i}"
            for i in range(500)
            if set(preference(f"support@v{i}", tuple(sorted(fleet)))[:2]) == set(dead)
        )
        # Two dead replicas before the live one: one retry is not enough, two are.
        one = Replicas(fleet, resolve=False, ejection=policy(5), retries=1)
        with pytest.raises(SamplingError) as failed:
            await sample(one, served)
        assert failed.value.never_connected and not good.authorized()
        assert set(one.failed_until) == set(dead)
        two = Replicas(fleet, resolve=False, ejection=policy(5), retries=2)
        group = await sample(two, served)
        assert group.replica == good.url and len(good.authorized()) == 1
        # A replica that could not be reached is left out of the next choice.
        assert (await sample(two, served)).replica == good.url

    with good_vllm() as good:
        asyncio.run(scenario(good))


def test_a_request_stops_once_every_replica_in_its_versions_rotation_refused_it() -> None:
    """The replica out of the version's rotation is never chosen, so the retries end once the
    others were tried: not one more choice of a tried replica, again and again."""
    fleet = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]

    async def scenario() -> None:
        replicas = Replicas(fleet, resolve=False, ejection=policy(5))
        replicas.exclusions.add("support", 1, {fleet[2]: "could not load it"})
        with pytest.raises(SamplingError) as failed:
            await asyncio.wait_for(sample(replicas, "support@v1"), 5)
        assert failed.value.never_connected
        assert set(replicas.failed_until) == set(fleet[:2])

    asyncio.run(scenario())


def test_what_counts_against_a_replica() -> None:
    refused = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "refused"),
    )
    assert never_connected(refused) and replica_fault(refused)
    assert never_connected(aiohttp.ConnectionTimeoutError()) and replica_fault(TimeoutError())
    assert not never_connected(TimeoutError()) and not never_connected(
        aiohttp.ServerDisconnectedError()
    )
    # A connection lost on the way is most often a stale keep-alive: not the replica's fault.
    assert not replica_fault(aiohttp.ServerDisconnectedError())

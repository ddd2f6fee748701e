"""The real embedded parts for integration tests: Tansu, Redis, vLLM (CPU, SmolLM2) and the proxy.

One stack per test session, on free ports under a temporary home, started by the same code as
`ratchet up`; every test that needs a vLLM, Tansu or Redis uses it (test_up's `ratchet up` is
the one that starts its own, while this one starts). Under pytest-xdist (`scripts/test` runs two
workers, whole modules each) every worker is a session with its own stack, so no test shares a
proxy, a broker or a gauge with another worker's. The converted model is cached in the default
Ratchet home so later runs skip it. Tests that stop parts (faults) are marked ``disruptive`` and
run last on their worker (pytest_collection_modifyitems).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from xdist.scheduler import LoadScopeScheduling

from embedded.adapters import write_random_adapters
from embedded.model import prepare_model
from embedded.processes import Stack, free_port, wait_until
from embedded.stack import create_topics, embedded_stack
from ratchet.bus import make_consumer
from ratchet.records import Record, decode
from ratchet.registry import AliasRoute, RegistryWriter
from ratchet.secrets import server_secret, vllm_api_key
from ratchet.settings import RatchetSettings, default_home, load_settings
from ratchet.store import AdapterStore
from tests.integration import module_seconds

if TYPE_CHECKING:
    from tests.integration.test_learner import BasePolicy

ALIAS = "support"
BASE_MODEL = "smollm2-135m-instruct"


def ratchet_cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`ratchet ARGS` as a user runs it, its output unwrapped (rich wraps at the terminal's
    width, which a captured run does not have)."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "COLUMNS": "1000"},
    )


# Fixed, so which prompts the judge holds out is the same in every run (the loop test relies
# on how many of its prompts are held out).
TEST_SECRET = "ratchet-integration-tests"


# Modules that use the session's `policy` and `base_answers` (the HF base model and its
# answers, a minute to build): on one worker they are built once.
SHARE_A_WORKER = ("test_learner.py", "test_console.py", "test_learner_ranks.py")


def worker_groups(seconds: dict[str, float], workers: int) -> dict[str, int]:
    """Module -> worker index: longest-processing-time first, each module (SHARE_A_WORKER as one)
    to the worker with the least work so far."""
    units: dict[str, list[str]] = {}
    for name in seconds:
        units.setdefault("shared" if name in SHARE_A_WORKER else name, []).append(name)
    load = [0.0] * workers
    group: dict[str, int] = {}
    for modules in sorted(units.values(), key=lambda ms: (-sum(seconds[m] for m in ms), ms)):
        least = load.index(min(load))
        load[least] += sum(seconds[m] for m in modules)
        group.update((m, least) for m in modules)
    return group


def module_of(nodeid: str) -> str:
    """The module file name of a test id (tests/integration/test_x.py::test_y -> test_x.py)."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def seconds_of(modules: set[str]) -> dict[str, float]:
    measured = module_seconds.load()
    return {name: measured.get(name, module_seconds.UNKNOWN_S) for name in modules}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order each worker runs its tests in: tests without the shared stack first, while it
    starts (see embedded_start), then the longest modules (module_seconds.json), and the ones
    that stop parts of the stack (marked ``disruptive``) after every other."""
    seconds = seconds_of({item.path.name for item in items})
    items.sort(
        key=lambda item: (
            item.get_closest_marker("disruptive") is not None,
            "embedded" in item.fixturenames,
            -seconds[item.path.name],
            item.path.name,
        )
    )


class MeasuredModuleScheduling(LoadScopeScheduling):
    """`--dist loadfile` for this lane: one work unit per worker, the modules split between them
    by their measured seconds (worker_groups), each run in collection order. xdist's own
    loadfile hands a worker a second module as soon as it has two tests pending, so two long
    modules could queue on one worker; and its loadgroup does not group under pytest 9 (it
    renames a test's `_nodeid`, which pytest 9 no longer reads)."""

    worker_of: dict[str, int] | None = None

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed:
            collected = next(iter(self.registered_collections.values()))
            # Run beside other folders' tests, it is plain loadfile.
            if all(nodeid.startswith("tests/integration/") for nodeid in collected):
                modules = {module_of(nodeid) for nodeid in collected}
                self.worker_of = worker_groups(seconds_of(modules), len(self.nodes))
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        if self.worker_of is None:
            return nodeid.split("::", 1)[0]
        return f"worker{self.worker_of[module_of(nodeid)]}"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadfile":
        return MeasuredModuleScheduling(config, log)
    return None


@dataclass
class Embedded:
    settings: RatchetSettings
    config_path: Path
    stack: Stack
    model_path: Path
    proxy_url: str

    @property
    def registry(self) -> RegistryWriter:
        return RegistryWriter(self.settings.redis_url, self.settings.aliases)

    def set_route(self, **changes: Any) -> AliasRoute:
        registry = self.registry
        route = registry.read(ALIAS)
        assert route is not None
        return registry.write(replace(route, **changes))

    def find_records(
        self, topic: str, match: Callable[[Record], bool], count: int = 1, timeout_s: float = 30
    ) -> list[Record]:
        """Read `topic` from the start until `count` records satisfy `match`, and on to the
        topic's end: a caller that unpacks exactly `count` records also proves no duplicate was
        logged (a spool replayed twice, a rating sent twice)."""
        consumer = make_consumer(
            self.settings.kafka_bootstrap_servers,
            self.settings.kafka,
            [topic],
            None,
            consumer_timeout_ms=1000,
        )
        found: list[Record] = []
        deadline = time.monotonic() + timeout_s
        try:
            # The inner loop ends after a second with no message, at the topic's end.
            while time.monotonic() < deadline and len(found) < count:
                for message in consumer:
                    record = decode(message.topic, message.value)
                    if record is not None and match(record):
                        found.append(record)
        finally:
            consumer.close()
        return found

    def live_version(self) -> int:
        """The version the proxy says it serves for ALIAS (other tests add other aliases)."""
        card = httpx.get(f"{self.proxy_url}/v1/models/{ALIAS}").json()
        return int(card["ratchet"]["active_version"])

    @property
    def vllm_headers(self) -> dict[str, str]:
        return vllm_headers(self.settings)

    @property
    def secret(self) -> bytes:
        return server_secret(self.settings)

    def proxy_route(self, alias: str) -> dict[str, Any] | None:
        """The route the proxy holds for `alias` (its model card), None while it knows none."""
        response = httpx.get(f"{self.proxy_url}/v1/models/{alias}", timeout=10)
        return response.json()["ratchet"] if response.status_code == 200 else None

    def wait_for_proxy_route(
        self, alias: str = ALIAS, timeout_s: float = 10, **expected: Any
    ) -> None:
        """Wait until the proxy has heard of a registry change on its channel: it knows `alias`
        and its card shows every `expected` field (active_version=1, canary_version=None, ...)."""

        def seen() -> bool:
            route = self.proxy_route(alias)
            return route is not None and all(route[k] == v for k, v in expected.items())

        wait_until(seen, timeout_s, f"the proxy to route {alias} as {expected}")

    def sample(self, name: str, **labels: str) -> float:
        """The sum of the proxy's samples called `name` whose labels include `labels`."""
        text = httpx.get(f"{self.proxy_url}/metrics").text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def vllm_headers(settings: RatchetSettings) -> dict[str, str]:
    """What a direct call to the stack's vLLM must send: vLLM requires its key."""
    return {"Authorization": f"Bearer {vllm_api_key(settings)}"}


def write_test_adapters(model_path: Path, store: AdapterStore, versions: list[int]) -> None:
    """Real LoRA adapters of ALIAS (random weights, so each version answers differently)."""
    write_random_adapters(model_path, store, ALIAS, versions)


def write_config(home: Path, **proxy: Any) -> tuple[Path, dict[str, Any]]:
    config = {
        "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "vllm_url": f"http://127.0.0.1:{free_port()}",
        "home": str(home),
        # One secret for the shared stack and every service a test starts beside it with its
        # own home: the held-out split and vLLM's key derive from it.
        "secret": TEST_SECRET,
        "proxy": {
            "host": "127.0.0.1",
            "port": free_port(),
            "redact_patterns": [r"[\w.+-]+@[\w-]+\.[\w.]+"],
            # The tests check which arm and version answered.
            "expose_arm": True,
            **proxy,
        },
        "console": {"port": free_port()},
        "aliases": {ALIAS: {"base_model": BASE_MODEL}},
    }
    path = home / "ratchet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def start_embedded(tmp_path_factory: pytest.TempPathFactory) -> Embedded:
    home = tmp_path_factory.mktemp("home")
    model_path = prepare_model(default_home(), quiet=True)
    config_path, config = write_config(home)
    # What vLLM serves: every judge and learner started on this config needs it.
    config["learner"] = {"base_model_path": str(model_path)}
    config_path.write_text(yaml.safe_dump(config))
    settings = load_settings(config_path)
    assert settings.store_dir is not None
    write_test_adapters(model_path, AdapterStore(settings.store_dir), [1, 2])
    # The judge runs only in its own tests: its CPU load would skew the proxy's.
    stack = embedded_stack(settings, config_path, model_path, services=("proxy",))
    stack.start()
    try:
        create_topics(settings)
        # vLLM's first generation on CPU compiles kernels; pay that once here, not in a test.
        for model in (BASE_MODEL, f"{ALIAS}@v1", f"{ALIAS}@v2"):
            httpx.post(
                f"{settings.vllm_url}/v1/chat/completions",
                headers=vllm_headers(settings),
                timeout=300,
                json={
                    "model": model,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ).raise_for_status()
    except BaseException:
        stack.stop()
        raise
    proxy_url = f"http://127.0.0.1:{settings.proxy.port}"
    return Embedded(settings, config_path, stack, model_path, proxy_url)


@pytest.fixture(scope="session", autouse=True)
def embedded_start(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[Embedded] | None]:
    """Starts the shared stack in a thread as the session begins, if any test uses it, so the
    tests that need none (`ratchet up`'s own stack, run first) overlap its start."""
    if not any("embedded" in item.fixturenames for item in request.session.items):
        yield None
        return
    # The session's temporary folder is made here, before the thread: two threads making it
    # at once (this one and a first test's tmp_path) can each make one, and mktemp then fails.
    tmp_path_factory.getbasetemp()
    with ThreadPoolExecutor(1, thread_name_prefix="embedded-start") as pool:
        started = pool.submit(start_embedded, tmp_path_factory)
        try:
            yield started
        finally:
            if started.exception() is None:
                started.result().stack.stop()


@pytest.fixture(scope="session")
def embedded(embedded_start: Future[Embedded] | None) -> Embedded:
    assert embedded_start is not None
    return embedded_start.result()


@pytest.fixture
def base_route(embedded: Embedded) -> Iterator[Embedded]:
    """Each routing test starts and ends with the alias on v0 and no canary."""
    embedded.set_route(active=0, canary=None, canary_weight=0.0)
    yield embedded
    with contextlib.suppress(Exception):
        embedded.set_route(active=0, canary=None, canary_weight=0.0)


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


@pytest.fixture(scope="session")
def policy(embedded: Embedded) -> BasePolicy:
    """The base model in this process, for the learner tests' hand-made groups (their
    logprobs). Imported here, not at the top: test_learner imports this module."""
    from tests.integration.test_learner import TRAIN, BasePolicy

    policy = BasePolicy(embedded.model_path)
    # The learner trains on these ids: they must be the prompt vLLM itself would see.
    reply = httpx.post(
        f"{embedded.settings.vllm_url}/v1/chat/completions",
        headers=embedded.vllm_headers,
        json={
            "model": BASE_MODEL,
            "messages": TRAIN[0]["messages"],
            "max_tokens": 1,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()
    assert reply["prompt_token_ids"] == policy.prompt_ids(TRAIN[0]["messages"])
    return policy


@pytest.fixture(scope="session")
def base_answers(embedded: Embedded) -> list[str]:
    """The base model's greedy answer to each training prompt (test_learner's TRAIN), from
    vLLM."""
    from tests.integration.test_learner import TRAIN

    async def answer(client: httpx.AsyncClient, prompt: dict[str, Any]) -> str:
        body = {
            "model": BASE_MODEL,
            "messages": prompt["messages"],
            "max_tokens": 64,
            "temperature": 0.0,
        }
        reply = await client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        return reply.json()["choices"][0]["message"]["content"] or ""

    async def answer_all() -> list[str]:
        async with httpx.AsyncClient(
            base_url=embedded.settings.vllm_url, headers=embedded.vllm_headers, timeout=120
        ) as client:
            return list(await asyncio.gather(*(answer(client, p) for p in TRAIN)))

    return asyncio.run(answer_all())

"""`ratchet demo`: replay the demo prompts through the proxy as users would, rating each answer."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from cli.app import ConfigOption, app, console, settings_or_exit
from ratchet.settings import RatchetSettings

if TYPE_CHECKING:  # imported when the command runs: the CLI starts without it
    import aiohttp


@app.command()
def demo(
    alias: Annotated[str, typer.Option(help="alias to send the demo prompts to")] = "demo",
    count: Annotated[int, typer.Option(help="prompts to send (the set repeats if larger)")] = 200,
    rounds: Annotated[int, typer.Option(help="times to replay the prompts")] = 1,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 4,
    feedback: Annotated[
        bool,
        typer.Option(help="rate each answer with its verifier score via /v1/feedback, as a user"),
    ] = True,
    config: ConfigOption = None,
) -> None:
    """Replay the bundled demo prompts through the proxy as traffic, and score the answers.

    Prints the demo verifier's mean score per version that answered, so a promotion shows up as
    a new row with a higher score. Each score also goes back as user feedback, which is what a
    canary is judged by. While a canary runs the proxy does not tell clients which version
    answered (proxy.expose_arm): the demo reads it from the proxy's traffic records.

    With API keys on, the demo's key is read from RATCHET_DEMO_API_KEY: there is no option for
    it, so it never shows in `ps` or the shell's history.
    """
    settings = settings_or_exit(config)
    if alias not in settings.aliases:
        console.print(f"[red]alias {alias!r} is not in ratchet.yaml[/red]")
        raise typer.Exit(2)
    from tasks.demo import load_prompts

    prompts = load_prompts()
    work = [prompts[i % len(prompts)] for i in range(count)] * rounds
    base_url = f"http://{settings.proxy.host}:{settings.proxy.port}/v1"
    api_key = os.environ.get("RATCHET_DEMO_API_KEY", "unused")
    replay = DemoReplay(alias, base_url, api_key, concurrency, feedback)
    tail = TrafficTail(settings)  # before the first request: its records come after this
    try:
        replay.run(work)
        if replay.concealed:
            replay.resolve(tail.served_names(set(replay.concealed), CONCEALED_WAIT_S))
    finally:
        tail.close()
    table = Table(title=f"{alias}: demo verifier score by version that answered")
    for column in ("served as", "answers", "mean score"):
        table.add_column(column)
    for served, values in sorted(replay.scores.items()):
        table.add_row(served, str(len(values)), f"{sum(values) / len(values):.3f}")
    console.print(table)
    if replay.failures:
        console.print(
            f"[yellow]{len(replay.failures)} requests failed, e.g. {replay.failures[0]}[/yellow]"
        )


# An answer on the CPU stack can wait behind the judge's sampling for minutes: as long as the
# OpenAI client's default. A rating is one Redis and one Kafka write.
ANSWER_TIMEOUT_S = 600.0
RATING_TIMEOUT_S = 30.0
RATE_ATTEMPTS = 3
RETRY_AFTER_CAP_S = 5.0  # the proxy asks 1-5 s; a demo waits no longer whatever it is told


class DemoReplay:
    """Sends each prompt as a user would and scores the answer with the demo verifier, by the
    version that served it; with ``feedback``, the score goes back as the user's rating."""

    def __init__(
        self, alias: str, base_url: str, api_key: str, concurrency: int, feedback: bool
    ) -> None:
        self.alias = alias
        self.base_url = base_url
        self.api_key = api_key
        self.concurrency = concurrency
        self.feedback = feedback
        self.scores: dict[str, list[float]] = {}
        self.failures: list[str] = []
        # Answered during a canary, version not told: completion id -> score, until resolved.
        self.concealed: dict[str, float] = {}

    def run(self, work: list[dict[str, Any]]) -> None:
        import asyncio

        from rich.progress import Progress

        with Progress(console=console) as progress:
            task = progress.add_task(f"Sending demo traffic to {self.alias}", total=len(work))
            asyncio.run(self.replay(work, lambda: progress.advance(task)))

    async def replay(self, work: list[dict[str, Any]], advance: Callable[[], None]) -> None:
        import asyncio

        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"}
        timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
        limit = asyncio.Semaphore(self.concurrency)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:

            async def one(prompt: dict[str, Any]) -> None:
                async with limit:
                    await self.ask(session, prompt["messages"])
                advance()

            await asyncio.gather(*(one(p) for p in work))

    async def ask(self, session: aiohttp.ClientSession, messages: list[Any]) -> None:
        import orjson

        from tasks.demo import extraction_reward

        request = {"model": self.alias, "messages": messages, "max_tokens": 64, "temperature": 0.0}
        reply = await self.post(session, "/chat/completions", request)
        if isinstance(reply, str) or reply.status != 200:
            self.failures.append(str(reply)[:200])
            return
        completion = orjson.loads(reply.text)
        served = reply.headers.get("x-ratchet-served-name")
        sample = {"role": "assistant", "content": completion["choices"][0]["message"]["content"]}
        score = extraction_reward(messages, sample)
        if served is None:
            self.concealed[completion["id"]] = score
        else:
            self.scores.setdefault(served, []).append(score)
        if self.feedback:
            await self.rate(session, completion["id"], score)

    def resolve(self, served: dict[str, str]) -> None:
        """Credit each concealed answer to the version its traffic record names ("?" for one
        whose record did not arrive in time)."""
        for completion_id, score in self.concealed.items():
            self.scores.setdefault(served.get(completion_id, "?"), []).append(score)
        self.concealed = {}

    async def rate(self, session: aiohttp.ClientSession, completion_id: str, score: float) -> None:
        rating = {"completion_id": completion_id, "score": score}
        reply = await self.post(session, "/feedback", rating, RATING_TIMEOUT_S)
        if isinstance(reply, str) or reply.status != 200:
            self.failures.append(f"feedback: {reply}"[:200])

    async def post(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> Reply | str:
        """POST as the OpenAI client the demo used to send with does: a lost connection, a 408,
        429 or 5xx (the proxy or vLLM could not take the request just then) is sent again
        after its Retry-After, up to RATE_ATTEMPTS times. The last reply, or what went wrong if
        none came."""
        import asyncio

        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for attempt in range(1, RATE_ATTEMPTS + 1):
            try:
                url = f"{self.base_url}{path}"
                async with session.post(url, json=body, timeout=timeout) as response:
                    reply = Reply(response.status, response.headers.copy(), await response.text())
            except aiohttp.ClientConnectionError as exc:
                if attempt == RATE_ATTEMPTS:
                    return f"{path}: {exc!r}"
                await asyncio.sleep(retry_after_s(None))
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"{path}: {exc!r}"
            if not transient(reply.status) or attempt == RATE_ATTEMPTS:
                break
            await asyncio.sleep(retry_after_s(reply.headers.get("Retry-After")))
        return reply


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # case-insensitive (aiohttp's CIMultiDict)
    text: str

    def __str__(self) -> str:
        return f"{self.status} {self.text}"


def transient(status: int) -> bool:
    """The server could not take the request just then: sent again, as the OpenAI client does
    (not a 409, which the proxy answers a rating it refuses for what it is)."""
    return status in (408, 429) or status >= 500


def retry_after_s(header: str | None) -> float:
    """Seconds a Retry-After header asks for (1 when absent or not a number), capped."""
    try:
        wait = float(header) if header is not None else 1.0
    except ValueError:
        wait = 1.0
    return min(max(wait, 0.0), RETRY_AFTER_CAP_S)


# How long the demo waits for the traffic records of the answers a canary concealed.
CONCEALED_WAIT_S = 30.0


class TrafficTail:
    """The proxy's traffic records from the moment it is made: which version served each
    completion. Kafka unreachable, it knows none."""

    def __init__(self, settings: RatchetSettings) -> None:
        from kafka.errors import KafkaError
        from kafka.structs import TopicPartition

        from ratchet.bus import make_consumer
        from ratchet.records import TRAFFIC_TOPIC

        self.consumer: Any = None
        try:
            consumer = make_consumer(
                settings.kafka_bootstrap_servers, settings.kafka, [], None, consumer_timeout_ms=500
            )
        except KafkaError:
            return
        partitions = [
            TopicPartition(TRAFFIC_TOPIC, p)
            for p in consumer.partitions_for_topic(TRAFFIC_TOPIC) or ()
        ]
        consumer.assign(partitions)
        for partition, offset in consumer.end_offsets(partitions).items():
            consumer.seek(partition, offset)
        self.consumer = consumer

    def served_names(self, completion_ids: set[str], timeout_s: float) -> dict[str, str]:
        """completion id -> the served name (``alias@vN``) of those among ``completion_ids``
        whose records arrive within ``timeout_s``."""
        import time

        from ratchet.records import TrafficRecord, decode

        found: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s

        def done() -> bool:
            return len(found) == len(completion_ids) or time.monotonic() > deadline

        while self.consumer is not None and not done():
            for message in self.consumer:  # stops after consumer_timeout_ms without one
                record = decode(message.topic, message.value)
                if isinstance(record, TrafficRecord) and record.response_id in completion_ids:
                    found[record.response_id] = record.response_model
                if done():
                    break
        return found

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()

"""`ratchet demo`'s tally by version: while a canary runs the proxy does not say which version
answered (proxy.expose_arm is off in every shipped config), so those answers are credited from
the proxy's traffic records."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from typer.testing import CliRunner

from cli import app
from cli.demo import RATE_ATTEMPTS, DemoReplay, retry_after_s
from tasks.demo import load_prompts


def test_concealed_answers_are_credited_to_the_version_their_records_name() -> None:
    replay = DemoReplay("demo", "http://proxy/v1", "unused", 1, feedback=False)
    replay.scores = {"demo@v1": [1.0]}
    replay.concealed = {"c1": 0.5, "c2": 1.0, "c3": 0.0}
    replay.resolve({"c1": "demo@v1", "c2": "demo@v2"})
    assert replay.scores == {"demo@v1": [1.0, 0.5], "demo@v2": [1.0], "?": [0.0]}
    assert replay.concealed == {}


def test_the_packaged_config_does_not_expose_the_arm() -> None:
    text = resources.files("embedded").joinpath("ratchet.yaml").read_text(encoding="utf-8")
    assert "expose_arm" not in (yaml.safe_load(text).get("proxy") or {})


def test_the_demo_takes_its_key_from_the_environment_not_the_command_line() -> None:
    """A key on the command line shows in `ps` and the shell's history (audit L-6)."""
    result = CliRunner().invoke(app, ["demo", "--api-key", "sk-secret"])
    assert result.exit_code == 2 and "No such option" in result.output, result.output


def rated_with(statuses: list[int]) -> tuple[DemoReplay, list[int]]:
    """The demo's rating against a stand-in proxy answering ``statuses`` in turn (a transient
    503 from a real proxy cannot be caused on purpose): the replay and the statuses it got."""
    seen: list[int] = []

    async def answer(_: web.Request) -> web.Response:
        status = statuses[len(seen)]
        seen.append(status)
        return web.json_response({"status": status}, status=status, headers={"retry-after": "0"})

    async def run() -> DemoReplay:
        app = web.Application()
        app.router.add_post("/v1/feedback", answer)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            replay = DemoReplay("demo", str(server.make_url("/v1")), "unused", 1, feedback=True)
            await replay.rate(session, "chatcmpl-1", 0.5)
        return replay

    return asyncio.run(run()), seen


def test_an_answer_is_scored_by_the_version_that_served_it_and_rated() -> None:
    """The whole exchange against a stand-in proxy: the key goes in the header, the score goes
    back as the rating of that completion."""
    asked: list[tuple[str, str | None, dict[str, Any]]] = []

    async def chat(request: web.Request) -> web.Response:
        asked.append((request.path, request.headers.get("authorization"), await request.json()))
        answer = {"id": "chatcmpl-7", "choices": [{"message": {"content": "x"}}]}
        return web.json_response(answer, headers={"x-ratchet-served-name": "demo@v2"})

    async def feedback(request: web.Request) -> web.Response:
        asked.append((request.path, request.headers.get("authorization"), await request.json()))
        return web.json_response({"status": "ok"})

    async def run() -> DemoReplay:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/feedback", feedback)
        async with TestServer(app) as server:
            replay = DemoReplay("demo", str(server.make_url("/v1")), "sk-demo", 1, feedback=True)
            await replay.replay(load_prompts()[:1], lambda: None)
        return replay

    replay = asyncio.run(run())
    assert replay.failures == [] and list(replay.scores) == ["demo@v2"]
    (chat_path, chat_key, request), (rate_path, rate_key, rating) = asked
    assert (chat_path, rate_path) == ("/v1/chat/completions", "/v1/feedback")
    assert chat_key == rate_key == "Bearer sk-demo"
    assert request["model"] == "demo" and request["max_tokens"] == 64
    assert rating == {"completion_id": "chatcmpl-7", "score": replay.scores["demo@v2"][0]}


def test_a_rating_the_proxy_could_not_check_just_then_is_sent_again() -> None:
    replay, seen = rated_with([503, 200])
    assert seen == [503, 200] and replay.failures == []
    replay, seen = rated_with([503] * RATE_ATTEMPTS)
    assert len(seen) == RATE_ATTEMPTS and replay.failures[0].startswith("feedback: 503")
    # As the OpenAI client: a 500 or 408 is sent again too; a 400 is the request's fault.
    replay, seen = rated_with([500, 408, 200])
    assert seen == [500, 408, 200] and replay.failures == []
    replay, seen = rated_with([400, 200])
    assert seen == [400] and replay.failures[0].startswith("feedback: 400")
    replay, seen = rated_with([409])  # refused for what it is: not sent again
    assert seen == [409] and replay.failures[0].startswith("feedback: 409")


def test_retry_after_is_read_and_capped() -> None:
    assert retry_after_s("2") == 2.0 and retry_after_s(None) == 1.0
    assert retry_after_s("soon") == 1.0 and retry_after_s("3600") == 5.0
    assert retry_after_s("-4") == 0.0

"""A replica the served check cannot reach is not excluded (learner/served_check.py): only
vLLM's own 404/400 about the adapter takes a replica out of a version's rotation; a refused
connection, a 5xx or a 429 leaves it unchecked, asked again within ``wait_s``. And an excluded
replica that now loads the version is let back in (learner/readmission.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from learner.readmission import reprobe
from learner.served_check import ServedCheck, ServedVerdict
from ratchet.registry import AliasRoute
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore
from ratchet.version_exclusion import exclude, read_excluded

OK_BODY = {"choices": [{"index": 0, "text": "x"}]}


class Replica:
    """A fake vLLM replica answering a script of statuses, then 200: faults (503, 429, a
    restart) the real CPU build cannot be made to give on demand."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.asked = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                status = owner.statuses.pop(0) if owner.statuses else 200
                owner.asked += 1
                body = OK_BODY if status == 200 else {"error": {"message": f"status {status}"}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    for replica in made:
        replica.server.shutdown()
        replica.server.server_close()


def verdict_of(urls: list[str], wait_s: float) -> ServedVerdict:
    check = ServedCheck("key", timeout_s=5.0, wait_s=wait_s, limit=0.01)
    return asyncio.run(check.verdict(urls, "support@v3", None))


def test_only_vllms_404_or_400_excludes_and_an_unreachable_replica_is_left_to_ejection(
    replicas: list[Replica],
) -> None:
    good, missing, broken, busy = (Replica(s) for s in ([], [404] * 9, [400] * 9, [503] * 9))
    replicas += [good, missing, broken, busy]
    refused = "http://127.0.0.1:1"  # nothing listens there
    verdict = verdict_of([good.url, missing.url, broken.url, busy.url, refused], wait_s=0)
    assert verdict.passed
    assert {c.replica for c in verdict.excluded} == {missing.url, broken.url}
    assert {c.replica for c in verdict.unchecked} == {busy.url, refused}
    assert f"{busy.url} not checked, unreachable: HTTP 503" in verdict.reason
    assert f"{refused} not checked, unreachable: " in verdict.reason
    only_unreachable = verdict_of([good.url, refused], wait_s=0)
    assert only_unreachable.passed and only_unreachable.excluded == ()
    assert "left to the outlier ejection" in only_unreachable.reason


def test_a_replica_restarting_or_overloaded_is_asked_again_and_passes(
    replicas: list[Replica],
) -> None:
    restarting = Replica([503, 429])
    replicas.append(restarting)
    verdict = verdict_of([restarting.url], wait_s=30)
    assert verdict.passed and not verdict.failed
    assert restarting.asked == 3


def test_an_excluded_replica_that_loads_the_version_now_is_let_back_in(
    replicas: list[Replica], redis_url: str, tmp_path: Path
) -> None:
    healed, still = Replica([]), Replica([404] * 9)
    replicas += [healed, still]
    client = redis.Redis.from_url(redis_url)
    reasons = {healed.url: "HTTP 404", still.url: "HTTP 404"}
    exclude(client, "reprobed", 3, reasons, ttl_s=3600)
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path)
    route = AliasRoute(alias="reprobed", base_model="base", active=3)
    back = reprobe(settings, client, AdapterStore(tmp_path / "store"), [route])
    assert back == {("reprobed", 3): [healed.url]}
    assert list(read_excluded(client, "reprobed", 3)) == [still.url]
    # Nothing excluded: nothing asked.
    assert reprobe(settings, client, AdapterStore(tmp_path), [AliasRoute("x", "base")]) == {}

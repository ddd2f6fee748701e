"""The console against a real Redis and adapter store, through its HTTP routes: what the pages
show, who may read and act, and that an action is the CLI's lifecycle change with the console
as its actor. (tests/integration/test_console.py drives it in a real browser.)"""

from __future__ import annotations

import itertools
import re
from html import escape
from pathlib import Path

import pytest

from console.app import safe_next
from console.auth import COOKIE
from console.render import rounds_svg
from console.traffic import KEPT, PENDING_RATINGS, RecentTraffic
from ratchet.lifecycle import Lifecycle
from ratchet.records import FeedbackRecord, TrafficRecord
from ratchet.reward_guard_state import GuardResult, write_guard
from ratchet.rounds import RoundRow
from ratchet.settings import ConfigError, RatchetSettings
from tests.unit.console.conftest import ALIAS, KEY, client_for, make_settings


def test_the_overview_lists_every_alias_with_its_versions(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    page = client_for(settings).get("/")
    assert page.status_code == 200
    html = page.text
    assert 'data-testid="active-support">v1<' in html
    assert 'data-testid="canary-support">v2<' in html and "25%" in html
    assert 'href="/alias/other"' in html
    assert KEY not in html


def test_a_reward_guard_that_could_not_check_is_shown_for_the_canary_and_once_promoted(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """Audit N-15: the guard let a canary through silently when too few raters had rated it;
    its "could not check" is on the overview and the alias page, for the canary and, after
    the promotion, for the version it let through."""
    client = client_for(settings)
    assert "reward guard" not in client.get("/").text
    said = "could not check: too few raters (3 < 10 held-out rated answers on the canary arm)"
    write_guard(lifecycle.writer.redis, ALIAS, 2, GuardResult("unchecked", said))
    for page in ("/", f"/alias/{ALIAS}"):
        html = client.get(page).text
        assert f'data-testid="reward-guard-{ALIAS}">reward guard on v2: {escape(said)}<' in html
    lifecycle.promote(ALIAS, 2)
    assert f"reward guard on v2: {escape(said)}" in client.get(f"/alias/{ALIAS}").text
    write_guard(lifecycle.writer.redis, ALIAS, 7, GuardResult("unchecked", said))
    assert "reward guard" not in client.get("/").text  # another version's: not this alias's now


def test_the_alias_page_shows_lineage_rounds_plot_and_the_gates_pairs(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    html = client_for(settings).get(f"/alias/{ALIAS}").text
    assert re.search(r"v1</span> from v0\s*<span class=\"badge ok\">live", html)
    assert re.search(r"v2</span> from v1\s*<span class=\"badge warn\">canary", html)
    assert "trained on 64 groups" in html and "over 2 round(s)" in html
    assert "<svg" in html and "Training reward and gate win rate per round" in html
    assert "0.700 [0.500, 0.800]" in html  # v2's gate in the rounds table
    assert "0.200 [0.100, 0.300]" in html  # and its score lift
    assert 'data-testid="gate-pairs-v2"' in html
    assert "Sort 3 1 2" in html and ">1 2 3</pre>" in html and ">3 2 1</pre>" in html
    assert "candidate better" in html
    # Headings in order: one h1, then h2s, h3s under them.
    levels = [int(n) for n in re.findall(r"<h([1-6])", html)]
    assert levels[0] == 1 and levels.count(1) == 1
    assert all(b <= a + 1 for a, b in itertools.pairwise(levels))
    # Every form control has a label.
    for control in re.findall(r'<input[^>]*id="([^"]+)"', html):
        assert f'for="{control}"' in html, control


def test_an_action_without_the_admin_key_is_refused(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    refused = client.post(f"/alias/{ALIAS}/rollback", data={"confirm": "yes"})
    assert refused.status_code == 403
    bad_key = client.post(
        f"/alias/{ALIAS}/rollback",
        data={"confirm": "yes"},
        headers={"authorization": "Bearer wrong"},
    )
    assert bad_key.status_code == 403
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary == 2


def test_an_action_needs_its_confirmation_then_is_the_lifecycle_change_by_the_console(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    admin = {"authorization": f"Bearer {KEY}"}
    unconfirmed = client.post(
        f"/alias/{ALIAS}/rollback", data={}, headers=admin, follow_redirects=False
    )
    assert unconfirmed.status_code == 303 and "refused=" in unconfirmed.headers["location"]
    done = client.post(
        f"/alias/{ALIAS}/rollback",
        data={"confirm": "yes", "reason": "users complain"},
        headers=admin,
        follow_redirects=False,
    )
    assert done.headers["location"] == f"/alias/{ALIAS}?done=rollback"
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and (route.active, route.canary) == (1, None)
    event = lifecycle.writer.history(ALIAS)[0]
    assert (event["kind"], event["actor"]) == ("rollback", "console (admin key from testclient)")
    assert event["detail"]["reason"] == "users complain"
    page = client.get(done.headers["location"])
    assert "rollback: done" in page.text


def test_login_sets_an_http_only_strict_session_and_never_echoes_the_key(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    wrong = client.post("/login", data={"key": "nope", "next": "/"})
    assert wrong.status_code == 401 and "not the admin key" in wrong.text
    ok = client.post("/login", data={"key": KEY, "next": f"/alias/{ALIAS}"}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == f"/alias/{ALIAS}"
    cookie = ok.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert KEY not in cookie
    # The session acts: the canary's weight, through the CLI's routing change.
    weighed = client.post(f"/alias/{ALIAS}/weight", data={"confirm": "yes", "weight": "0.5"})
    assert weighed.status_code == 200 and "weight: done" in weighed.text
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and route.canary_weight == 0.5
    assert lifecycle.writer.history(ALIAS)[0]["actor"].startswith("console (session ")
    assert KEY not in weighed.text


def test_a_form_posted_from_another_site_is_refused(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    response = client_for(settings).post(
        f"/alias/{ALIAS}/pause",
        data={"confirm": "yes", "reason": "x"},
        headers={"authorization": f"Bearer {KEY}", "origin": "https://evil.example"},
    )
    assert response.status_code == 403
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and not route.paused


def test_off_loopback_reading_needs_the_admin_key_too(redis_url: str, tmp_path: Path) -> None:
    settings = make_settings(redis_url, tmp_path, host="0.0.0.0")
    client = client_for(settings)
    assert client.get("/", follow_redirects=False).headers["location"] == "/login?next=/"
    assert client.get("/live").status_code == 401
    assert client.get("/", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/healthz").status_code == 200  # probes need no key


def test_off_loopback_without_an_admin_key_the_console_refuses_to_start(
    redis_url: str, tmp_path: Path
) -> None:
    settings = RatchetSettings(redis_url=redis_url, home=tmp_path, console={"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match=r"proxy\.admin_key"):
        settings.check_console_exposure()


def test_unknown_aliases_and_actions_are_404s(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    assert client.get("/alias/nope", headers={"accept": "text/html"}).status_code == 404
    admin = {"authorization": f"Bearer {KEY}"}
    assert client.post(f"/alias/{ALIAS}/explode", headers=admin).status_code == 404


def test_after_login_only_a_path_on_this_console() -> None:
    assert safe_next("/alias/support") == "/alias/support"
    for target in ("https://evil.example/", "//evil.example", "javascript:alert(1)", ""):
        assert safe_next(target) == "/"


def test_the_console_counts_its_requests_and_actions(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    client.get("/")
    client.post(f"/alias/{ALIAS}/resume", data={"confirm": "yes"})
    text = client.get("/metrics").text
    assert 'ratchet_console_requests_total{route="/",status="200"} 1.0' in text
    assert 'ratchet_console_actions_total{action="resume",outcome="unauthorized"} 1.0' in text


def test_the_plot_marks_passed_and_failed_gates() -> None:
    rows = [
        RoundRow(1, "t1", 0.3, 32, 0.7, 0.55, 0.8, 40, True, "promoted"),
        RoundRow(2, "t2", 0.4, 32, 0.45, 0.3, 0.6, 40, False, "rejected"),
    ]
    svg = rounds_svg(rows, 0.5)
    assert svg.startswith("<svg") and svg.count("<circle") == 4  # 2 rewards, 2 win rates
    assert "#166a2e" in svg and "#b42318" in svg and 'role="img"' in svg
    assert rounds_svg([], 0.5) == ""


def exchange(i: int, version: int = 0, arm: str = "active") -> TrafficRecord:
    """The i-th chat exchange of ALIAS, answered by ``version`` on ``arm``."""
    return TrafficRecord(
        request_id=f"r{i}",
        endpoint="chat.completions",
        alias=ALIAS,
        request_model=ALIAS,
        response_model=f"{ALIAS}@v{version}",
        version=version,
        canary_arm=arm,  # type: ignore[arg-type]
        request={"messages": [{"role": "user", "content": f"question {i}"}]},
        response_id=f"chatcmpl-{i}",
        choices=[{"index": 0, "message": {"role": "assistant", "content": f"answer {i}"}}],
        status=200,
        latency_ms=5.0,
    )


def test_recent_traffic_is_searchable_by_completion_id_with_its_rating(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    client = client_for(settings)
    recent = client.app.state.recent  # type: ignore[attr-defined]
    for i, (version, arm) in enumerate(((1, "active"), (2, "canary"), (1, "active"))):
        recent.add(exchange(i, version, arm))
    for cid, score in (("chatcmpl-0", 1.0), ("chatcmpl-1", 0.0), ("chatcmpl-2", 0.5)):
        recent.add(FeedbackRecord(completion_id=cid, score=score))
    recent.add(FeedbackRecord(completion_id="chatcmpl-0", score=0.0))  # a redelivery: ignored
    recent.add(FeedbackRecord(completion_id="never-seen", score=1.0))

    found = client.get(f"/alias/{ALIAS}/traffic", params={"completion_id": "chatcmpl-1"}).text
    assert "question 1" in found and "answer 1" in found and "(canary)" in found
    assert "question 0" not in found and ">0.00</td>" in found
    newest_first = client.get(f"/alias/{ALIAS}/traffic").text
    assert newest_first.index("question 2") < newest_first.index("question 0")
    missing = client.get(f"/alias/{ALIAS}/traffic", params={"completion_id": "nope"}).text
    assert "Not among the exchanges" in missing
    # Mean rating per version, on the overview and the alias page.
    assert "v1: 0.75 (2), v2: 0.00 (1)" in client.get("/").text
    assert "v1: 0.75 (2), v2: 0.00 (1)" in client.get(f"/alias/{ALIAS}").text


def test_the_kept_traffic_is_bounded_per_alias() -> None:
    recent = RecentTraffic({ALIAS})
    for i in range(KEPT + 10):
        recent.add(exchange(i))
    kept = recent.recent(ALIAS)
    assert len(kept) == KEPT and kept[0].completion_id == f"chatcmpl-{KEPT + 9}"
    assert recent.recent(ALIAS, "chatcmpl-0") == [] and len(recent.owner) == KEPT


def test_a_rating_read_before_its_exchange_still_counts() -> None:
    """The console reads both topics at once but not in step: under load the rating can come
    first, and was lost."""
    recent = RecentTraffic({ALIAS})
    recent.add(FeedbackRecord(completion_id="chatcmpl-7", score=1.0))
    recent.add(FeedbackRecord(completion_id="chatcmpl-7", score=0.0))  # a redelivery: ignored
    recent.add(exchange(7, version=3))
    [rated] = recent.recent(ALIAS, "chatcmpl-7")
    assert rated.rating == 1.0
    assert [(r.version, r.ratings, r.mean) for r in recent.ratings(ALIAS)] == [(3, 1, 1.0)]
    # Ratings of ids never served wait in a bounded queue, oldest out first.
    for i in range(PENDING_RATINGS + 5):
        recent.add(FeedbackRecord(completion_id=f"never-{i}", score=1.0))
    assert len(recent.pending) == PENDING_RATINGS and "never-0" not in recent.pending


def test_the_console_refuses_to_promote_a_version_the_gate_never_judged(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """The console has no --force: a version written but never gated stays off."""
    lifecycle.store.write(
        ALIAS, 3, lambda f: (f / "adapter_config.json").write_text("{}"), "/models/base", {}
    )
    client = client_for(settings)
    admin = {"authorization": f"Bearer {KEY}"}
    refused = client.post(
        f"/alias/{ALIAS}/promote",
        data={"confirm": "yes", "version": "3"},
        headers=admin,
        follow_redirects=False,
    )
    assert (
        "refused=" in refused.headers["location"] and "never%20gated" in refused.headers["location"]
    )
    route = lifecycle.writer.read(ALIAS)
    assert route is not None and (route.active, route.canary) == (1, 2)
    # The canary the gate passed is promoted as before.
    done = client.post(
        f"/alias/{ALIAS}/promote", data={"confirm": "yes"}, headers=admin, follow_redirects=False
    )
    assert done.headers["location"] == f"/alias/{ALIAS}?done=promote"


def test_the_rounds_table_shows_each_rounds_served_drift(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """The drift of a round's groups (learner/drift.py), from its candidate event; '-' for a
    round that did not measure it."""
    drift = {"version": 2, "precision": "float32", "mean_abs": 0.0012, "max_abs": 0.01, "tokens": 9}
    detail = {"mean_reward": 0.5, "served_drift": drift}
    lifecycle.record(lifecycle.event(ALIAS, "candidate", version=3, detail=detail))
    html = client_for(settings).get(f"/alias/{ALIAS}").text
    assert 'data-testid="served-drift-v3">0.0012<' in html
    assert 'data-testid="served-drift-v2">-<' in html
    assert "served-drift-replica-v3" not in html  # measured before the drift per replica


def test_the_rounds_table_shows_the_replica_furthest_from_the_learner(
    settings: RatchetSettings, lifecycle: Lifecycle
) -> None:
    """A drift measured per replica (learner/drift.py) shows its worst replica's mean, and
    names it."""

    def measured(mean: float) -> dict[str, float | int]:
        return {"mean_abs": mean, "max_abs": mean * 2, "tokens": 10}

    replicas = {"http://10.0.0.1:8000": measured(0.001), "http://10.0.0.2:8000": measured(0.25)}
    drift = {"version": 2, "precision": "float32", "mean_abs": 0.12, "tokens": 20,
             "replicas": replicas}  # fmt: skip
    detail = {"mean_reward": 0.5, "served_drift": drift}
    lifecycle.record(lifecycle.event(ALIAS, "candidate", version=3, detail=detail))
    html = client_for(settings).get(f"/alias/{ALIAS}").text
    assert 'data-testid="served-drift-v3">0.2500<' in html
    assert ">http://10.0.0.2:8000</small>" in html and "10.0.0.1" not in html

"""The console in a real browser (Debian's Chromium driven by Playwright) against the real
embedded stack: a real learner round puts a candidate on canary through a real gate, and the
console shows it, follows a promotion made by the CLI without a reload, refuses an action
without the admin key, and rolls back from a click that the proxy serves within a second.

Its screenshots go to the test's temporary folder, so a run leaves the tree clean. To renew
docs/console.md's (docs/console-*.png) on purpose, run it with RATCHET_SCREENSHOTS=docs:
``RATCHET_SCREENSHOTS=docs .venv/bin/python -m pytest tests/integration/test_console.py``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from embedded.processes import Stack, wait_until
from embedded.stack import console_part, learner_part
from ratchet.bill import Bill
from ratchet.records import EVENTS_TOPIC, LifecycleEvent
from ratchet.registry import AliasRoute
from ratchet.settings import load_settings
from tests.integration.conftest import BASE_MODEL, Embedded, free_port
from tests.integration.test_learner import (
    SHORT_ROUND_S,
    BasePolicy,
    better_groups,
    heldout_prompts,
    learner_config,
    produce,
    wait_for_outcome,
)

pytestmark = pytest.mark.integration

ALIAS = "ct-console"
ADMIN_KEY = "console-test-admin-key"
ROOT = Path(__file__).resolve().parents[2]
STATUS_CONTRAST = 4.5  # WCAG AA for normal text


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where the screenshots go: the test's temporary folder, or RATCHET_SCREENSHOTS (relative
    to the project root) when renewing docs/console.md's on purpose."""
    chosen = os.environ.get("RATCHET_SCREENSHOTS")
    folder = ROOT / chosen if chosen else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def chromium() -> str:
    found = os.environ.get("RATCHET_CHROMIUM") or shutil.which("chromium")
    if not found:
        pytest.fail("no Chromium: run scripts/bootstrap.sh (it installs Debian's chromium)")
    return found


@pytest.fixture
def console_stack(embedded: Embedded, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A learner for ALIAS (one short round, a gate that passes anything not worse, a canary
    nobody decides) and the console, on the session stack. Yields the config and console URL."""
    config_path = learner_config(
        embedded,
        tmp_path,
        ALIAS,
        canary={"weight": 0.5, "min_requests": 100_000},
        gate_tokens=16,
        gate={"min_pairs": 8, "max_pairs": 8, "threshold": 0.0},
        steps_per_round=2,
        min_groups=4,
    )
    config = yaml.safe_load(config_path.read_text())
    port = free_port()
    config["console"] = {"port": port, "refresh_s": 0.3}
    config.setdefault("proxy", {})["admin_key"] = ADMIN_KEY
    config_path.write_text(yaml.safe_dump(config))
    settings = load_settings(config_path)
    services = Stack(
        [learner_part(settings, config_path), console_part(settings, config_path)],
        tmp_path / "services",
    )
    services.start()
    try:
        yield config_path, f"http://127.0.0.1:{port}"
    finally:
        services.stop()


def contrast(foreground: str, background: str) -> float:
    """WCAG contrast ratio of two CSS rgb() colours."""

    def luminance(css: str) -> float:
        channels = [int(c) / 255 for c in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    a, b = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def check_accessibility(page: Any, statuses: bool = True) -> None:
    """Headings in order, a label for every control, readable status colours (``statuses``:
    the page shows some)."""
    levels = page.eval_on_selector_all("h1, h2, h3, h4, h5, h6", "hs => hs.map(h => +h.tagName[1])")
    assert levels and levels[0] == 1 and levels.count(1) == 1, levels
    assert all(b <= a + 1 for a, b in itertools.pairwise(levels)), levels
    unlabelled = page.eval_on_selector_all(
        "input:not([type=hidden]), select, textarea",
        """els => els.filter(e => !(e.id && document.querySelector(`label[for="${e.id}"]`))
                                 && !e.getAttribute('aria-label')).map(e => e.outerHTML)""",
    )
    assert unlabelled == [], unlabelled
    colours = page.eval_on_selector_all(
        ".badge, .notice",
        # The live fragment is swapped every refresh_s: an element it replaced since the query
        # has no computed style any more (a run read ''), so only those still in the page count.
        """els => els.filter(e => e.isConnected)
                    .map(e => [getComputedStyle(e).color, getComputedStyle(e).backgroundColor])""",
    )
    assert colours or not statuses, "no status shown"
    for foreground, background in colours:
        assert contrast(foreground, background) >= STATUS_CONTRAST, (foreground, background)


def fits(page: Any, width: int) -> None:
    """Nothing but the tables' own scroll boxes wider than the screen."""
    assert page.evaluate("document.documentElement.scrollWidth") <= width + 1


@pytest.mark.timeout(900)
def test_the_console_shows_the_loop_and_steers_it_in_a_browser(
    embedded: Embedded,
    policy: BasePolicy,
    base_answers: list[str],
    console_stack: tuple[Path, str],
    screenshots: Path,
) -> None:
    from playwright.sync_api import expect, sync_playwright

    config_path, url = console_stack
    settings = load_settings(config_path)
    embedded.registry.write(AliasRoute(alias=ALIAS, base_model=BASE_MODEL))
    produce(embedded, [*heldout_prompts(ALIAS), *better_groups(policy, ALIAS, base_answers, 12)])
    started = wait_for_outcome(settings, ALIAS, "canary", timeout_s=SHORT_ROUND_S)
    candidate = started["version"]
    embedded.wait_for_proxy_route(ALIAS, active_version=0, canary_version=candidate)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            # The overview lists the alias, its live version and its canary.
            page.goto(url + "/")
            expect(page.get_by_role("link", name=ALIAS)).to_be_visible()
            expect(page.get_by_test_id(f"active-{ALIAS}")).to_have_text("v0")
            expect(page.get_by_test_id(f"canary-{ALIAS}")).to_have_text(f"v{candidate}")
            expect(page.get_by_test_id(f"traffic-{ALIAS}")).to_contain_text("requests:")
            check_accessibility(page)
            fits(page, 1280)

            # The alias page: both answers of a real gate pair, side by side, with the verdict.
            page.goto(f"{url}/alias/{ALIAS}")
            pairs = page.get_by_test_id(f"gate-pairs-v{candidate}")
            expect(pairs).to_be_visible()
            first = pairs.locator("article.pair").first
            candidate_answer = first.get_by_test_id("candidate-answer").inner_text()
            incumbent_answer = first.get_by_test_id("incumbent-answer").inner_text()
            assert candidate_answer.strip() and incumbent_answer.strip()
            expect(first.locator(".verdict")).to_contain_text("Verdict:")
            # What the round cost, as its outcome's event says, and the judge's spend today (the
            # groups were made here, not sampled by the judge: training and gate only).
            bill = Bill.model_validate(started["detail"]["bill"])
            assert bill.train_tokens > 0 and bill.gate_seconds > 0, bill
            print(f"the round's bill: {bill.line()}")
            expect(page.get_by_test_id(f"round-cost-v{candidate}")).to_have_text(bill.line())
            expect(page.get_by_test_id("judge-spend")).to_have_text("judge spend today $0.0000")
            check_accessibility(page)
            page.screenshot(path=str(screenshots / "console-alias.png"), full_page=True)

            # A promotion by the CLI appears without a reload.
            subprocess.run(
                [sys.executable, "-m", "cli", "promote", ALIAS, "--config", str(config_path)],
                check=True,
                capture_output=True,
                timeout=60,
            )
            expect(page.get_by_test_id(f"active-{ALIAS}")).to_have_text(
                f"v{candidate}", timeout=5000
            )
            expect(page.get_by_test_id(f"canary-{ALIAS}")).to_have_text("none")
            # Promoted, the version says what its promotion cost (its round alone here).
            expect(page.get_by_test_id(f"cost-v{candidate}")).to_contain_text(
                f"cost to promote: {bill.line()}"
            )

            # Without the admin key an action is refused, and changes nothing.
            page.locator("#rollback-reason").fill("not allowed")
            page.locator("#confirm-rollback").check()
            with page.expect_response(lambda r: r.request.method == "POST") as refused:
                page.locator('button[data-action="rollback"]').click()
            assert refused.value.status == 403
            route = embedded.registry.read(ALIAS)
            assert route is not None and route.active == candidate

            # Logged in, a rollback clicked in the page is served by the proxy within a second on
            # a quiet host (printed below); 5 s is for a loaded slow host. That it comes on the
            # registry's channel, not a re-read, is test_routing's push test.
            page.goto(f"{url}/login?next=/alias/{ALIAS}")
            page.get_by_label("Admin key").fill(ADMIN_KEY)
            page.get_by_role("button", name="Log in").click()
            expect(page.get_by_role("heading", name=ALIAS, level=1)).to_be_visible()
            page.locator("#rollback-reason").fill("clicked in the console test")
            page.locator("#confirm-rollback").check()
            page.locator('button[data-action="rollback"]').click()
            clicked = time.monotonic()
            embedded.wait_for_proxy_route(ALIAS, timeout_s=5.0, active_version=0)
            served_in = time.monotonic() - clicked
            expect(page.get_by_role("status")).to_contain_text("rollback: done")
            expect(page.get_by_test_id(f"active-{ALIAS}")).to_have_text("v0")
            event = embedded.registry.history(ALIAS)[0]
            # The actor names the browser's session and address (audit L-5).
            assert event["kind"] == "rollback", event
            assert event["actor"].startswith("console (session "), event
            assert event["actor"].endswith(" from 127.0.0.1)"), event
            # ... and on ratchet.events, sent off the page's request.
            assert embedded.find_records(
                EVENTS_TOPIC,
                lambda r: (
                    isinstance(r, LifecycleEvent)
                    and (r.alias, r.kind, r.actor) == (ALIAS, "rollback", event["actor"])
                ),
            )
            print(f"rollback clicked to served by the proxy: {served_in:.3f}s")

            # Recent traffic, found by completion id, with its user's rating.
            reply = httpx.post(
                f"{embedded.proxy_url}/v1/chat/completions",
                # Bounded: an answer left to run to the context takes minutes on a loaded CPU.
                json={
                    "model": ALIAS,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 16,
                },
                timeout=60,
            )
            reply.raise_for_status()
            completion_id = reply.json()["id"]
            rated = httpx.post(
                f"{embedded.proxy_url}/v1/feedback",
                json={"completion_id": completion_id, "score": 1.0},
                timeout=10,
            )
            assert rated.status_code == 200, rated.text

            def found_rated() -> bool:
                page.goto(f"{url}/alias/{ALIAS}/traffic")
                page.get_by_label("Completion id").fill(completion_id)
                page.get_by_role("button", name="Find").click()
                cells = page.get_by_test_id("rating")
                return cells.count() == 1 and cells.inner_text() == "1.00"

            wait_until(found_rated, 20, "the rated exchange on the traffic page")
            check_accessibility(page, statuses=False)

            # The overview once there is something to show: the screenshot in docs/console.md.
            page.goto(url + "/")
            # The one request sent above, counted from the proxy's own metrics.
            expect(page.get_by_test_id(f"traffic-{ALIAS}")).to_contain_text(
                "requests: 1 last min", timeout=5000
            )
            page.screenshot(path=str(screenshots / "console-overview.png"), full_page=True)

            # A phone screen: the same page, one column, nothing off-screen.
            phone = browser.new_page(viewport={"width": 390, "height": 844})
            phone.goto(f"{url}/alias/{ALIAS}")
            expect(phone.get_by_role("heading", name=ALIAS, level=1)).to_be_visible()
            fits(phone, 390)
            phone.goto(url + "/")
            fits(phone, 390)
            phone.screenshot(path=str(screenshots / "console-phone.png"), full_page=True)
        finally:
            browser.close()

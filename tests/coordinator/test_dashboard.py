"""The dashboard in a real headless Chromium against a real ``serve`` process: the run's stats, the
leaderboard, live updates without a reload, escaping of volunteer-controlled text, an unknown run and
the organizer panel."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import PROFILE, bearer, start_serve, stop_serve
from volunteer_app.identity import ensure_rsa_key, public_key_openssh

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOSTILE = "<img src=x onerror=alert(1)>"


def _unavailable(reason: str) -> None:
    if os.environ.get("VOLUNTEER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}, and VOLUNTEER_REQUIRE_BROWSER=1 requires the browser tests to run")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        _unavailable(f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright Python package is not installed")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class PageWatch:
    """What the page did that a test must look at: console errors, uncaught exceptions, dialogs."""

    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url', '')})")

    def on_page_error(self, error: Exception) -> None:
        self.errors.append(f"pageerror: {error}")

    def on_dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()


def open_page(browser: Browser) -> tuple[Page, PageWatch]:
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    context.set_default_timeout(10_000)
    page = context.new_page()
    watch = PageWatch()
    page.on("console", watch.on_console)
    page.on("pageerror", watch.on_page_error)
    page.on("dialog", watch.on_dialog)
    return page, watch


@dataclass
class Peer:
    name: str
    credential: str
    session_id: str
    lease: dict[str, Any]


def join_peer(http: httpx.Client, tmp_path: Path, name: str, *, cpu_model: str = "Test CPU") -> Peer:
    registered = http.post("/api/v1/volunteers", json={"name": name})
    assert registered.status_code == 201, registered.text
    credential = registered.json()["credential"]
    key = public_key_openssh(ensure_rsa_key(tmp_path / "keys" / f"{name}.rsa"))
    joined = http.post(
        "/api/v1/runs/shapes/join",
        json={
            "profile": {**PROFILE, "cpu_model": cpu_model},
            "agent_version": "test",
            "peer_public_key": key,
        },
        headers=bearer(credential),
    )
    assert joined.status_code == 200, joined.text
    body = joined.json()
    assert body["lease"] is not None
    return Peer(name=name, credential=credential, session_id=body["session_id"], lease=body["lease"])


def beat(http: httpx.Client, peer: Peer, *, samples_per_second: float, loss: float) -> None:
    answer = http.post(
        f"/api/v1/sessions/{peer.session_id}/heartbeat",
        json={
            "state": "training",
            "samples_total": 64,
            "samples_per_second": samples_per_second,
            "loss": loss,
        },
        headers=bearer(peer.credential),
    )
    assert answer.status_code == 200, answer.text


def run_state(http: httpx.Client) -> str:
    answer = http.get("/api/v1/runs/shapes")
    assert answer.status_code == 200, answer.text
    return str(answer.json()["state"])


def test_dashboard_shows_a_live_run_and_lets_the_organizer_control_it(
    browser: Browser, tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    from playwright.sync_api import expect

    data = tmp_path / "data"
    process, url = start_serve(data, kill_leftovers, "--no-swarm")
    admin = (data / "admin-token").read_text().strip()
    page, watch = open_page(browser)
    with httpx.Client(base_url=url, timeout=10) as http:
        created = http.post(
            "/api/v1/runs",
            headers=bearer(admin),
            json={
                "name": "shapes",
                "task": "shapes-dalle",
                "task_config": {"preset": "tiny", "num_shards": 3},
                "description": "Shapes for <b>everyone</b>",
            },
        )
        assert created.status_code == 201, created.text
        # Names cannot carry markup, so the hostile text rides in the profile's CPU model (shown as a device).
        assert http.post("/api/v1/volunteers", json={"name": HOSTILE}).status_code == 422
        alice = join_peer(http, tmp_path, "alice")
        bob = join_peer(http, tmp_path, "bob")
        mallory = join_peer(http, tmp_path, "mallory", cpu_model=HOSTILE)
        beat(http, alice, samples_per_second=40.0, loss=3.2)
        beat(http, bob, samples_per_second=25.0, loss=3.0)
        beat(http, mallory, samples_per_second=10.0, loss=3.1)

        # "/" redirects to the dashboard, which selects the first active run and names it in the URL.
        page.goto(f"{url}/")
        expect(page.get_by_test_id("run-name")).to_have_text("shapes")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        expect(page.get_by_test_id("connection-status")).to_have_text("Live")
        assert page.url.endswith("/dashboard/#run=shapes")
        expect(page.get_by_test_id("run-state")).to_have_text("active")
        expect(page.get_by_test_id("run-item")).to_have_count(1)
        expect(page.get_by_test_id("run-item")).to_contain_text("shapes-dalle")
        expect(page.get_by_test_id("run-item-peers")).to_have_text("3 peers")
        expect(page.get_by_test_id("stat-active-peers")).to_have_text("3")
        expect(page.get_by_test_id("stat-samples-per-second")).to_have_text("75.0")
        expect(page.get_by_test_id("stat-loss")).to_have_text("3.100")
        expect(page.get_by_test_id("stat-shards")).to_have_text("0 / 3")
        expect(page.get_by_test_id("stat-samples-credited")).to_have_text("0")
        names = page.get_by_test_id("leaderboard").get_by_test_id("volunteer-name")
        expect(names).to_have_text(["alice", "bob", "mallory"])  # no credits yet: ranked by samples/s
        page.evaluate("window.__sameDocument = true")

        # A completed lease credits bob and moves him to the top, live.
        claimed = min(48, int(bob.lease["samples"]))
        done = http.post(
            f"/api/v1/sessions/{bob.session_id}/leases/{bob.lease['lease_id']}/complete",
            json={"samples": claimed, "compute_seconds": 0.5},
            headers=bearer(bob.credential),
        )
        assert done.status_code == 200, done.text
        credited = done.json()["credited_samples"]
        assert credited > 0
        expect(names).to_have_text(["bob", "alice", "mallory"])
        expect(page.get_by_test_id("leaderboard-row").first.get_by_test_id("samples")).to_have_text(
            str(credited)
        )
        expect(page.get_by_test_id("stat-samples-credited")).to_have_text(str(credited))
        expect(page.get_by_test_id("stat-shards")).to_have_text("1 / 3")
        expect(page.get_by_test_id("shards-progress")).to_have_attribute("aria-valuenow", "33")

        # A new heartbeat changes the numbers on the page without a reload.
        alice_row = page.locator('[data-testid="leaderboard-row"][data-volunteer="alice"]')
        expect(alice_row.get_by_test_id("sps")).to_have_text("40.0")
        beat(http, alice, samples_per_second=60.5, loss=2.5)
        expect(alice_row.get_by_test_id("sps")).to_have_text("60.5")
        expect(page.get_by_test_id("stat-samples-per-second")).to_have_text("95.5")
        expect(page.get_by_test_id("stat-loss")).to_have_text("2.867")
        assert page.evaluate("window.__sameDocument") is True
        assert int(page.get_by_test_id("loss-chart").get_attribute("data-points") or 0) >= 2

        # Text from the API is shown literally: no element is injected, no script runs.
        mallory_row = page.locator('[data-testid="leaderboard-row"][data-volunteer="mallory"]')
        expect(mallory_row.get_by_test_id("devices")).to_have_text(f"{HOSTILE} (2 cores)")
        expect(page.get_by_test_id("run-description")).to_have_text("Shapes for <b>everyone</b>")
        assert page.locator("img").count() == 0
        assert page.locator("[data-testid=run-description] b").count() == 0
        assert watch.dialogs == []
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

        # The overall leaderboard, in its own tab.
        page.get_by_test_id("tab-overall").click()
        overall = page.get_by_test_id("overall-leaderboard").get_by_test_id("volunteer-name")
        expect(overall).to_have_text(["bob", "alice", "mallory"])
        expect(page.get_by_test_id("leaderboard")).to_be_hidden()
        page.get_by_test_id("tab-run").click()
        expect(page.get_by_test_id("leaderboard")).to_be_visible()

        # An unknown run: a message, no crash; picking a run from the list recovers.
        page.evaluate("location.hash = '#run=nope'")
        expect(page.get_by_test_id("notice")).to_contain_text("No run named “nope”")
        expect(page.get_by_test_id("run-name")).to_be_hidden()
        expect(page.get_by_test_id("action-pause")).to_be_disabled()
        page.get_by_test_id("run-item").click()
        expect(page.get_by_test_id("run-name")).to_have_text("shapes")
        expect(page.get_by_test_id("notice")).to_be_hidden()
        expect(names).to_have_text(["bob", "alice", "mallory"])

        # The organizer panel: a wrong token shows the API's detail and changes nothing.
        token = page.get_by_label("Organizer token")
        token.fill("wrong-token")
        page.get_by_test_id("action-pause").click()
        expect(page.get_by_test_id("organizer-message")).to_contain_text("unknown credential")
        assert run_state(http) == "active"
        expect(page.get_by_test_id("run-state")).to_have_text("active")

        # The right token pauses the run at once; the API agrees.
        token.fill(admin)
        page.get_by_test_id("action-pause").click()
        expect(page.get_by_test_id("run-state")).to_have_text("paused")
        expect(page.get_by_test_id("run-item")).to_contain_text("paused")
        expect(page.get_by_test_id("organizer-message")).to_have_text("Run shapes paused.")
        assert run_state(http) == "paused"
        expect(page.get_by_test_id("action-pause")).to_be_disabled()
        expect(page.get_by_test_id("action-resume")).to_be_enabled()

        # The token stays in this tab's session storage only.
        assert page.evaluate("Object.values(sessionStorage)") == [admin]
        assert page.evaluate("localStorage.length") == 0
        assert admin not in page.url

        page.get_by_test_id("action-resume").click()
        expect(page.get_by_test_id("run-state")).to_have_text("active")
        assert run_state(http) == "active"

        # Finishing asks first; cancelling changes nothing, confirming finishes the run.
        page.get_by_test_id("action-finish").click()
        expect(page.get_by_test_id("finish-dialog")).to_be_visible()
        page.get_by_test_id("finish-cancel").click()
        expect(page.get_by_test_id("finish-dialog")).to_be_hidden()
        assert run_state(http) == "active"
        page.get_by_test_id("action-finish").click()
        page.get_by_test_id("finish-confirm").click()
        expect(page.get_by_test_id("run-state")).to_have_text("finished")
        assert run_state(http) == "finished"
        for action in ("pause", "resume", "finish"):
            expect(page.get_by_test_id(f"action-{action}")).to_be_disabled()

    # The only browser error is the refused request with the wrong token.
    unexpected = [e for e in watch.errors if not re.search(r"status of 401 .*runs/shapes/pause", e)]
    assert unexpected == [], unexpected
    assert watch.dialogs == []

    # When the server goes away, the page says so instead of pretending to be live.
    assert stop_serve(process) == 0
    expect(page.get_by_test_id("connection-status")).to_have_attribute(
        "data-state", re.compile("^(reconnecting|offline)$")
    )
    page.context.close()


def test_dashboard_without_runs_and_with_an_unknown_run(
    browser: Browser, tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    from playwright.sync_api import expect

    process, url = start_serve(tmp_path / "data", kill_leftovers, "--no-swarm")
    page, watch = open_page(browser)
    page.goto(f"{url}/dashboard/")
    expect(page.get_by_test_id("runs-empty")).to_be_visible()
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    expect(page.get_by_test_id("notice")).to_contain_text("no training runs")
    expect(page.get_by_test_id("action-pause")).to_be_disabled()

    page.goto(f"{url}/dashboard/#run=missing")
    expect(page.get_by_test_id("notice")).to_contain_text("No run named “missing”")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    page.get_by_test_id("tab-overall").click()
    expect(page.get_by_test_id("overall-leaderboard")).to_contain_text("No volunteer has contributed yet.")

    assert watch.errors == []
    assert watch.dialogs == []
    page.context.close()
    assert stop_serve(process) == 0

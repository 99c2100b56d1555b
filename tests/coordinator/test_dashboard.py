"""The organizers' dashboard in a real headless Chromium against a real ``serve`` process with real data:
the run's history (drawn on load, extended live, kept across a restart), the peers table, organizer sign-in
with a session cookie, creating a run, invite codes, bans, the gallery with "try it", the attacks a browser
can carry (no sign-in, a forged cookie, a cross-site POST), no console errors, and phone widths.

One ``serve`` is shared by the module (the restart test has its own). Every page is screenshotted into
``VOLUNTEER_SCREENSHOTS`` (default: a pytest temporary directory; the path is printed)."""

from __future__ import annotations

import io
import os
import re
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import PROFILE, bearer, launch_chromium, python_env, start_serve, stop_serve
from tests.coordinator.conftest import SMALL, write_shapes_checkpoint
from tests.security.conftest import kill
from volunteer_app.identity import ensure_rsa_key, public_key_openssh

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page

pytestmark = pytest.mark.browser

HOSTILE = "<img src=x onerror=alert(1)>"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1360, "height": 1000}
# Points every second and pushes twice a second, so that "the chart gains a point" takes ~2 s, not 20.
SERVE_ENV = {
    "VOLUNTEER_COORDINATOR_SERIES__INTERVAL": "1",
    "VOLUNTEER_COORDINATOR_LIVE_INTERVAL": "0.5",
    "VOLUNTEER_COORDINATOR_CREDIT__SPOT_CHECK_FRACTION": "0",
    # the sign-in limit is tested in tests/security; here several tests sign in within a minute
    "VOLUNTEER_COORDINATOR_LIMITS__LOGIN_PER_MINUTE": "600",
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launch_chromium()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("VOLUNTEER_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard screenshots: {folder}")
    return folder


@dataclass
class PageWatch:
    """What the page did that a test must look at: console errors (CSP violations included), uncaught
    exceptions, dialogs."""

    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    """Patterns of console errors a test caused on purpose (a refused request it made)."""

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url', '')})")

    def on_page_error(self, error: Exception) -> None:
        self.errors.append(f"pageerror: {error}")

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(re.search(p, e) for p in self.allowed)]


def open_page(browser: Browser, *, viewport: dict[str, int] = DESKTOP) -> tuple[Page, PageWatch]:
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(15_000)
    page = context.new_page()
    watch = PageWatch()
    page.on("console", watch.on_console)
    page.on("pageerror", watch.on_page_error)
    page.on("dialog", lambda dialog: (watch.dialogs.append(dialog.message), dialog.dismiss()))
    return page, watch


def shoot(page: Page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # the sticky top bar would be drawn mid-page otherwise
    page.screenshot(path=str(path), full_page=True)
    return path


def no_horizontal_scroll(page: Page) -> None:
    """Phone width: the page never scrolls sideways (wide tables scroll inside their own box).

    Charts refit in a ResizeObserver, which the browser runs in its next rendering step, before it
    paints; a layout read straight after a viewport change comes earlier than that. So the check waits
    for two animation frames, as a user's eye always does.
    """
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
    width = page.evaluate("document.documentElement.scrollWidth")
    if width > page.viewport_size["width"] + 1:  # type: ignore[index]
        wide = page.evaluate(
            """() => Array.from(document.querySelectorAll("body *"))
                 .filter((e) => e.getBoundingClientRect().right > innerWidth + 1)
                 .filter((e) => !e.parentElement.closest(".table-wrap, .runs-list, .command"))
                 .slice(0, 8).map((e) => `${e.tagName}#${e.id}.${e.className}`)"""
        )
        raise AssertionError(f"page is {width} px wide at {page.url}: {wide}")


@dataclass
class Peer:
    name: str
    credential: str
    session_id: str
    lease: dict[str, Any]


def join_peer(
    http: httpx.Client,
    keys: Path,
    name: str,
    *,
    run: str = "shapes",
    invite: str | None = None,
    **profile: Any,
) -> Peer:
    registered = http.post(
        "/api/v1/volunteers", json={"name": name, **({"invite_code": invite} if invite else {})}
    )
    assert registered.status_code == 201, registered.text
    credential = registered.json()["credential"]
    key = public_key_openssh(ensure_rsa_key(keys / f"{name}.rsa"))
    joined = http.post(
        f"/api/v1/runs/{run}/join",
        json={"profile": {**PROFILE, **profile}, "agent_version": "test", "peer_public_key": key},
        headers=bearer(credential),
    )
    assert joined.status_code == 200, joined.text
    body = joined.json()
    return Peer(name=name, credential=credential, session_id=body["session_id"], lease=body["lease"])


def beat(http: httpx.Client, peer: Peer, *, samples_per_second: float, loss: float) -> httpx.Response:
    return http.post(
        f"/api/v1/sessions/{peer.session_id}/heartbeat",
        json={
            "state": "training",
            "samples_total": 64,
            "samples_per_second": samples_per_second,
            "loss": loss,
        },
        headers=bearer(peer.credential),
    )


def wait_for(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll ``check`` until it returns something truthy (the event a test waits for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def series_points(http: httpx.Client, run: str = "shapes") -> int:
    answer = http.get(f"/api/v1/runs/{run}/series")
    assert answer.status_code == 200, answer.text
    return len(answer.json()["t"])


def last_point_time(http: httpx.Client, run: str = "shapes") -> float:
    times = http.get(f"/api/v1/runs/{run}/series").json()["t"]
    return times[-1] if times else 0.0


def record_points(http: httpx.Client, peers: list[Peer], count: int, *, run: str = "shapes") -> int:
    """Heartbeat ``count`` rounds, each until the run's series holds a point taken after it (the recorder
    takes one per tick for a run that changed). Returns how many points were added."""
    start = series_points(http, run)
    for i in range(count):
        sent = 0.0
        for j, peer in enumerate(peers):
            answer = beat(http, peer, samples_per_second=20.0 + 5 * i + j, loss=3.0 - 0.2 * i)
            assert answer.status_code == 200, answer.text
            sent = max(sent, answer.json()["server_time"])
        wait_for(lambda sent=sent: last_point_time(http, run) > sent, "a point after the heartbeats")
    return series_points(http, run) - start


def chart_points(page: Page, chart: str) -> int:
    return int(page.get_by_test_id(f"chart-{chart}").get_attribute("data-points") or 0)


def sign_in(page: Page, url: str, token: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{url}/dashboard/#admin")
    page.get_by_test_id("organizer-token").fill(token)
    page.get_by_test_id("signin-submit").click()
    expect(page.get_by_test_id("signed-in-panel")).to_be_visible()


@dataclass
class Dashboard:
    url: str
    data: Path
    admin: str
    http: httpx.Client
    peers: dict[str, Peer]
    keys: Path


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    root = tmp_path_factory.mktemp("dashboard")
    started: list[Any] = []
    process, url = start_serve(root / "data", started, "--no-swarm", env=python_env(**SERVE_ENV))
    admin = (root / "data" / "admin-token").read_text().strip()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            created = http.post(
                "/api/v1/runs",
                headers=bearer(admin),
                json={
                    "name": "shapes",
                    "task": "shapes-dalle",
                    "task_config": {**SMALL, "num_shards": 6, "samples_per_shard": 32},
                    "description": "Shapes for <b>everyone</b>",
                },
            )
            assert created.status_code == 201, created.text
            peers = {
                "alice": join_peer(
                    http, root, "alice", cpu_model="Ryzen 7 5800X", cpu_cores=8, cpu_threads=16
                ),
                "bob": join_peer(
                    http,
                    root,
                    "bob",
                    cpu_model="Xeon E5",
                    gpus=[{"name": "RTX 4090", "memory_bytes": 24 * 10**9}],
                ),
                "mallory": join_peer(http, root, "mallory", cpu_model=HOSTILE),
            }
            yield Dashboard(url=url, data=root / "data", admin=admin, http=http, peers=peers, keys=root)
    finally:
        for process in started:
            kill(process)


# ------------------------------------------------------------------------------------------ history
def test_the_run_page_draws_history_from_before_it_opened_and_extends_it_live(
    browser: Browser, dash: Dashboard, shots: Path
) -> None:
    from playwright.sync_api import expect

    http = dash.http
    alice, bob, mallory = dash.peers["alice"], dash.peers["bob"], dash.peers["mallory"]
    assert record_points(http, [alice, bob, mallory], 3) >= 3
    before = series_points(http)

    page, watch = open_page(browser)
    page.goto(f"{dash.url}/")  # "/" leads to the dashboard, which opens the active run
    expect(page.get_by_test_id("run-name")).to_have_text("shapes")
    assert page.url.endswith("/dashboard/#run=shapes")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    # the whole history is drawn at once, not just what arrives from now on (points taken before the first
    # heartbeat have no loss)
    expect(page.get_by_test_id("chart-sps")).to_have_attribute("data-points", str(before))
    expect(page.get_by_test_id("chart-peers")).to_have_attribute("data-points", str(before))
    assert 3 <= chart_points(page, "loss") <= before
    assert page.locator("[data-testid=chart-loss] canvas").count() == 1  # drawn by uPlot
    expect(page.get_by_test_id("stat-active-peers")).to_have_text("3")
    expect(page.get_by_test_id("chart-peers")).to_contain_text("now 3")

    # the public part: how to join, exactly, with a copy button
    expect(page.get_by_test_id("join-install")).to_have_text("pipx install volunteer-app")
    expect(page.get_by_test_id("join-command")).to_have_text(
        f"volunteer-app join --coordinator {dash.url} --run shapes"
    )
    expect(page.get_by_test_id("copy-join")).to_be_visible()
    names = page.get_by_test_id("leaderboard").get_by_test_id("volunteer-name")
    expect(names).to_have_text(["alice", "bob", "mallory"])
    # text from strangers is shown literally
    mallory_row = page.locator('[data-testid="leaderboard-row"][data-volunteer="mallory"]')
    expect(mallory_row.get_by_test_id("devices")).to_have_text(f"{HOSTILE} (2 cores)")
    expect(page.get_by_test_id("run-description")).to_have_text("Shapes for <b>everyone</b>")
    assert page.locator("main img[src='x']").count() == 0
    # organizers' tabs and controls are not shown to the public
    expect(page.get_by_test_id("tab-peers")).to_be_hidden()
    expect(page.get_by_test_id("run-controls")).to_be_hidden()
    page.evaluate("window.__sameDocument = true")

    # each heartbeat round becomes a new point, pushed over the live feed and drawn without a reload
    for round_ in range(2):
        shown = chart_points(page, "sps")
        assert beat(http, alice, samples_per_second=70.0 + round_, loss=1.5).status_code == 200
        page.wait_for_function(
            "n => Number(document.querySelector('[data-testid=chart-sps]').dataset.points) > n", arg=shown
        )
    # alice's 71 beside bob's 31 and mallory's 32 from the last round
    expect(page.get_by_test_id("stat-samples-per-second")).to_have_text("134")
    expect(page.get_by_test_id("chart-sps")).to_contain_text("now 134")
    assert page.evaluate("window.__sameDocument") is True
    shoot(page, shots, "run-overview")

    page.set_viewport_size(PHONE)
    expect(page.get_by_test_id("chart-loss")).to_be_visible()
    no_horizontal_scroll(page)
    shoot(page, shots, "run-overview-phone")
    assert watch.unexpected() == [] and watch.dialogs == []
    page.context.close()


def test_history_survives_a_serve_restart_and_an_empty_coordinator_says_so(
    browser: Browser, tmp_path: Path, kill_leftovers: list[Any], shots: Path
) -> None:
    from playwright.sync_api import expect

    data = tmp_path / "data"
    env = python_env(**SERVE_ENV)
    process, url = start_serve(data, kill_leftovers, "--no-swarm", env=env)
    admin = (data / "admin-token").read_text().strip()
    page, watch = open_page(browser)
    page.goto(f"{url}/dashboard/")
    expect(page.get_by_test_id("runs-empty")).to_be_visible()
    expect(page.get_by_test_id("notice")).to_contain_text("no training runs")
    page.goto(f"{url}/dashboard/#run=missing")
    expect(page.get_by_test_id("notice")).to_contain_text("No run named “missing”")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")

    with httpx.Client(base_url=url, timeout=30) as http:
        created = http.post(
            "/api/v1/runs",
            headers=bearer(admin),
            json={"name": "kept", "task": "shapes-dalle", "task_config": {**SMALL, "num_shards": 2}},
        )
        assert created.status_code == 201, created.text
        peer = join_peer(http, tmp_path, "ada", run="kept")
        record_points(http, [peer], 3, run="kept")
        before = series_points(http, "kept")
    page.goto(f"{url}/dashboard/#run=kept")
    expect(page.get_by_test_id("chart-peers")).to_have_attribute("data-points", str(before))
    assert stop_serve(process) == 0
    expect(page.get_by_test_id("connection-status")).to_have_attribute(
        "data-state", re.compile("^(reconnecting|offline)$")
    )

    process, url = start_serve(data, kill_leftovers, "--no-swarm", env=env)
    page.goto(f"{url}/dashboard/#run=kept")
    expect(page.get_by_test_id("run-name")).to_have_text("kept")
    expect(page.get_by_test_id("chart-peers")).not_to_have_attribute("data-points", "0")
    assert chart_points(page, "peers") >= before >= 3
    assert chart_points(page, "loss") >= 3
    shoot(page, shots, "run-after-restart")
    page.context.close()
    assert stop_serve(process) == 0
    # the only errors are the ones the stopped server caused (refused connections while it was down)
    assert [e for e in watch.unexpected() if "ERR_CONNECTION_REFUSED" not in e and "WebSocket" not in e] == []


# ------------------------------------------------------------------------------------------ organizers
def test_organizers_sign_in_see_peers_create_a_run_manage_invites_and_ban(
    browser: Browser, dash: Dashboard, shots: Path
) -> None:
    from playwright.sync_api import expect

    http = dash.http
    page, watch = open_page(browser)
    # a wrong token and a volunteer's credential are refused, with the reason, and nothing is stored
    page.goto(f"{dash.url}/dashboard/#admin")
    page.get_by_test_id("organizer-token").fill("org_wrong")
    page.get_by_test_id("signin-submit").click()
    expect(page.get_by_test_id("signin-error")).to_contain_text("unknown credential")
    page.get_by_test_id("organizer-token").fill(dash.peers["bob"].credential)
    page.get_by_test_id("signin-submit").click()
    expect(page.get_by_test_id("signin-error")).to_contain_text("needs the organizer token")
    assert page.context.cookies() == []
    watch.allowed.append(r"status of (401|403|422)")
    shoot(page, shots, "admin-signed-out")

    page.get_by_test_id("organizer-token").fill(dash.admin)
    page.get_by_test_id("signin-submit").click()
    expect(page.get_by_test_id("signed-in-panel")).to_be_visible()
    expect(page.get_by_test_id("auth-status")).to_be_visible()
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict" and cookie["value"] != dash.admin
    assert page.evaluate("[localStorage.length, sessionStorage.length]") == [0, 0]
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script can read it

    # the volunteers table, sortable
    rows = page.get_by_test_id("volunteers-table").get_by_test_id("volunteer-link")
    expect(rows).to_have_text(["alice", "bob", "mallory"])
    page.get_by_test_id("volunteers-table").locator("button[data-sort=name]").click()
    expect(rows).to_have_text(["mallory", "bob", "alice"])
    shoot(page, shots, "admin")

    # create a run: the server's validation message appears beside the field, then it works
    page.get_by_test_id("cr-name").fill("second")
    page.get_by_test_id("cr-num-shards").fill("0")
    page.get_by_test_id("cr-target-batch").fill("0")
    page.get_by_test_id("cr-submit").click()
    expect(page.get_by_test_id("error-target-batch")).to_contain_text("greater than or equal to 1")
    page.get_by_test_id("cr-target-batch").fill("512")
    page.get_by_test_id("cr-submit").click()
    expect(page.get_by_test_id("error-num-shards")).to_contain_text("must be at least 1")
    expect(page.get_by_test_id("cr-num-shards")).to_have_attribute("aria-invalid", "true")
    shoot(page, shots, "admin-create-run-error")
    page.get_by_test_id("cr-num-shards").fill("8")
    page.get_by_test_id("cr-visibility").select_option("invite")
    page.get_by_test_id("cr-config").fill('{"d_model": 32, "n_heads": 2, "n_layers": 1}')
    page.get_by_test_id("cr-submit").click()
    expect(page.get_by_test_id("run-name")).to_have_text("second")
    expect(page.get_by_test_id("toast")).to_contain_text("Created run second")
    assert page.url.endswith("#run=second")
    second = http.get("/api/v1/runs/second").json()
    assert second["visibility"] == "invite" and second["optimizer"]["target_batch_size"] == 512
    assert second["task_config"]["num_shards"] == 8 and second["task_config"]["d_model"] == 32
    expect(page.locator('[data-testid="run-item"][data-run="second"]')).to_be_visible()
    expect(page.get_by_test_id("join-command")).to_contain_text("--run second --invite-code")

    # invite codes: made (shown once), used, revoked; a revoked code admits nobody
    page.get_by_test_id("tab-invites").click()
    page.get_by_test_id("invite-label").fill("the Tuesday meetup")
    page.get_by_test_id("invite-max").fill("5")
    page.get_by_test_id("invite-create").click()
    code = page.get_by_test_id("invite-code")
    expect(code).to_have_text(re.compile(r"^inv_"))
    invite = code.inner_text()
    carol = join_peer(http, dash.keys, "carol", run="second", invite=invite)
    rows = page.get_by_test_id("invite-row")
    expect(rows).to_have_count(2)  # this code and the run's own
    expect(rows.first).to_contain_text("the Tuesday meetup")
    page.get_by_test_id("tab-overview").click()
    page.get_by_test_id("tab-invites").click()
    expect(rows.first.locator("td").nth(2)).to_have_text("1 / 5")
    shoot(page, shots, "run-invites")
    rows.first.get_by_test_id("invite-revoke").click()
    expect(page.get_by_test_id("confirm-dialog")).to_be_visible()
    page.get_by_test_id("confirm-ok").click()
    expect(rows.first.get_by_test_id("invite-status")).to_have_text("revoked")
    refused = http.post("/api/v1/volunteers", json={"name": "dave", "invite_code": invite})
    assert refused.status_code == 403 and refused.json()["error"] == "invalid_invite_code"
    assert beat(http, carol, samples_per_second=5.0, loss=3.0).status_code == 200  # members stay

    # the peers table of the first run: every joined peer with its hardware and assignment
    page.goto(f"{dash.url}/dashboard/#run=shapes&tab=peers")
    table = page.locator("#peers-table")
    bob_row = table.locator('[data-testid="peer-row"][data-volunteer="bob"]')
    expect(bob_row.get_by_test_id("peer-cpu")).to_have_text("Xeon E5 (2 cores)")
    expect(bob_row.get_by_test_id("peer-gpus")).to_have_text("GPU: RTX 4090 24 GB")
    expect(bob_row.get_by_test_id("peer-memory")).to_contain_text("8.6 GB RAM")
    expect(bob_row.get_by_test_id("peer-assignment")).to_contain_text("threads")
    expect(bob_row.get_by_test_id("peer-lease")).to_contain_text("shard")
    expect(bob_row.get_by_test_id("peer-token")).to_contain_text("token expires in")
    expect(bob_row.get_by_test_id("peer-key")).to_have_text(re.compile(r"^SHA256:[0-9a-f]{16}$"))
    alice_row = table.locator('[data-testid="peer-row"][data-volunteer="alice"]')
    expect(alice_row.get_by_test_id("peer-cpu")).to_have_text("Ryzen 7 5800X (8 cores, 16 threads)")
    expect(table.get_by_test_id("peer-row")).to_have_count(3)
    table.locator("button[data-sort=volunteer]").click()
    expect(table.get_by_test_id("peer-volunteer")).to_have_text(["alice", "bob", "mallory"])
    shoot(page, shots, "run-peers")
    page.get_by_test_id("tab-overview").click()
    expect(page.get_by_test_id("run-controls")).to_be_visible()

    # ban mallory from her page: her next heartbeat is refused, she leaves the board and the peers, live
    page.goto(f"{dash.url}/dashboard/#volunteer=mallory")
    expect(page.get_by_test_id("volunteer-title")).to_have_text("mallory")
    expect(page.get_by_test_id("history-row")).to_have_count(1)
    expect(page.locator("#volunteer-sessions").get_by_test_id("peer-cpu")).to_have_text(
        f"{HOSTILE} (2 cores)"
    )
    shoot(page, shots, "volunteer")
    page.get_by_test_id("volunteer-ban").click()
    page.get_by_test_id("confirm-input").fill("fake progress")
    page.get_by_test_id("confirm-ok").click()
    expect(page.get_by_test_id("toast")).to_contain_text("Banned mallory")
    expect(page.get_by_test_id("volunteer-status")).to_have_text("banned")
    refused = beat(http, dash.peers["mallory"], samples_per_second=10.0, loss=1.0)
    assert refused.status_code == 403, refused.text
    page.goto(f"{dash.url}/dashboard/#run=shapes")
    expect(page.get_by_test_id("leaderboard").get_by_test_id("volunteer-name")).to_have_text(["alice", "bob"])
    page.get_by_test_id("tab-peers").click()
    expect(page.locator("#peers-table").get_by_test_id("peer-row")).to_have_count(2)

    # unban from the volunteers table: her credential works again
    page.goto(f"{dash.url}/dashboard/#admin")
    mallory_row = page.locator('[data-testid="volunteer-row"][data-volunteer="mallory"]')
    expect(mallory_row.get_by_test_id("volunteer-row-status")).to_have_text("banned")
    mallory_row.get_by_test_id("volunteer-action").click()
    page.get_by_test_id("confirm-ok").click()
    expect(mallory_row.get_by_test_id("volunteer-row-status")).not_to_have_text("banned")
    assert (
        http.post(
            "/api/v1/runs/shapes/join", json={}, headers=bearer(dash.peers["mallory"].credential)
        ).status_code
        == 422
    )  # authenticated again (the empty body is what is refused now)

    # pause and resume from the run's controls, reflected in the list and the API
    page.goto(f"{dash.url}/dashboard/#run=second")
    page.get_by_test_id("action-pause").click()
    expect(page.get_by_test_id("run-state")).to_have_text("paused")
    assert http.get("/api/v1/runs/second").json()["state"] == "paused"
    page.get_by_test_id("action-finish").click()
    page.get_by_test_id("confirm-cancel").click()
    assert http.get("/api/v1/runs/second").json()["state"] == "paused"

    # phone width: every organizer page fits
    page.set_viewport_size(PHONE)
    for path, name in (
        ("#admin", "admin"),
        ("#run=shapes&tab=peers", "run-peers"),
        ("#volunteer=bob", "volunteer"),
    ):
        page.goto(f"{dash.url}/dashboard/{path}")
        page.wait_for_load_state("networkidle")
        no_horizontal_scroll(page)
        shoot(page, shots, f"{name}-phone")

    # sign out: the organizers' tabs go away and the API refuses this browser again
    page.set_viewport_size(DESKTOP)
    page.goto(f"{dash.url}/dashboard/#admin")
    page.get_by_test_id("sign-out").click()
    expect(page.get_by_test_id("signin-panel")).to_be_visible()
    assert page.context.cookies() == []
    page.goto(f"{dash.url}/dashboard/#run=shapes")
    expect(page.get_by_test_id("tab-peers")).to_be_hidden()
    assert watch.unexpected() == [] and watch.dialogs == []
    page.context.close()


# ------------------------------------------------------------------------------------------ attacks
def _api_status(
    page: Page, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> list[Any]:
    return page.evaluate(
        """async ([path, method, headers]) => {
             const r = await fetch(path, {method, headers, credentials: "same-origin"});
             const body = await r.json().catch(() => ({}));
             return [r.status, body.error || null];
           }""",
        [path, method, headers or {}],
    )


def test_logged_out_forged_and_cross_site_requests_are_refused(
    browser: Browser, dash: Dashboard, shots: Path
) -> None:
    from playwright.sync_api import expect

    http = dash.http
    # a browser that never signed in: the organizers' pages say so and the API refuses it
    page, watch = open_page(browser)
    page.goto(f"{dash.url}/dashboard/#volunteer=bob")
    expect(page.get_by_test_id("volunteer-locked")).to_be_visible()
    assert _api_status(page, "/api/v1/runs/shapes/peers") == [401, "missing_credential"]
    assert _api_status(page, "/api/v1/runs/shapes/pause", "POST") == [401, "missing_credential"]

    # a forged session cookie is refused, and the page offers to sign in
    context: BrowserContext = page.context
    context.add_cookies([{"name": "vc_organizer", "value": "forged-" + "x" * 40, "url": dash.url}])
    assert _api_status(page, "/api/v1/runs/shapes/peers") == [401, "invalid_session"]
    page.goto(f"{dash.url}/dashboard/#admin")
    expect(page.get_by_test_id("signin-panel")).to_be_visible()
    watch.allowed.append(r"status of 401")
    shoot(page, shots, "forged-cookie")

    # signed in for real: a same-origin write without the CSRF token is refused
    sign_in(page, dash.url, dash.admin)
    assert _api_status(page, "/api/v1/runs/shapes/pause", "POST") == [403, "csrf_failed"]
    assert _api_status(page, "/api/v1/runs/shapes/pause", "POST", {"X-CSRF-Token": "0" * 64}) == [
        403,
        "csrf_failed",
    ]
    watch.allowed.append(r"status of 403")
    assert http.get("/api/v1/runs/shapes").json()["state"] == "active"

    # another site's page (another port of the same host: same-site, so the cookie IS sent) posts a form
    # to pause the run: refused, the run stays active
    evil = re.sub(r":\d+$", ":9", dash.url) + "/evil.html"
    form = (
        f'<form id="f" method="post" action="{dash.url}/api/v1/runs/shapes/pause"></form>'
        '<script>document.getElementById("f").submit()</script>'
    )
    page.route(evil, lambda route: route.fulfill(status=200, content_type="text/html", body=form))
    page.goto(evil)
    page.wait_for_url(f"{dash.url}/api/v1/runs/shapes/pause")
    assert "cross_site_request" in page.content()
    # a truly foreign site: the SameSite=Strict cookie is not even sent
    foreign = "http://evil.example/attack.html"
    page.route(foreign, lambda route: route.fulfill(status=200, content_type="text/html", body=form))
    page.goto(foreign)
    page.wait_for_url(f"{dash.url}/api/v1/runs/shapes/pause")
    assert "missing_credential" in page.content()
    assert http.get("/api/v1/runs/shapes").json()["state"] == "active"

    # the dashboard's own pages are never framed, and send a strict policy
    answer = http.get("/dashboard/")
    policy = answer.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self';" in policy
    assert "unsafe-inline" not in policy and answer.headers["x-frame-options"] == "DENY"
    assert watch.unexpected() == [] and watch.dialogs == []
    page.context.close()


# ------------------------------------------------------------------------------------------ gallery
def _write_checkpoint(data: Path, epoch: int) -> Any:
    config = {**SMALL, "num_shards": 6, "samples_per_shard": 32}
    return write_shapes_checkpoint(data, config, epoch=epoch, samples=epoch * 512)


def test_the_gallery_shows_checkpoints_and_try_it_draws_a_caption(
    browser: Browser, dash: Dashboard, shots: Path
) -> None:
    from playwright.sync_api import expect

    from coordinator.checkpoints import CheckpointStore, checkpoint_directory, generate_endpoint_file
    from coordinator.swarm.generate import GenerateServer

    http = dash.http
    _write_checkpoint(dash.data, 3)
    # the series picks the checkpoint's held-out metric up on its next point
    wait_for(
        lambda: any(v is not None for v in http.get("/api/v1/runs/shapes/series").json()["metric"]),
        "the checkpoint's metric in the series",
    )
    server = GenerateServer(
        store=CheckpointStore(checkpoint_directory(dash.data, "shapes")),
        endpoint_file=generate_endpoint_file(dash.data, "shapes"),
    )
    try:
        page, watch = open_page(browser)
        page.goto(f"{dash.url}/dashboard/#run=shapes&tab=gallery")
        card = page.get_by_test_id("checkpoint")
        expect(card).to_have_count(1)
        expect(card.get_by_test_id("checkpoint-epoch")).to_have_text("3")
        expect(card.get_by_test_id("checkpoint-metric")).to_contain_text("prompt accuracy")
        grid = card.get_by_test_id("checkpoint-grid")
        expect(grid).to_be_visible()
        page.wait_for_function("img => img.complete && img.naturalWidth > 32", arg=grid.element_handle())
        expect(card.locator(".prompts li")).to_have_count(8)
        expect(page.get_by_test_id("chart-gallery-metric")).not_to_have_attribute("data-points", "0")
        expect(card.get_by_test_id("checkpoint-download")).to_be_hidden()  # not published
        assert http.get("/api/v1/runs/shapes/checkpoints/3/download").status_code == 404

        # try it: a caption the task reads is drawn; one it cannot read says why
        page.get_by_test_id("try-prompt").fill("a big red circle in the center")
        page.get_by_test_id("try-submit").click()
        image = page.get_by_test_id("try-image")
        expect(image).to_be_visible()
        page.wait_for_function("img => img.complete && img.naturalWidth === 256", arg=image.element_handle())
        expect(page.get_by_test_id("try-result")).to_contain_text("epoch 3")
        page.get_by_test_id("try-prompt").fill("a purple elephant on the moon")
        page.get_by_test_id("try-submit").click()
        expect(page.get_by_test_id("try-error")).to_contain_text("cannot read that caption")
        watch.allowed.append(r"status of 422")
        shoot(page, shots, "run-gallery")

        # an organizer publishes the checkpoint: its download link appears for everyone
        sign_in(page, dash.url, dash.admin)
        page.goto(f"{dash.url}/dashboard/#run=shapes&tab=gallery")
        page.get_by_test_id("checkpoint-publish").click()
        page.get_by_test_id("confirm-ok").click()
        download = page.get_by_test_id("checkpoint-download")
        expect(download).to_be_visible()
        href = download.get_attribute("href")
        assert href == "/api/v1/runs/shapes/checkpoints/3/download"
        zipped = http.get(href)
        assert zipped.status_code == 200 and zipped.headers["content-type"] == "application/zip"
        names = zipfile.ZipFile(io.BytesIO(zipped.content)).namelist()
        assert "shapes-epoch-00000003/model.safetensors" in names
        assert "shapes-epoch-00000003/manifest.json" in names
        page.set_viewport_size(PHONE)
        page.reload()
        expect(page.get_by_test_id("checkpoint")).to_have_count(1)
        no_horizontal_scroll(page)
        shoot(page, shots, "run-gallery-phone")
        assert watch.unexpected() == [] and watch.dialogs == []
        page.context.close()
    finally:
        server.shutdown()

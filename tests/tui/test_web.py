"""`volunteer-app web` in a real headless Chromium: opened with the login link it prints, the page shows the
contribute screen of an agent that contributes to a run, and a key pressed in the page pauses that agent.
Without the link's cookie, from other origins and under other Host names the server refuses (a page
elsewhere, or another user of this computer, must not steer the agent); ``test_web_auth.py`` checks each
rule on its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import create_run_on_disk, python_env, start_serve, stop_serve
from tests.tui.conftest import agent_call, stop_web_server, wait_for_web_link
from volunteer_app.control import JoinCommand
from volunteer_app.control_client import get_state, locate_agent
from volunteer_app.settings import AgentSettings

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = [pytest.mark.browser, pytest.mark.swarm, pytest.mark.timeout(600)]


@pytest.fixture
def contributing(tmp_path: Path) -> Iterator[tuple[AgentSettings, dict[str, str]]]:
    """A coordinator with run shapes and an agent that joined it (no coordinator swarm peer: lighter)."""
    data = tmp_path / "coordinator"
    create_run_on_disk(data, "--config", "samples_per_shard=64")
    started: list[Any] = []
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__ENABLED="false"))
    config_dir = tmp_path / "volunteer"
    env = python_env(VOLUNTEER_CONFIG_DIR=str(config_dir), VOLUNTEER_BENCHMARK_SECONDS="1")
    subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", "agent", "--background", "--listen-host", "127.0.0.1"],
        check=True, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    settings = AgentSettings(config_dir=config_dir)
    try:
        agent_call(settings, JoinCommand(coordinator=url, run="shapes", name="ada"))
        yield settings, env
    finally:
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError, PermissionError):
            os.killpg(int(json.loads((config_dir / "agent.json").read_text())["pid"]), signal.SIGKILL)
        stop_serve(process)


@pytest.fixture
def web(contributing: tuple[AgentSettings, dict[str, str]]) -> Iterator[str]:
    """`volunteer-app web --port 0 --no-open`; yields the login link it prints."""
    _settings, env = contributing
    process = subprocess.Popen(
        [sys.executable, "-m", "volunteer_app.cli", "web", "--port", "0", "--no-open"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        url = wait_for_web_link(process, [], "`volunteer-app web`")
        yield url
    finally:
        stop_web_server(process)


def test_the_app_in_a_browser_pauses_the_agent(
    browser: Browser, web: str, contributing: tuple[AgentSettings, dict[str, str]]
) -> None:
    settings, _env = contributing
    received: list[bytes] = []

    def shown() -> str:
        """What the app sent the page so far (terminal output: text between escape sequences)."""
        return b"".join(received).decode("utf-8", "replace")

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.on(
        "websocket",
        lambda ws: ws.on(
            "framereceived", lambda frame: received.append(frame if isinstance(frame, bytes) else b"")
        ),
    )
    page.goto(web)
    deadline = time.monotonic() + 90
    while "Contributing to run shapes" not in shown() and "Joining run shapes" not in shown():
        assert time.monotonic() < deadline, (
            f"the page never showed the contribute screen: {shown()[-2000:]!r}"
        )
        page.wait_for_timeout(200)
    assert "This machine's contribution" in shown()

    page.click("#terminal")
    page.keyboard.press("p")
    deadline = time.monotonic() + 60
    while not get_state(locate_agent(settings)).paused_by_user:
        assert time.monotonic() < deadline, "pressing p in the page must pause the agent"
        page.wait_for_timeout(200)
    state = get_state(locate_agent(settings))
    assert state.contribution is not None and "paused by you" in state.contribution.pause_reasons
    deadline = time.monotonic() + 30
    while "Paused: paused by you" not in shown():
        assert time.monotonic() < deadline, "the page must show the pause and its reason"
        page.wait_for_timeout(200)

    assert "token=" not in page.url, "the login link forwards to the clean URL"
    assert page.evaluate("document.cookie") == "", "the session cookie is out of the page's scripts' reach"

    # nobody else steers the agent: no login, another Host name or another Origin are refused
    base, token = web.split("/?token=", 1)
    stranger = browser.new_page()
    response = stranger.goto(base + "/")
    assert response is not None and response.status == 403
    assert "Open the link that volunteer-app web printed" in stranger.content()
    port = base.rsplit(":", 1)[1]
    rebound = httpx.get(web, headers={"Host": f"attacker.example:{port}"}, timeout=10)
    assert rebound.status_code == 403 and rebound.json()["error"] == "forbidden_host"
    handshake = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Origin": "http://attacker.example",
    }
    anonymous = httpx.get(f"{base}/ws", headers=handshake, timeout=10)
    assert anonymous.status_code == 403 and anonymous.json()["error"] == "login_required"
    hijack = httpx.get(f"{base}/ws?token={token}", headers=handshake, timeout=10)
    assert hijack.status_code == 403 and hijack.json()["error"] == "forbidden_origin"

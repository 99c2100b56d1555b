"""The installed `volunteer-app` in a real terminal (tmux): with no agent running it starts one in the
background and says so, opens the first-run screen with the coordinator given by --coordinator and its
runs listed, follows keys, and on quit asks whether to keep the agent or stop it; stopping ends it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env, start_serve, stop_serve
from volunteer_app.control_client import AgentNotRunning, get_state, locate_agent
from volunteer_app.settings import AgentSettings

TMUX = shutil.which("tmux")
VOLUNTEER_APP = Path(sys.executable).parent / "volunteer-app"

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _needs_tmux() -> None:
    if TMUX is None:
        reason = "tmux is not installed (apt-get install tmux)"
        if os.environ.get("VOLUNTEER_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, and VOLUNTEER_REQUIRE_BROWSER=1 requires the terminal tests to run")
        pytest.skip(reason)


class Terminal:
    """One tmux session on a private server socket: 80x24, keys in, screen text out."""

    def __init__(self, command: list[str], env: dict[str, str]):
        assert TMUX is not None
        self.socket = f"volunteer-app-test-{uuid.uuid4().hex[:8]}"
        self.session = "app"
        self.base = [TMUX, "-L", self.socket]
        exports = " ".join(f"{k}={_quote(v)}" for k, v in env.items())
        shell = f"env {exports} {' '.join(_quote(c) for c in command)}; echo EXIT=$?; sleep 600"
        subprocess.run(
            [
                *self.base,
                "-f",
                os.devnull,
                "new-session",
                "-d",
                "-s",
                self.session,
                "-x",
                "80",
                "-y",
                "24",
                shell,
            ],
            check=True,
            env={**os.environ, "TERM": "xterm-256color"},
        )

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", self.session, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(
            [*self.base, "capture-pane", "-p", "-t", self.session], capture_output=True, text=True, check=True
        ).stdout

    def wait(self, what: str, predicate: Callable[[str], bool], timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the terminal shows:\n{screen}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], check=False, capture_output=True)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    data = tmp_path / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    # no swarm peer: this test never trains, it only lists the run
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__ENABLED="false"))
    yield url
    stop_serve(process)


def test_the_installed_app_in_a_terminal(tmp_path: Path, coordinator: str) -> None:
    if not VOLUNTEER_APP.exists():
        pytest.skip(f"volunteer-app is not installed next to {sys.executable} (pip install -e .)")
    config_dir = tmp_path / "volunteer"
    env = {"VOLUNTEER_CONFIG_DIR": str(config_dir), "PYTHONPATH": python_env()["PYTHONPATH"]}
    terminal = Terminal([str(VOLUNTEER_APP), "--coordinator", coordinator], env)
    try:
        terminal.wait(
            "the notice that the agent was started", lambda s: "started the agent in the" in s, timeout=120
        )
        screen = terminal.wait(
            "the first-run screen with the coordinator's runs",
            lambda s: "Join a training run" in s and "shapes: shapes-dalle" in s,
            timeout=60,
        )
        assert "1 Contribute" in screen and "6 Log" in screen, screen
        assert coordinator.split("//")[1] in screen  # the flag's coordinator is preselected
        settings = AgentSettings(config_dir=config_dir)
        address = locate_agent(settings)
        assert address.pid is not None

        assert "esc Leave the field" not in screen  # no field has the keys: digits switch screens
        terminal.keys("4")  # the machine screen
        screen = terminal.wait("the machine screen", lambda s: "CPU" in s and "Memory" in s)
        assert "GiB" in screen

        terminal.keys("q")
        terminal.wait("the quit question", lambda s: "or stop it?" in s)
        terminal.keys("s")
        screen = terminal.wait("the app to end", lambda s: "EXIT=" in s, timeout=120)
        assert "EXIT=0" in screen and "the agent stops" in screen, screen
        deadline = time.monotonic() + 60
        while True:
            try:
                locate_agent(settings)
            except AgentNotRunning:
                break
            assert time.monotonic() < deadline, "the agent must end when the app stops it"
            time.sleep(0.2)
    finally:
        terminal.close()
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError, PermissionError):
            os.killpg(int(json.loads((config_dir / "agent.json").read_text())["pid"]), signal.SIGKILL)


def test_killing_the_app_leaves_the_agent_running(tmp_path: Path, coordinator: str) -> None:
    """The app is only a view: SIGKILL it (a crash), close its terminal, and the agent it started goes on."""
    if not VOLUNTEER_APP.exists():
        pytest.skip(f"volunteer-app is not installed next to {sys.executable} (pip install -e .)")
    import psutil

    config_dir = tmp_path / "volunteer"
    env = {"VOLUNTEER_CONFIG_DIR": str(config_dir), "PYTHONPATH": python_env()["PYTHONPATH"]}
    terminal = Terminal([str(VOLUNTEER_APP), "--coordinator", coordinator], env)
    settings = AgentSettings(config_dir=config_dir)
    try:
        terminal.wait("the first-run screen", lambda s: "Join a training run" in s, timeout=180)
        before = get_state(locate_agent(settings))
        pane = subprocess.run(
            [*terminal.base, "list-panes", "-t", terminal.session, "-F", "#{pane_pid}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()[0]  # fmt: skip
        apps = [
            p
            for p in psutil.Process(int(pane)).children(recursive=True)
            if any("volunteer-app" in part for part in p.cmdline()) and p.pid != before.pid
        ]
        assert apps, "the app's process"
        for app in apps:
            app.kill()
        terminal.wait("the app to be gone", lambda s: "EXIT=" in s, timeout=30)
        terminal.close()  # and the terminal itself goes away (SIGHUP to everything it ran)
        time.sleep(1)
        after = get_state(locate_agent(settings))
        assert after.pid == before.pid and after.started_at == before.started_at, "the same agent answers"
        assert psutil.pid_exists(before.pid)
    finally:
        terminal.close()
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError, PermissionError):
            os.killpg(int(json.loads((config_dir / "agent.json").read_text())["pid"]), signal.SIGKILL)

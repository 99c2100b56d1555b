"""The app's commands refuse what they cannot do in one line on stderr: the app without a terminal, and
`web` beyond this computer without saying so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import python_env


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", *args],
        capture_output=True, text=True, env=python_env(VOLUNTEER_CONFIG_DIR=str(tmp_path)), stdin=subprocess.DEVNULL,
        timeout=60, check=False,
    )  # fmt: skip


def test_the_app_needs_a_terminal(tmp_path: Path) -> None:
    result = run(tmp_path, "--coordinator", "https://train.example.org")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "needs a terminal" in result.stderr
    assert not (tmp_path / "agent.json").exists(), "no agent is started for an app that cannot open"


def test_web_stays_on_this_computer_unless_told(tmp_path: Path) -> None:
    result = run(tmp_path, "web", "--host", "0.0.0.0", "--no-open")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--allow-remote" in result.stderr
    bad_port = run(tmp_path, "web", "--port", "70000", "--no-open")
    assert bad_port.returncode == 2 and "--port" in bad_port.stderr


def test_web_and_the_app_are_documented(tmp_path: Path) -> None:
    top = run(tmp_path, "--help")
    assert top.returncode == 0 and "--coordinator URL" in top.stdout and "web" in top.stdout
    web = run(tmp_path, "web", "--help")
    assert web.returncode == 0 and "--no-open" in web.stdout and "--allow-remote" in web.stdout

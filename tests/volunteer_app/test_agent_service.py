"""The agent service as a volunteer uses it: real `volunteer-coordinator serve`, real `volunteer-app`
processes, a real worker. `join` starts the agent and can go away while training goes on; the shell
commands steer it; a second agent is refused; `leave` returns the session's leases; `stop` ends it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env, start_serve, stop_serve

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]


class Volunteer:
    """`volunteer-app` commands run against one config dir (one user)."""

    def __init__(self, root: Path):
        self.config_dir = root / "volunteer"
        self.env = python_env(
            VOLUNTEER_CONFIG_DIR=str(self.config_dir),
            VOLUNTEER_BENCHMARK_SECONDS="1",
            VOLUNTEER_LOG_LEVEL="INFO",
        )

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "volunteer_app.cli", *args], capture_output=True, text=True, env=self.env,
            timeout=timeout, check=False,
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        result = self.run("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait(
        self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = self.state()
            if predicate(state):
                return state
            time.sleep(0.5)
        log = self.config_dir / "logs" / "agent.log"
        raise AssertionError(f"timed out waiting for {what}: {json.dumps(state)[:3000]}\n"
                             f"{log.read_text()[-3000:] if log.exists() else ''}")  # fmt: skip

    def agent_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(json.loads((self.config_dir / "agent.json").read_text())["pid"])
        return None


def contribution(state: dict[str, Any]) -> dict[str, Any]:
    return state.get("contribution") or {}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    data = tmp_path / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=64", "--config", "num_shards=512"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    yield url, data
    stop_serve(process)
    for p in started:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def volunteer(tmp_path: Path) -> Iterator[Volunteer]:
    person = Volunteer(tmp_path)
    yield person
    pid = person.agent_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def active_leases(data: Path) -> int:
    with sqlite3.connect(data / "coordinator.db") as db:
        return int(db.execute("select count(*) from leases where state = 'active'").fetchone()[0])


def test_the_agent_outlives_join_and_obeys_the_shell(served: tuple[str, Path], volunteer: Volunteer) -> None:
    url, data = served
    join = subprocess.Popen(
        [sys.executable, "-m", "volunteer_app.cli", "join", "--coordinator", url, "--run", "shapes", "--name", "ada",
         "--max-threads", "1", "--listen-host", "127.0.0.1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=volunteer.env, start_new_session=True,
    )  # fmt: skip
    lines: list[dict[str, Any]] = []
    assert join.stdout is not None
    try:
        for raw in join.stdout:
            line = json.loads(raw)
            lines.append(line)
            if line["event"] == "status" and line["samples_total"] > 0:
                break
        else:
            pytest.fail(f"join ended before training: {lines} {join.stderr.read() if join.stderr else ''}")
        texts = [line.get("text", "") for line in lines if line["event"] == "message"]
        assert any("started the agent in the background" in t for t in texts), texts
        # the shell that started the agent goes away (Ctrl-C detaches); training goes on
        join.send_signal(signal.SIGINT)
        out, err = join.communicate(timeout=60)
    finally:
        if join.poll() is None:
            join.kill()
    assert join.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["event"] == "summary" and summary["detached"] is True
    trained = contribution(volunteer.state())["samples_total"]
    volunteer.wait(
        "training to go on without join", lambda s: contribution(s)["samples_total"] > trained + 64
    )

    # one agent per user
    second = volunteer.run("agent", timeout=60)
    assert second.returncode != 0 and "already running" in second.stderr, second.stderr
    assert second.stderr.count("\n") == 1, "one line, never a traceback"

    # pause from the shell: the worker stops computing, the reason is shown
    paused = volunteer.run("pause")
    assert paused.returncode == 0 and "paused" in paused.stdout
    state = volunteer.wait("the worker to pause", lambda s: contribution(s).get("state") == "paused")
    assert contribution(state)["pause_reasons"] == ["paused by you"]
    assert volunteer.run("status").stdout.startswith("paused: run shapes"), "status must say why"
    assert "(paused by you)" in volunteer.run("status").stdout
    held = contribution(state)["samples_total"]
    for _ in range(3):  # watching for something that must not happen takes a while: three seconds
        time.sleep(1)
        assert contribution(volunteer.state())["samples_total"] == held, "a paused worker must not train"

    # resume: training continues where it stopped
    assert volunteer.run("resume").returncode == 0
    volunteer.wait("training again", lambda s: contribution(s)["samples_total"] > held)

    # finish: the current lease is completed and reported, then the agent pauses
    completed = contribution(volunteer.state())["leases_completed"]
    finish = volunteer.run("finish")
    assert finish.returncode == 0, finish.stderr
    state = volunteer.wait(
        "the lease to be finished, then a pause",
        lambda s: (
            contribution(s).get("state") == "paused" and contribution(s)["leases_completed"] > completed
        ),
    )
    assert state["paused_by_user"] is True and not contribution(state)["finishing"]

    # leave: the session ends and its leases go back to the queue; the agent stays
    left = volunteer.run("leave")
    assert left.returncode == 0 and left.stdout.startswith("left run shapes"), left.stdout + left.stderr
    assert contribution(volunteer.state())["state"] == "stopped"
    assert active_leases(data) == 0
    assert volunteer.run("status").stdout.startswith("idle")

    # stop: the agent ends; the shell commands say so in one line
    pid = volunteer.agent_pid()
    assert pid is not None
    assert volunteer.run("stop").returncode == 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the agent must end after `stop`"
    gone = volunteer.run("status")
    assert gone.returncode == 1 and "no agent is running" in gone.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
        return status != "Z"
    return True

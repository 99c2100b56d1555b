"""A real ``serve`` for the attack suite, set up as a volunteer run is: a run, the organizer token, an
honest volunteer with a session and a lease. Module-scoped: the fuzzer and the floods share one server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import create_run_over_http, python_env, register_and_join, start_serve


@dataclass
class Target:
    """A running coordinator and the credentials an attacker might hold or forge against it."""

    url: str
    data_dir: Path
    process: subprocess.Popen[str]
    admin: str
    volunteer: str
    session_id: str
    lease_id: str
    peer_token: str
    answers: dict[int, int] = field(default_factory=dict)
    """Status codes of the fuzzer's requests, counted (docs/reliability.md#figures: junk requests)."""

    def count(self, status: int) -> None:
        self.answers[status] = self.answers.get(status, 0) + 1

    def server_errors(self) -> int:
        """Answers that are bugs: every 5xx but a documented 503/504 "try again later"."""
        return sum(n for status, n in self.answers.items() if status >= 500 and status not in (503, 504))

    def log(self) -> str:
        return "".join(getattr(self.process, "output_lines", []))


def lifted_limits(**extra: str) -> dict[str, str]:
    """Environment for a serve whose rate limits do not hide what lies behind them."""
    return python_env(
        VOLUNTEER_COORDINATOR_LIMITS__REGISTER_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__JOIN_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__HEARTBEAT_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__REFRESH_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__LEASE_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__READ_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__BURST="100000",
        **extra,
    )


def prepare(url: str, data_dir: Path, process: subprocess.Popen[str], key_dir: Path) -> Target:
    admin = (data_dir / "admin-token").read_text().strip()
    with httpx.Client(base_url=url, timeout=30) as http:
        create_run_over_http(http, admin, {"preset": "tiny", "num_shards": 64})
        credential, _, joined = register_and_join(http, "honest", key_dir / "honest.rsa")
        assert joined.status_code == 200, joined.text
        body = joined.json()
    return Target(
        url=url,
        data_dir=data_dir,
        process=process,
        admin=admin,
        volunteer=credential,
        session_id=body["session_id"],
        lease_id=body["lease"]["lease_id"],
        peer_token=body["peer_token"],
    )


def kill(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def serve_target(root: Path, env: dict[str, str]) -> Iterator[Target]:
    """A ``serve --no-swarm`` on ``root``/data with ``env``, set up by :func:`prepare`; killed afterwards."""
    started: list[subprocess.Popen[Any]] = []
    try:
        process, url = start_serve(root / "data", started, "--no-swarm", env=env)
        yield prepare(url, root / "data", process, root)
    finally:
        for process in started:
            kill(process)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from serve_target(tmp_path_factory.mktemp("target"), lifted_limits())


PYTHON = sys.executable

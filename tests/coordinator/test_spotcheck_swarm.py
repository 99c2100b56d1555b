"""Proof-of-training spot checks end to end: a real ``serve`` (whose swarm peer runs the checks), two real
``volunteer-app join`` peers training together on loopback, every completed lease checked.

Both peers train honestly; the liar's agent talks to the coordinator through a loopback HTTP relay that
rewrites the loss of every lease it completes to 0.001 (what a volunteer who wants to look good, or who
did not train, would send). The honest peer's checked leases must pass and keep their credit; the liar's
must fail, lose their credit and flag the volunteer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from coordinator.models import SpotCheck, Volunteer
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from tests.conftest import bearer, python_env, start_serve, stop_serve
from tests.workers.test_collaborative_training import Peer

pytestmark = pytest.mark.swarm
FAKE_LOSS = 0.001


class LossRewritingRelay:
    """A loopback HTTP relay to ``target`` that rewrites ``loss`` in every lease-completion body."""

    def __init__(self, target: str):
        client = httpx.Client(base_url=target, timeout=30)
        self.rewritten = 0
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "POST" and self.path.endswith("/complete") and body:
                    payload = json.loads(body)
                    if payload.get("loss") is not None:
                        payload["loss"] = FAKE_LOSS
                        relay.rewritten += 1
                    body = json.dumps(payload).encode()
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length", "connection")
                }
                answer = client.request(self.command, self.path, content=body, headers=headers)
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "content-encoding",
                    ):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.client = client

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@pytest.fixture
def relay_factory() -> Iterator[list[LossRewritingRelay]]:
    relays: list[LossRewritingRelay] = []
    yield relays
    for relay in relays:
        relay.close()


def _checks(store: Store) -> dict[str, list[tuple[str, str]]]:
    """Decided spot checks by volunteer name: ``[(state, detail)]``."""
    found: dict[str, list[tuple[str, str]]] = {}
    with store.read() as db:
        for check, name in db.execute(
            select(SpotCheck, Volunteer.name).join(Volunteer, Volunteer.id == SpotCheck.volunteer_id)
        ):
            found.setdefault(name, []).append((check.state, check.detail or ""))
    return found


@pytest.mark.timeout(240)
def test_spot_checks_pass_honest_peers_and_catch_a_made_up_loss(
    tmp_path: Path, kill_leftovers: list[Any], relay_factory: list[LossRewritingRelay]
) -> None:
    import subprocess
    import sys

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=64",
         "--target-batch-size", "64", "--matchmaking-time", "2", "--averaging-timeout", "20", "--local-updates"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    env = python_env(
        VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1",
        VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL="0",
        VOLUNTEER_COORDINATOR_CREDIT__SPOT_CHECK_FRACTION="1.0",
        VOLUNTEER_COORDINATOR_CREDIT__FLAGGED_SPOT_CHECK_FRACTION="1.0",
        # a check the shared model cannot judge yet (not past the peer's epoch) is offered again after 6 s
        VOLUNTEER_COORDINATOR_CREDIT__SPOT_CHECK_TIMEOUT="60",
    )
    process, url = start_serve(data, kill_leftovers, env=env)
    relay = LossRewritingRelay(url)
    relay_factory.append(relay)
    store = Store(CoordinatorSettings(data_dir=data).resolved_database_url)
    peers = [Peer(url, "shapes", "honest", tmp_path), Peer(relay.url, "shapes", "liar", tmp_path)]
    try:
        deadline = time.monotonic() + 170
        checks: dict[str, list[tuple[str, str]]] = {}
        while time.monotonic() < deadline:
            checks = _checks(store)
            honest = [s for s, _ in checks.get("honest", []) if s in ("passed", "failed")]
            liar = [s for s, _ in checks.get("liar", []) if s in ("passed", "failed")]
            if len(honest) >= 2 and liar:
                break
            for peer in peers:
                assert peer.process.poll() is None, f"{peer.name} exited: {peer.worker_log()}"
            time.sleep(1.0)
        else:
            log = (data / "swarm" / "shapes.log").read_text()[-3000:]
            raise AssertionError(f"not enough spot checks decided: {checks}\n{log}")
        assert relay.rewritten >= 1
        honest_states = {state for state, _ in checks["honest"] if state in ("passed", "failed")}
        assert honest_states == {"passed"}, checks["honest"]
        liar_decided = [(s, d) for s, d in checks["liar"] if s in ("passed", "failed")]
        assert all(state == "failed" for state, _ in liar_decided), liar_decided
        assert "below" in liar_decided[0][1] and "reported loss 0.0010" in liar_decided[0][1]
        admin = (data / "admin-token").read_text().strip()
        with httpx.Client(base_url=url, timeout=10) as http:
            flags = http.get("/api/v1/runs/shapes/flags", headers=bearer(admin)).json()
            assert ("liar", "spot_check_failed") in {(f["volunteer"], f["kind"]) for f in flags}
            assert not any(f["volunteer"] == "honest" and f["kind"] == "spot_check_failed" for f in flags)
            board = {e["volunteer"]: e for e in http.get("/api/v1/runs/shapes/leaderboard").json()["entries"]}
        # the failed leases lost their credit: the liar keeps at most what is still pending a check
        assert board["liar"]["verified_samples"] - board["liar"]["pending_samples"] <= 0, board["liar"]
        assert board["liar"]["flagged"] >= 1
        assert board["honest"]["verified_samples"] - board["honest"]["pending_samples"] >= 64, board["honest"]
    finally:
        for peer in peers:
            try:
                peer.stop(timeout=60)
            except Exception:
                peer.kill()
        store.close()
    assert stop_serve(process) == 0
    assert "Traceback" not in (data / "swarm" / "shapes.log").read_text()

"""The coordinator's swarm peer: real hivemind peers on loopback against a real ``serve`` process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PROFILE, bearer, create_run_on_disk, python_env, start_serve, stop_serve
from volunteer_app.identity import ensure_rsa_key, public_key_openssh

pytestmark = pytest.mark.swarm
CLIENT = Path(__file__).with_name("dht_client.py")


def _dht_client(**args: Any) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(CLIENT), json.dumps(args)],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=120,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"DHT client printed nothing: {result.stderr[-2000:]}"
    return json.loads(lines[-1])


def _wait_for_swarm(http: httpx.Client, run: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        peers = http.get(f"/api/v1/runs/{run}").json()["initial_peers"]
        if peers:
            return peers
        time.sleep(0.5)
    raise AssertionError("the swarm peer never published its address")


@pytest.mark.timeout(300)
def test_swarm_peer_admits_valid_tokens_refuses_forged_and_revoked_and_reads_progress(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    data = tmp_path / "data"
    create_run_on_disk(data)
    env = python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1")
    process, url = start_serve(data, kill_leftovers, env=env)
    with httpx.Client(base_url=url, timeout=10) as http:
        initial_peers = _wait_for_swarm(http, "shapes")
        assert all(p.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in p for p in initial_peers)
        # the web process reaches the swarm peer's generate service (another process) over its socket
        generated = http.post(
            "/api/v1/runs/shapes/generate", json={"prompt": "a big red circle in the center"}
        )
        assert generated.status_code == 503 and generated.json()["error"] == "no_checkpoint", generated.text
        admin = (data / "admin-token").read_text().strip()

        def volunteer(name: str) -> tuple[str, dict[str, Any], Path]:
            credential = http.post("/api/v1/volunteers", json={"name": name}).json()["credential"]
            key_path = tmp_path / f"{name}.rsa"
            body = {
                "profile": PROFILE,
                "agent_version": "t",
                "peer_public_key": public_key_openssh(ensure_rsa_key(key_path)),
            }
            answer = http.post("/api/v1/runs/shapes/join", json=body, headers=bearer(credential)).json()
            return credential, answer, key_path

        alice_credential, alice, alice_key = volunteer("alice")
        common = {
            "initial_peers": alice["initial_peers"],
            "keys": alice["coordinator_keys"],
            "run": "shapes",
            "hivemind_run_id": alice["run"]["hivemind_run_id"],
        }
        # a peer holding a valid token bootstraps and publishes signed progress
        valid = _dht_client(**common, token=alice["peer_token"], key_path=str(alice_key), progress=64)
        assert valid == {"joined": True, "error": None}
        # the forger is refused by the coordinator's swarm peer
        _mallory_credential, mallory, mallory_key = volunteer("mallory")
        forged = _dht_client(**common, token=mallory["peer_token"], key_path=str(mallory_key), forge=True)
        assert not forged["joined"] and "bootstrap failed" in forged["error"]
        # the swarm peer saw alice's progress record, so her lease is credited as verified
        time.sleep(1.0)
        done = http.post(
            f"/api/v1/sessions/{alice['session_id']}/leases/{alice['lease']['lease_id']}/complete",
            json={"samples": 64, "compute_seconds": 2.0},
            headers=bearer(alice_credential),
        ).json()
        assert done["credited_samples"] == 64 and not done["flagged"], done
        board = http.get("/api/v1/runs/shapes/leaderboard").json()["entries"]
        assert board[0]["volunteer"] == "alice" and board[0]["verified_samples"] == 64
        # a ban revokes mallory's still-unexpired token in the swarm too
        assert _dht_client(**common, token=mallory["peer_token"], key_path=str(mallory_key))["joined"]
        http.post("/api/v1/volunteers/mallory/ban", json={"reason": "test"}, headers=bearer(admin))
        time.sleep(3.0)  # the swarm peer's next poll pushes the revocation into its authorizer
        revoked = _dht_client(**common, token=mallory["peer_token"], key_path=str(mallory_key))
        assert not revoked["joined"]
    assert stop_serve(process) == 0
    assert "Traceback" not in (data / "swarm" / "shapes.log").read_text()

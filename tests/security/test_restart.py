"""A ``serve`` that is killed (SIGKILL: a crash, an OOM kill, a power cut of the process) and started again
loses nothing it answered for: runs, credit verified and unverified, flags, a pending spot check, the
bans, which peer key is whose, which peer token is spent, and the active lease."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import (
    PROFILE,
    bearer,
    create_run_over_http,
    python_env,
    register_and_join,
    start_serve,
    stop_serve,
    swarm_saw,
)


def _state(http: httpx.Client, admin: str) -> dict[str, Any]:
    def without_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in row.items() if k not in ("last_seen", "online", "samples_per_second")}
            for row in rows
        ]

    run = http.get("/api/v1/runs/shapes").json()
    return {
        "run": {k: run[k] for k in ("state", "task_config", "optimizer")},
        "stats": {
            k: run["stats"][k]
            for k in ("shards_done", "samples_credited", "samples_verified", "samples_total")
        },
        "board": without_times(http.get("/api/v1/runs/shapes/leaderboard").json()["entries"]),
        "volunteers": without_times(http.get("/api/v1/volunteers", headers=bearer(admin)).json()),
        "flags": http.get("/api/v1/runs/shapes/flags", headers=bearer(admin)).json(),
    }


def test_a_killed_serve_restarts_with_everything_it_answered_for(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    data = tmp_path / "data"
    # every completion is picked for a spot check, so one is pending when the server dies
    env = python_env(VOLUNTEER_COORDINATOR_CREDIT__SPOT_CHECK_FRACTION="1")
    process, url = start_serve(data, kill_leftovers, "--no-swarm", env=env)
    admin = (data / "admin-token").read_text().strip()
    with httpx.Client(base_url=url, timeout=10) as http:
        create_run_over_http(http, admin, {"num_shards": 4, "samples_per_shard": 64})
        people = {}
        for name in ("alice", "mallory"):
            credential, key, joined = register_and_join(http, name, tmp_path / f"{name}.rsa")
            people[name] = (credential, key, joined.json())
        alice_credential, _, alice = people["alice"]
        mallory_credential, mallory_key, mallory = people["mallory"]
        swarm_saw(data, alice["session_id"])
        time.sleep(0.3)  # past the leases' minimum duration (64 samples on 2 threads: 0.032 s)
        done = http.post(
            f"/api/v1/sessions/{alice['session_id']}/leases/{alice['lease']['lease_id']}/complete",
            json={"samples": 64, "compute_seconds": 0.3, "loss": 2.5},
            headers=bearer(alice_credential),
        ).json()
        assert done["verified"] and done["pending_check"]
        unverified = http.post(
            f"/api/v1/sessions/{mallory['session_id']}/leases/{mallory['lease']['lease_id']}/complete",
            json={"samples": 640, "compute_seconds": 0.3},
            headers=bearer(mallory_credential),
        ).json()
        assert not unverified["verified"] and unverified["flagged"]
        active = http.post(f"/api/v1/sessions/{alice['session_id']}/leases", headers=bearer(alice_credential))
        active_lease = active.json()["lease"]
        refreshed = http.post(
            f"/api/v1/sessions/{alice['session_id']}/token",
            json={"peer_token": alice["peer_token"]},
            headers=bearer(alice_credential),
        )
        assert refreshed.status_code == 200
        assert http.post("/api/v1/volunteers/mallory/ban", json={}, headers=bearer(admin)).status_code == 200
        before = _state(http, admin)
    assert before["board"][0]["pending_samples"] == 64 and before["flags"]

    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    process, url = start_serve(data, kill_leftovers, "--no-swarm", env=env)
    with httpx.Client(base_url=url, timeout=10) as http:
        assert _state(http, admin) == before
        # the spent token stays spent, the banned key stays banned, the active lease can be finished
        replay = http.post(
            f"/api/v1/sessions/{alice['session_id']}/token",
            json={"peer_token": alice["peer_token"]},
            headers=bearer(alice_credential),
        )
        assert replay.json()["error"] == "token_superseded"
        sybil = http.post("/api/v1/volunteers", json={"name": "mallory2"}).json()["credential"]
        evading = http.post(
            "/api/v1/runs/shapes/join",
            json={"profile": PROFILE, "agent_version": "t", "peer_public_key": mallory_key},
            headers=bearer(sybil),
        )
        assert evading.json()["error"] == "peer_key_banned"
        finished = http.post(
            f"/api/v1/sessions/{alice['session_id']}/leases/{active_lease['lease_id']}/complete",
            json={"samples": 64, "compute_seconds": 0.3, "loss": 2.4},
            headers=bearer(alice_credential),
        )
        assert finished.status_code == 200 and finished.json()["credited_samples"] == 64
    assert stop_serve(process) == 0

"""A real ``serve`` process: the README's walk-through over HTTP, and a restart that loses nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import (
    bearer,
    create_run_on_disk,
    register_and_join,
    start_serve,
    stop_serve,
    swarm_saw,
)


def test_restart_of_serve_on_the_same_data_dir_loses_nothing(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    data = tmp_path / "data"
    process, url = start_serve(data, kill_leftovers, "--no-swarm")
    create_run_on_disk(data, "--config", "num_shards=3", "--config", "samples_per_shard=64")
    admin = (data / "admin-token").read_text().strip()
    with httpx.Client(base_url=url, timeout=10) as http:
        credential, _, joined = register_and_join(http, "alice", tmp_path / "peer.rsa")
        join = joined.json()
        sid, lease = join["session_id"], join["lease"]["lease_id"]
        swarm_saw(data, sid)  # what the run's swarm peer writes when it reads alice's progress record
        http.post(
            f"/api/v1/sessions/{sid}/heartbeat",
            headers=bearer(credential),
            json={"state": "training", "samples_total": 64, "samples_per_second": 30.0, "loss": 3.0},
        )
        time.sleep(1)
        done = http.post(
            f"/api/v1/sessions/{sid}/leases/{lease}/complete",
            headers=bearer(credential),
            json={"samples": 64, "compute_seconds": 1.0},
        ).json()
        assert done["credited_samples"] == 64
        before = http.get("/api/v1/runs/shapes/leaderboard").json()["entries"]
    assert stop_serve(process) == 0

    process, url = start_serve(data, kill_leftovers, "--no-swarm")
    with httpx.Client(base_url=url, timeout=10) as http:
        after = http.get("/api/v1/runs/shapes/leaderboard").json()["entries"]
        assert [(e["volunteer"], e["samples"]) for e in after] == [
            (e["volunteer"], e["samples"]) for e in before
        ]
        run = http.get("/api/v1/runs/shapes").json()
        assert run["stats"]["shards_done"] == 1 and run["stats"]["samples_total"] == 64
        # the credential, the session, the signing key and the lease history all survived
        beat = http.post(
            f"/api/v1/sessions/{sid}/heartbeat",
            headers=bearer(credential),
            json={"state": "training", "samples_total": 128, "samples_per_second": 30.0},
        )
        assert beat.status_code == 200, beat.text
        refreshed = http.post(
            f"/api/v1/sessions/{sid}/token",
            json={"peer_token": join["peer_token"]},
            headers=bearer(credential),
        )
        assert refreshed.status_code == 200, refreshed.text
        again = http.post(
            f"/api/v1/sessions/{sid}/leases/{lease}/complete",
            headers=bearer(credential),
            json={"samples": 64, "compute_seconds": 1.0},
        ).json()
        assert again["already_completed"] and again["credited_samples"] == 64
        assert http.get("/api/v1/volunteers", headers=bearer(admin)).json()[0]["name"] == "alice"
        dashboard = http.get("/dashboard/")
        assert dashboard.status_code == 200 and "text/html" in dashboard.headers["content-type"]
    assert stop_serve(process) == 0


def test_a_restarted_serve_never_hands_out_its_previous_swarm_address(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    """The previous serve's swarm peer is gone: volunteers must get the new one's address, never the old."""
    from sqlalchemy import select

    from coordinator.models import Run
    from coordinator.settings import CoordinatorSettings
    from coordinator.store import Store

    data = tmp_path / "data"
    create_run_on_disk(data)
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmPreviousSwarmPeerThatIsGone"
    store = Store(CoordinatorSettings(data_dir=data).resolved_database_url)
    with store.write() as db:  # what the previous serve's swarm peer left behind a moment ago
        run = db.scalars(select(Run)).one()
        run.swarm_maddrs, run.swarm_updated_at = [dead], time.time()
    store.close()
    process, url = start_serve(data, kill_leftovers)
    try:
        deadline = time.monotonic() + 60
        while True:
            peers = httpx.get(f"{url}/api/v1/runs/shapes").json()["initial_peers"]
            assert dead not in peers
            if peers:
                break
            assert time.monotonic() < deadline, "the new swarm peer never published its address"
            time.sleep(0.3)
        assert all("/p2p/" in p and p.startswith("/ip4/127.0.0.1/tcp/") for p in peers)
    finally:
        assert stop_serve(process) == 0

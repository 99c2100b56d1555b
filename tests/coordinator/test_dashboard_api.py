"""The dashboard's API with a moved clock: the run time series (recorded on change, merged as it ages, kept
across restarts), the peers table and its flags, volunteers' pages, unbanning, invite codes, published
checkpoints, the task catalogue and ``/metrics``."""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.api import create_app
from coordinator.checkpoints import MODEL_FILE, CheckpointStore, checkpoint_directory
from coordinator.models import SeriesPoint
from coordinator.monitoring import series
from tests.conftest import bearer
from tests.coordinator.conftest import Clocked, FakeClock, make_clocked, swarm_sees


@pytest.fixture
def c(tmp_path: Path) -> Any:
    yield from make_clocked(tmp_path)


def tick(c: Clocked) -> list[str]:
    """One tick of the series recorder, as the app's lifespan runs it every ``series.interval``."""
    resources = c.client.app.state.resources  # type: ignore[attr-defined]
    recorder = getattr(c, "_recorder", None)
    if recorder is None:
        recorder = series.SeriesRecorder(settings=c.settings, clock=c.clock)
        c._recorder = recorder  # type: ignore[attr-defined]
    return recorder.tick(resources.store, touched=resources.hub.take_touched())


def write_checkpoint(c: Clocked, epoch: int, accuracy: float, *, run: str = "shapes") -> None:
    """A checkpoint as the swarm peer writes it (its model bytes do not matter to the web process)."""
    CheckpointStore(checkpoint_directory(c.settings.data_dir, run)).write(
        epoch=epoch,
        files={MODEL_FILE: b"weights-%d" % epoch},
        manifest={
            "run": run,
            "task": "shapes-dalle",
            "task_config": {},
            "samples": epoch * 512,
            "saved_at": c.clock(),
            "metric": "prompt_accuracy",
            "metrics": {"prompt_accuracy": accuracy, "loss": 2.0 - accuracy},
            "prompts": [],
        },
    )


# ------------------------------------------------------------------------------------------ series
def test_the_series_records_changes_only_and_serves_them_oldest_first(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    session = c.join(alice)["session_id"]
    c.clock.advance(5)
    assert tick(c) == ["shapes"]  # the join touched the run
    c.clock.advance(10)
    assert tick(c) == []  # nothing changed: an idle run adds no rows
    for i, (sps, loss) in enumerate([(20.0, 3.0), (30.0, 2.5), (40.0, 2.0)]):
        c.clock.advance(10)
        c.heartbeat(alice, session, samples_per_second=sps, loss=loss, samples_total=100 * (i + 1))
        assert tick(c) == ["shapes"]
    data = c.client.get("/api/v1/runs/shapes/series").json()
    assert data["metric_name"] == "prompt_accuracy" and data["interval"] == c.settings.series.interval
    assert data["samples_per_second"] == [0.0, 20.0, 30.0, 40.0]
    assert data["loss"] == [None, 3.0, 2.5, 2.0]
    assert data["peers"] == [1.0, 1.0, 1.0, 1.0]
    assert data["t"] == sorted(data["t"]) and len(set(data["t"])) == 4
    assert data["samples_total"][-1] == 300.0
    later = c.client.get("/api/v1/runs/shapes/series", params={"since": data["t"][1]}).json()
    assert later["samples_per_second"] == [30.0, 40.0]
    # the peer goes silent: the drop to zero peers is recorded once, then nothing more
    c.clock.advance(c.settings.work.session_timeout + 1)
    assert tick(c) == ["shapes"]
    c.clock.advance(10)
    assert tick(c) == []
    assert c.client.get("/api/v1/runs/shapes/series").json()["peers"][-1] == 0.0
    assert c.client.get("/api/v1/runs/nope/series").status_code == 404
    assert c.client.get("/api/v1/runs/shapes/series", params={"since": -1}).status_code == 422


def test_a_new_checkpoint_puts_its_held_out_metric_in_the_series_once(c: Clocked) -> None:
    c.create_run()
    tick(c)
    write_checkpoint(c, 2, 0.25)
    c.clock.advance(10)
    assert tick(c) == ["shapes"]
    c.clock.advance(10)
    assert tick(c) == []  # the same checkpoint again: nothing new
    write_checkpoint(c, 4, 0.5)
    c.clock.advance(10)
    tick(c)
    data = c.client.get("/api/v1/runs/shapes/series").json()
    assert [m for m in data["metric"] if m is not None] == [0.25, 0.5]
    assert [m for m in data["eval_loss"] if m is not None] == [1.75, 1.5]


def test_aged_points_are_merged_into_coarser_ones(c: Clocked) -> None:
    """Ten days of points a minute apart, merged: the last hour stays raw, the day before by the minute,
    the week before by 10 minutes, older by the hour; throughput averaged, cumulative figures and the
    held-out metric kept. (tests/perf/bench_series.py measures a month at the default 10 s.)"""
    c.create_run()
    store = c.client.app.state.resources.store  # type: ignore[attr-defined]
    interval = 60.0
    start = math.floor(c.clock() / 86400) * 86400  # a whole day, so that buckets are whole
    total = int(10 * 86400 / interval)
    with store.write() as db:
        run_id = _run_id(db)
        db.execute(
            SeriesPoint.__table__.insert(),
            [
                {
                    "run_id": run_id,
                    "t": start + i * interval,
                    "span": 0.0,
                    "n": 1,
                    "peers": float(i % 4),
                    "samples_per_second": 100.0 + (i % 2) * 50.0,
                    "loss": 3.0 if i % 3 else None,
                    "metric": 0.5 if i % 30 == 0 else None,
                    "eval_loss": None,
                    "checkpoint_epoch": i if i % 30 == 0 else None,
                    "samples_total": float(i * 1000),
                    "samples_verified": 0.0,
                    "global_epoch": i // 100,
                    "averaging_rounds": 0.0,
                    "bytes": float(i),
                }
                for i in range(total)
            ],
        )
    now = start + total * interval
    with store.write() as db:
        removed = series.compact(db, run_id=run_id, now=now)
    with store.read() as db:
        rows = list(
            db.scalars(select(SeriesPoint).where(SeriesPoint.run_id == run_id).order_by(SeriesPoint.t))
        )
    assert len(rows) + removed == total
    spans = [r.span for r in rows]
    assert spans.count(3600.0) == 3 * 24 and spans.count(600.0) == 6 * 144
    assert spans.count(60.0) == 23 * 60 and spans.count(0.0) == 60
    assert spans == sorted(spans, reverse=True)  # coarser the older
    hourly = rows[0]
    assert (
        hourly.n == 60 and math.isclose(hourly.samples_per_second, 125.0) and math.isclose(hourly.peers, 1.5)
    )
    assert hourly.loss == 3.0 and hourly.samples_total == 59_000.0  # the span's last
    assert hourly.metric == 0.5 and hourly.checkpoint_epoch == 30
    # merging again changes nothing (each bucket is merged once per tier)
    with store.write() as db:
        assert series.compact(db, run_id=run_id, now=now) == 0
    served = c.client.get("/api/v1/runs/shapes/series").json()
    assert len(served["t"]) == len(rows) and served["span"][0] == 3600.0


def _run_id(db: Any) -> str:
    from coordinator.models import Run

    return str(db.scalar(select(Run.id)))


def test_the_series_survives_a_restart_and_the_live_feed_sends_each_new_point(tmp_path: Path) -> None:
    for c in make_clocked(tmp_path):
        c.create_run()
        alice = c.register("alice")
        session = c.join(alice)["session_id"]
        with c.client.websocket_connect("/api/v1/runs/shapes/live") as feed:
            first = feed.receive_json()
            assert first["type"] == "snapshot" and first["point"] is None
            c.clock.advance(10)
            c.heartbeat(alice, session, samples_per_second=25.0, loss=2.0)
            tick(c)
            hub = c.client.app.state.resources.hub  # type: ignore[attr-defined]
            c.client.portal.call(hub.publish)  # type: ignore[union-attr]
            update = feed.receive_json()
            assert update["type"] == "update" and update["point"]["samples_per_second"] == 25.0
        before = c.client.get("/api/v1/runs/shapes/series").json()
    clock = FakeClock()
    with TestClient(create_app(c.settings, clock=clock)) as again:
        assert again.get("/api/v1/runs/shapes/series").json() == before


# ------------------------------------------------------------------------------------------ peers
def test_the_peers_table_shows_hardware_assignment_lease_and_what_to_look_at(c: Clocked) -> None:
    c.create_run()
    gpu = {"name": "RTX 4090", "memory_bytes": 24 * 10**9}
    alice, bob, carol = c.register("alice"), c.register("bob"), c.register("carol")
    a = c.join(alice)["session_id"]
    b = c.join(bob, profile={**_profile(), "gpus": [gpu]})["session_id"]
    k = c.join(carol)["session_id"]
    c.heartbeat(alice, a, samples_per_second=10.0, loss=2.0, samples_total=10)
    c.heartbeat(bob, b, samples_per_second=1e7, loss=None, samples_total=100)  # above its cap, no loss
    c.clock.advance(c.settings.work.heartbeat_interval * 3)
    c.heartbeat(alice, a, samples_per_second=10.0, loss=2.0, samples_total=10)
    c.heartbeat(bob, b, samples_per_second=10.0, loss=None, samples_total=200)
    peers = {p["volunteer"]: p for p in c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()}
    assert set(peers) == {"alice", "bob", "carol"}
    assert peers["bob"]["hardware"]["gpus"] == [gpu] and peers["bob"]["assignment"]["device"] == "cuda"
    assert (
        peers["alice"]["hardware"]["cpu_model"] == "Test CPU" and peers["alice"]["hardware"]["cpu_cores"] == 2
    )
    assert (
        peers["alice"]["assignment"]["micro_batch_size"] >= 1 and peers["alice"]["assignment"]["threads"] >= 1
    )
    assert peers["alice"]["lease"]["shard"] >= 0 and peers["alice"]["leases_held"] == 1
    assert peers["alice"]["token_expires_at"] > c.clock()
    assert peers["alice"]["peer_key"].startswith("SHA256:") and peers["alice"]["online"]
    assert peers["alice"]["flags"] == []
    assert set(peers["bob"]["flags"]) == {"capped", "nan_loss"} and peers["bob"]["flag_count"] >= 1
    assert peers["carol"]["flags"] == ["stale"]  # joined, never heartbeat since
    # a lease completed without the swarm seeing the peer is unverified credit
    lease = c.join(alice)["lease"]
    c.clock.advance(60)
    session = c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()
    fresh = next(p for p in session if p["volunteer"] == "alice" and p["state"] == "active")
    done = c.complete(alice, fresh["session_id"], lease["lease_id"], lease["samples"])
    assert done.status_code == 200, done.text
    fresh = next(
        p
        for p in c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()
        if p["session_id"] == fresh["session_id"]
    )
    assert "unverified" in fresh["flags"] and fresh["unverified_samples"] > 0
    # ended sessions only when asked
    c.client.post(f"/api/v1/sessions/{k}/leave", headers=carol.headers)
    assert "carol" not in {
        p["volunteer"] for p in c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()
    }
    ended = c.client.get("/api/v1/runs/shapes/peers", params={"include_ended": True}, headers=c.admin).json()
    assert "carol" in {p["volunteer"] for p in ended}
    assert c.client.get("/api/v1/runs/nope/peers", headers=c.admin).status_code == 404
    assert c.client.get("/api/v1/runs/shapes/peers").status_code == 401


def _profile() -> dict[str, Any]:
    from tests.conftest import PROFILE

    return dict(PROFILE)


def test_a_volunteer_page_has_its_history_across_runs(c: Clocked) -> None:
    c.create_run()
    c.create_run("second")
    alice = c.register("alice")
    first = c.join(alice)
    swarm_sees(c, first["session_id"])
    c.clock.advance(60)
    done = c.complete(alice, first["session_id"], first["lease"]["lease_id"], first["lease"]["samples"])
    assert done.status_code == 200 and done.json()["verified"], done.text
    c.join(alice, "second")
    c.heartbeat(alice, first["session_id"], samples_per_second=1e7)  # capped: a flag
    page = c.client.get("/api/v1/volunteers/alice", headers=c.admin).json()
    assert page["name"] == "alice" and page["runs"] == 2 and not page["banned"]
    history = {h["run"]: h for h in page["history"]}
    assert history["shapes"]["samples"] == first["lease"]["samples"] == history["shapes"]["verified_samples"]
    assert history["second"]["samples"] == 0 and history["second"]["sessions"] == 1
    assert len(page["sessions"]) == 2 and {s["run"] for s in page["sessions"]} == {"shapes", "second"}
    assert (
        page["recent_flags"][0]["kind"] == "heartbeat_capped" and page["recent_flags"][0]["run"] == "shapes"
    )
    listed = {v["name"]: v for v in c.client.get("/api/v1/volunteers", headers=c.admin).json()}
    assert listed["alice"]["runs"] == 2 and listed["alice"]["samples"] == first["lease"]["samples"]
    assert c.client.get("/api/v1/volunteers/nobody", headers=c.admin).status_code == 404


def test_unban_gives_back_what_the_ban_took_and_nothing_else(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    session = c.join(alice)["session_id"]
    assert c.heartbeat(alice, session).status_code == 200
    banned = c.client.post("/api/v1/volunteers/alice/ban", json={"reason": "test"}, headers=c.admin)
    assert banned.status_code == 200 and banned.json()["sessions_revoked"] == 1
    assert c.heartbeat(alice, session).status_code == 403
    assert c.client.get("/api/v1/volunteers", headers=c.admin).json()[0]["ban_reason"] == "test"
    unbanned = c.client.post("/api/v1/volunteers/alice/unban", headers=c.admin)
    assert unbanned.status_code == 200 and unbanned.json()["banned"] is False
    # the credential works again (a new join); the session the ban stopped stays stopped
    assert c.heartbeat(alice, session).status_code == 403
    again = c.join(alice)
    assert c.heartbeat(alice, again["session_id"]).status_code == 200
    assert c.client.post("/api/v1/volunteers/alice/unban", headers=c.admin).status_code == 200  # harmless


# ------------------------------------------------------------------------------------------ invites
def test_invite_codes_admit_count_expire_and_revoke(c: Clocked) -> None:
    created = c.create_run(visibility="invite")
    own = created["invite_code"]
    made = c.client.post(
        "/api/v1/runs/shapes/invites", json={"label": "meetup", "max_uses": 2}, headers=c.admin
    )
    assert made.status_code == 201, made.text
    code = made.json()["code"]
    assert made.json()["hint"] == code[:8] and made.json()["uses"] == 0
    listed = c.client.get("/api/v1/runs/shapes/invites", headers=c.admin).json()
    assert [i["invite_id"] for i in listed] == [made.json()["invite_id"], "run"]
    assert all("code" not in i for i in listed)  # codes are shown once, when made
    # registering with it admits to the run; joining with it admits a volunteer registered without one
    a = c.register("alice", invite_code=code)
    c.join(a)
    b = c.register("bob")
    c.join(b, invite_code=code)
    assert c.client.get("/api/v1/runs/shapes/invites", headers=c.admin).json()[0]["uses"] == 2
    used_up = c.client.post("/api/v1/volunteers", json={"name": "carol", "invite_code": code})
    assert used_up.status_code == 403 and used_up.json()["error"] == "invalid_invite_code"
    # the run's own code works until revoked; revoking it keeps its members
    c.register("dave", invite_code=own)
    revoked = c.client.post("/api/v1/runs/shapes/invites/run/revoke", headers=c.admin)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert c.client.post("/api/v1/volunteers", json={"name": "erin", "invite_code": own}).status_code == 403
    assert c.client.post("/api/v1/runs/shapes/invites/run/revoke", headers=c.admin).status_code == 404
    assert c.client.post("/api/v1/runs/shapes/invites/nope/revoke", headers=c.admin).status_code == 404
    assert c.heartbeat(a, c.join(a)["session_id"]).status_code == 200
    c.client.post("/api/v1/runs/shapes/finish", headers=c.admin)
    finished = c.client.post("/api/v1/runs/shapes/invites", json={}, headers=c.admin)
    assert finished.status_code == 409 and finished.json()["error"] == "run_finished"


# ------------------------------------------------------------------------------------------ releases
def test_only_published_checkpoints_can_be_downloaded(c: Clocked) -> None:
    c.create_run()
    assert c.client.post("/api/v1/runs/shapes/checkpoints/2/publish", headers=c.admin).status_code == 404
    write_checkpoint(c, 2, 0.4)
    refused = c.client.get("/api/v1/runs/shapes/checkpoints/2/download")
    assert refused.status_code == 404 and refused.json()["error"] == "not_published"
    published = c.client.post("/api/v1/runs/shapes/checkpoints/2/publish", headers=c.admin)
    assert published.status_code == 200 and published.json()["public"] is True
    # the swarm peer keeps the newest few checkpoints; a published one outlives the pruning
    store = CheckpointStore(checkpoint_directory(c.settings.data_dir, "shapes"), keep=2)
    for epoch in (3, 4, 5):
        write_checkpoint(c, epoch, 0.5)
    pruned = {path.name for path in store.prune()}
    assert "epoch-00000003" in pruned and "epoch-00000002" not in pruned
    assert c.client.get("/api/v1/runs/shapes/releases").json()[0]["download"] == (
        "/api/v1/runs/shapes/checkpoints/2/download"
    )
    zipped = c.client.get("/api/v1/runs/shapes/checkpoints/2/download")
    assert zipped.status_code == 200 and zipped.headers["content-type"] == "application/zip"
    bundle = zipfile.ZipFile(io.BytesIO(zipped.content))
    assert bundle.read("shapes-epoch-00000002/model.safetensors") == b"weights-2"
    manifest = json.loads(bundle.read("shapes-epoch-00000002/manifest.json"))
    assert manifest["metrics"]["prompt_accuracy"] == 0.4 and "optimizer" not in manifest
    assert c.client.post("/api/v1/runs/shapes/checkpoints/2/unpublish", headers=c.admin).status_code == 200
    assert c.client.get("/api/v1/runs/shapes/checkpoints/2/download").status_code == 404
    assert c.client.get("/api/v1/runs/shapes/releases").json() == []
    assert c.client.post("/api/v1/runs/shapes/checkpoints/-1/publish", headers=c.admin).status_code == 422


# ------------------------------------------------------------------------------------------ catalogue, metrics
def test_the_task_catalogue_lists_presets_and_fields(c: Clocked) -> None:
    catalog = c.client.get("/api/v1/tasks").json()
    tasks = {t["name"]: t for t in catalog["tasks"]}
    assert {"shapes-dalle", "tiny-lm"} <= set(tasks)
    shapes = tasks["shapes-dalle"]
    assert shapes["metric"] == "prompt_accuracy" and {"tiny", "base"} <= set(shapes["presets"])
    fields = {f["name"]: f for f in shapes["fields"]}
    assert fields["num_shards"]["type"] == "int" and fields["num_shards"]["default"] == 4096
    assert catalog["optimizer_defaults"]["target_batch_size"] >= 1


def _sample(text: str, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = f"{name}{{{selector}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(pattern):
            return float(line.split()[-1])
    raise AssertionError(f"{pattern!r} not in /metrics")


def test_metrics_count_peers_heartbeats_leases_and_refusals_per_run(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    session = c.join(alice)["session_id"]
    for _ in range(3):
        assert c.heartbeat(alice, session, samples_per_second=12.5).status_code == 200
    c.client.get("/api/v1/runs/shapes/peers", headers=bearer("org_wrong"))
    c.client.post(f"/api/v1/sessions/{session}/token", json={"peer_token": "junk"}, headers=alice.headers)
    answer = c.client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    assert _sample(text, "volunteer_coordinator_peers_online", run="shapes") == 1
    assert _sample(text, "volunteer_coordinator_samples_per_second", run="shapes") == 12.5
    assert _sample(text, "volunteer_coordinator_heartbeats_total", run="shapes") == 3
    assert _sample(text, "volunteer_coordinator_leases_issued_total", run="shapes") == 1
    assert _sample(text, "volunteer_coordinator_leases_active", run="shapes") == 1
    assert _sample(text, "volunteer_coordinator_leases_completed_total", run="shapes") == 0
    assert _sample(text, "volunteer_coordinator_runs", state="active") == 1
    assert _sample(text, "volunteer_coordinator_auth_failures_total", reason="invalid_credential") == 1
    assert _sample(text, "volunteer_coordinator_token_failures_total", reason="malformed_token") == 1
    # the lease expires: counted from the store, so the figure is right after a restart too
    c.clock.advance(c.settings.work.lease_max_seconds * 3)
    c.sweep()
    text = c.client.get("/metrics").text
    assert _sample(text, "volunteer_coordinator_leases_expired_total", run="shapes") == 1
    assert _sample(text, "volunteer_coordinator_peers_online", run="shapes") == 0


def test_the_cli_unbans_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.accounts.authority import TokenAuthority
    from coordinator.accounts.volunteers import register
    from coordinator.bootstrap import open_data_dir
    from coordinator.cli import main
    from coordinator.settings import CoordinatorSettings
    from volunteer_app.protocol import RegisterRequest

    data = tmp_path / "data"
    opened = open_data_dir(CoordinatorSettings(data_dir=data))
    with opened.store.write() as db:
        secret = register(db, request=RegisterRequest(name="ada")).credential
    opened.store.close()
    assert main(["volunteers", "ban", "ada", "--data-dir", str(data)]) == 0
    assert main(["volunteers", "unban", "ada", "--data-dir", str(data)]) == 0
    assert "ada is not banned" in capsys.readouterr().out
    opened = open_data_dir(CoordinatorSettings(data_dir=data))
    with opened.store.read() as db:
        assert TokenAuthority.authenticate(db, secret, kind="volunteer").volunteer_id is not None
    opened.store.close()
    assert main(["volunteers", "unban", "nobody", "--data-dir", str(data)]) != 0

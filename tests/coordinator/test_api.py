"""The HTTP API end to end: TestClient(create_app(settings)) on a real SQLite file."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.settings import LimitSettings, TokenSettings, WorkSettings
from tests.conftest import PROFILE, Coordinator, bearer, make_coordinator
from tests.coordinator.conftest import Clocked, make_clocked, swarm_sees
from volunteer_app.tokens import PeerToken, VerifyingKeys, verify_peer_token


def test_health_time_and_openapi(coordinator: Coordinator) -> None:
    health = coordinator.client.get("/api/v1/health").json()
    assert health["status"] == "ok" and health["database"] == "sqlite"
    assert abs(coordinator.client.get("/api/v1/time").json()["server_time"] - time.time()) < 5
    spec = coordinator.client.get("/api/v1/openapi.json").json()
    for path in (
        "/api/v1/runs/{name}/join",
        "/api/v1/sessions/{session_id}/heartbeat",
        "/api/v1/runs/{name}/leaderboard",
    ):
        assert path in spec["paths"]


def test_create_run_validates_the_task_config_field_by_field(coordinator: Coordinator) -> None:
    bad = coordinator.create_run(
        "bad", task_config={"preset": "tiny", "d_model": 100, "n_heads": 3, "no_such_field": 1}, expect=422
    )
    assert bad["error"] == "invalid_task_config"
    assert "task_config.no_such_field" in bad["fields"]
    unknown_preset = coordinator.create_run("bad", task_config={"preset": "enormous"}, expect=422)
    assert (
        "task_config.preset" in unknown_preset["fields"]
        and "tiny" in unknown_preset["fields"]["task_config.preset"]
    )
    wrong_type = coordinator.create_run("bad", task_config={"samples_per_shard": "many"}, expect=422)
    assert "task_config.samples_per_shard" in wrong_type["fields"]
    unknown_task = coordinator.create_run("bad", task="no-such-task", expect=422)
    assert unknown_task["error"] == "unknown_task" and "shapes-dalle" in unknown_task["detail"]
    assert coordinator.create_run("bad-name!", expect=422)["fields"].keys() == {"name"}
    created = coordinator.create_run("shapes")
    assert created["state"] == "active" and created["stats"]["shards_total"] == 4
    assert created["task_config"]["preset"] == "tiny"  # stored in full, defaults filled in
    assert coordinator.create_run("shapes", expect=409)["error"] == "run_exists"
    assert [r["name"] for r in coordinator.client.get("/api/v1/runs").json()] == ["shapes"]


def test_organizer_endpoints_are_closed_to_volunteers_and_strangers(coordinator: Coordinator) -> None:
    alice = coordinator.register("alice")
    body = {"name": "r", "task": "shapes-dalle"}
    assert coordinator.client.post("/api/v1/runs", json=body).json()["error"] == "missing_credential"
    as_volunteer = coordinator.client.post("/api/v1/runs", json=body, headers=alice.headers)
    assert as_volunteer.status_code == 403 and as_volunteer.json()["error"] == "organizer_only"
    forged = coordinator.client.post("/api/v1/runs", json=body, headers=bearer("org_forged"))
    assert forged.status_code == 401 and forged.json()["error"] == "invalid_credential"
    for path in ("/api/v1/volunteers",):
        assert coordinator.client.get(path, headers=alice.headers).status_code == 403
    assert (
        coordinator.client.post("/api/v1/volunteers/alice/ban", json={}, headers=alice.headers).status_code
        == 403
    )
    # and the organizer token is no volunteer credential either
    coordinator.create_run()
    joined = coordinator.client.post("/api/v1/runs/shapes/join", json={}, headers=coordinator.admin)
    assert joined.status_code in (403, 422)


def test_join_answers_everything_a_worker_needs(coordinator: Coordinator) -> None:
    coordinator.create_run()
    alice = coordinator.register("alice")
    answer = coordinator.join(alice)
    keys = VerifyingKeys.from_records(answer["coordinator_keys"])
    claims = verify_peer_token(
        PeerToken.decode(answer["peer_token"]), keys, run="shapes", peer_public_key=alice.public_key.encode()
    )
    assert claims.session == answer["session_id"] and claims.volunteer == answer["volunteer_id"]
    assert 3500 < claims.expires_at - time.time() <= 3600  # default 1 h
    assert answer["run"]["task"] == "shapes-dalle" and answer["run"]["task_config"]["num_shards"] == 4
    assert answer["run"]["hivemind_run_id"].startswith("va-shapes-")
    assignment = answer["assignment"]
    assert (
        assignment["device"] == "cpu" and assignment["threads"] == 2 and assignment["micro_batch_size"] == 16
    )
    assert answer["lease"]["shard"] == 0 and answer["lease"]["samples"] == 64
    assert answer["lease"]["deadline"] > answer["lease"]["issued_at"]
    assert isinstance(answer["initial_peers"], list)
    # limits and hardware shape the assignment
    bob = coordinator.register("bob")
    gpu_profile = {**PROFILE, "benchmark": None, "gpus": [{"name": "RTX 4090", "memory_bytes": 24 * 1024**3}]}
    gpu = coordinator.join(bob, profile=gpu_profile, max_threads=1)["assignment"]
    assert gpu["device"] == "cuda" and gpu["amp"] and gpu["threads"] == 1
    carol = coordinator.register("carol")
    refused = coordinator.join(carol, device="cuda", expect=422)
    assert "device" in refused["fields"]


def test_bad_requests_get_field_level_errors(coordinator: Coordinator) -> None:
    coordinator.create_run()
    alice = coordinator.register("alice")
    c = coordinator.client
    not_json = c.post(
        "/api/v1/runs/shapes/join",
        content=b"{oops",
        headers={**alice.headers, "content-type": "application/json"},
    )
    assert not_json.status_code == 422 and "body" in not_json.json()["fields"]
    missing = c.post("/api/v1/runs/shapes/join", json={"agent_version": "x"}, headers=alice.headers).json()
    assert {"profile", "peer_public_key"} <= set(missing["fields"])
    bad_key = coordinator.join(alice, peer_public_key="ssh-rsa " + "A" * 200, expect=422)
    assert "peer_public_key" in bad_key["fields"]
    negative = coordinator.join(alice, profile={**PROFILE, "cpu_cores": -1}, expect=422)
    assert "profile.cpu_cores" in negative["fields"]
    extra = c.post("/api/v1/volunteers", json={"name": "bob", "is_admin": True}).json()
    assert extra["fields"] == {"is_admin": "Extra inputs are not permitted"}
    huge = c.post("/api/v1/volunteers", content=b"x" * 200_000, headers={"content-type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"] == "request_too_large"
    assert c.get("/api/v1/runs/nope").json() == {"error": "run_not_found", "detail": "no run named 'nope'"}
    assert c.get("/api/v1/no-such-endpoint").json()["error"] == "not_found"


def test_registration_names_and_invite_only_runs(coordinator: Coordinator) -> None:
    created = coordinator.create_run("secret", visibility="invite")
    code = created["invite_code"]
    assert code
    coordinator.register("alice")
    taken = coordinator.client.post("/api/v1/volunteers", json={"name": "alice"})
    assert taken.status_code == 409 and taken.json()["error"] == "name_taken"
    bob = coordinator.register("bob")
    assert coordinator.join(bob, "secret", expect=403)["error"] == "invite_required"
    assert (
        coordinator.join(bob, "secret", invite_code="wrong-code", expect=403)["error"]
        == "invalid_invite_code"
    )
    assert coordinator.join(bob, "secret", invite_code=code)["session_id"]
    wrong = coordinator.client.post("/api/v1/volunteers", json={"name": "carol", "invite_code": "nope-nope"})
    assert wrong.status_code == 403
    carol = coordinator.register("carol", invite_code=code)
    assert coordinator.join(carol, "secret")["session_id"]  # membership came with the registration


def test_heartbeats_move_the_leaderboard_and_carry_commands(coordinator: Coordinator) -> None:
    coordinator.create_run()
    alice, bob = coordinator.register("alice"), coordinator.register("bob")
    a = coordinator.join(alice)
    b = coordinator.join(bob)
    assert (
        coordinator.heartbeat(
            alice, a["session_id"], samples_total=640, samples_per_second=80.0, loss=3.5
        ).json()["commands"]
        == []
    )
    coordinator.heartbeat(bob, b["session_id"], samples_total=64, samples_per_second=20.0, loss=4.5)
    run = coordinator.client.get("/api/v1/runs/shapes").json()
    assert run["stats"]["active_peers"] == 2 and run["stats"]["samples_total"] == 704
    assert run["stats"]["samples_per_second"] == pytest.approx(100.0) and run["stats"][
        "loss"
    ] == pytest.approx(4.0)
    for volunteer, answer, samples in ((alice, a, 64), (bob, b, 10)):
        lease = answer["lease"]["lease_id"]
        done = coordinator.client.post(
            f"/api/v1/sessions/{answer['session_id']}/leases/{lease}/complete",
            json={"samples": samples, "compute_seconds": 0.5},
            headers=volunteer.headers,
        )
        assert done.status_code == 200, done.text
    board = coordinator.client.get("/api/v1/runs/shapes/leaderboard").json()["entries"]
    assert [(e["rank"], e["volunteer"], e["samples"]) for e in board] == [(1, "alice", 64), (2, "bob", 10)]
    assert (
        board[0]["online"]
        and board[0]["devices"] == ["Test CPU (2 cores)"]
        and board[0]["samples_per_second"] == 80.0
    )
    overall = coordinator.client.get("/api/v1/leaderboard").json()
    assert overall["run"] is None and overall["entries"][0]["volunteer"] == "alice"

    assert (
        coordinator.client.post("/api/v1/runs/shapes/pause", headers=coordinator.admin).json()["state"]
        == "paused"
    )
    assert [c["type"] for c in coordinator.heartbeat(alice, a["session_id"]).json()["commands"]] == ["pause"]
    assert coordinator.heartbeat(alice, a["session_id"], state="paused").json()["commands"] == []
    assert coordinator.join(coordinator.register("late"), expect=409)["error"] == "run_paused"
    coordinator.client.post("/api/v1/runs/shapes/resume", headers=coordinator.admin)
    assert [
        c["type"] for c in coordinator.heartbeat(alice, a["session_id"], state="paused").json()["commands"]
    ] == ["resume"]
    coordinator.client.post("/api/v1/runs/shapes/finish", headers=coordinator.admin)
    answer = coordinator.heartbeat(bob, b["session_id"]).json()
    assert answer["run_state"] == "finished" and [c["type"] for c in answer["commands"]] == ["stop"]
    assert coordinator.client.post("/api/v1/runs/shapes/resume", headers=coordinator.admin).status_code == 409


def test_a_session_belongs_to_its_volunteer(coordinator: Coordinator) -> None:
    coordinator.create_run()
    alice, mallory = coordinator.register("alice"), coordinator.register("mallory")
    a = coordinator.join(alice)
    stolen = coordinator.heartbeat(mallory, a["session_id"])
    assert stolen.status_code == 404
    lease = a["lease"]["lease_id"]
    claim = coordinator.client.post(
        f"/api/v1/sessions/{a['session_id']}/leases/{lease}/complete",
        json={"samples": 64, "compute_seconds": 1},
        headers=mallory.headers,
    )
    assert claim.status_code == 404
    assert coordinator.client.get("/api/v1/runs/shapes/leaderboard").json()["entries"][0]["samples"] == 0


@pytest.fixture
def short_tokens(tmp_path: Path) -> Iterator[Coordinator]:
    yield from make_coordinator(
        tmp_path, tokens=TokenSettings(peer_token_ttl=20, refresh_fraction=0.11, refresh_grace=0)
    )


def test_heartbeat_renews_a_token_nearing_expiry(short_tokens: Coordinator) -> None:
    c = short_tokens
    c.create_run()
    alice = c.register("alice")
    answer = c.join(alice)
    assert c.heartbeat(alice, answer["session_id"]).json()["commands"] == []
    time.sleep(2.5)  # past 11 % of a 20 s lifetime
    commands = c.heartbeat(alice, answer["session_id"]).json()["commands"]
    assert [cmd["type"] for cmd in commands] == ["new_token"]
    fresh = PeerToken.decode(commands[0]["peer_token"]).claims
    assert fresh.expires_at > PeerToken.decode(answer["peer_token"]).claims.expires_at + 2
    assert fresh.session == answer["session_id"]


def test_token_refresh_refuses_every_kind_of_bad_token(coordinator: Coordinator) -> None:
    c = coordinator
    c.create_run()
    c.create_run("other")
    alice = c.register("alice")
    a = c.join(alice)
    a_other = c.join(alice, "other", peer_public_key=c.new_key()[1])
    url = f"/api/v1/sessions/{a['session_id']}/token"

    def refresh(token: str) -> tuple[int, str]:
        response = c.client.post(url, json={"peer_token": token}, headers=alice.headers)
        return response.status_code, response.json().get("error", "ok")

    genuine = PeerToken.decode(a["peer_token"])
    assert refresh(a["peer_token"]) == (200, "ok")
    assert refresh("not-a-token") == (401, "malformed_token")
    forged_signature = PeerToken(genuine.claims_json, genuine.peer_public_key, bytes(64))
    assert refresh(forged_signature.encode()) == (401, "forged_token")
    tampered = PeerToken(
        genuine.claims_json.replace(b'"run":"shapes"', b'"run":"other"'),
        genuine.peer_public_key,
        genuine.signature,
    )
    assert refresh(tampered.encode()) == (401, "forged_token")
    authority = c.client.app.state.resources.authority  # type: ignore[attr-defined]
    from volunteer_app.tokens import issue_peer_token

    expired = issue_peer_token(
        authority.signing_key,
        run="shapes",
        volunteer=a["volunteer_id"],
        session=a["session_id"],
        peer_public_key=alice.public_key.encode(),
        ttl=60,
        now=time.time() - 3600,
    )
    assert refresh(expired.encode()) == (401, "expired_token")
    assert refresh(a_other["peer_token"]) == (403, "wrong_run")
    wrong_key = issue_peer_token(
        authority.signing_key,
        run="shapes",
        volunteer=a["volunteer_id"],
        session=a["session_id"],
        peer_public_key=c.new_key()[1].encode(),
        ttl=600,
    )
    assert refresh(wrong_key.encode()) == (403, "wrong_key")
    from volunteer_app.tokens import SigningKey

    stranger = issue_peer_token(
        SigningKey.generate(),
        run="shapes",
        volunteer=a["volunteer_id"],
        session=a["session_id"],
        peer_public_key=alice.public_key.encode(),
        ttl=600,
    )
    assert refresh(stranger.encode()) == (401, "unknown_key")
    # a ban revokes the credential at once and the session's tokens with it
    c.client.post("/api/v1/volunteers/alice/ban", json={"reason": "cheating"}, headers=c.admin)
    assert refresh(a["peer_token"]) == (403, "revoked_credential")


def test_ban_stops_sessions_returns_leases_and_hides_the_volunteer(coordinator: Coordinator) -> None:
    c = coordinator
    c.create_run()
    alice, bob = c.register("alice"), c.register("bob")
    a = c.join(alice)
    banned = c.client.post(
        "/api/v1/volunteers/alice/ban", json={"reason": "cheating"}, headers=c.admin
    ).json()
    assert banned["banned"] and banned["sessions_revoked"] == 1
    assert c.heartbeat(alice, a["session_id"]).json()["error"] == "revoked_credential"
    assert c.client.post("/api/v1/runs/shapes/join", json={}, headers=alice.headers).status_code == 403
    # alice's shard went back to the queue: bob gets shard 0
    assert c.join(bob)["lease"]["shard"] == a["lease"]["shard"]
    assert [e["volunteer"] for e in c.client.get("/api/v1/runs/shapes/leaderboard").json()["entries"]] == [
        "bob"
    ]
    volunteers = {v["name"]: v["banned"] for v in c.client.get("/api/v1/volunteers", headers=c.admin).json()}
    assert volunteers == {"alice": True, "bob": False}
    assert c.client.post("/api/v1/volunteers/nobody/ban", json={}, headers=c.admin).status_code == 404


def test_lease_completion_credits_once_and_caps_impossible_claims(clocked: Clocked) -> None:
    c = clocked
    c.create_run()
    alice = c.register("alice")
    a = c.join(alice)
    sid, lease = a["session_id"], a["lease"]["lease_id"]
    c.clock.advance(1.0)
    swarm_sees(c, sid)
    first = c.complete(alice, sid, lease, 64).json()
    assert first["credited_samples"] == 64 and not first["already_completed"] and first["verified"]
    again = c.complete(alice, sid, lease, 64).json()
    assert again["already_completed"] and again["credited_samples"] == 64 and again["verified"]
    assert c.board()[0]["samples"] == 64  # once
    # more samples than the shard holds: capped at the shard and flagged
    second = c.take(alice, sid).json()["lease"]
    c.clock.advance(1.0)
    over = c.complete(alice, sid, second["lease_id"], 10_000).json()
    assert over["credited_samples"] <= 64 and over["flagged"] and "shard of 64" in over["reason"]
    entry = c.board()[0]
    assert entry["flagged"] >= 1 and entry["samples"] <= 128
    flags = c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()
    assert [(f["volunteer"], f["kind"]) for f in flags] == [("alice", "claim_capped")]


def test_claims_are_capped_at_the_benchmark_within_the_device_ceiling(tmp_path: Path) -> None:
    for c in make_clocked(tmp_path):
        c.create_run(task_config={"preset": "tiny", "num_shards": 4, "samples_per_shard": 100_000})
        alice = c.register("alice")
        slow = {**PROFILE, "benchmark": {**PROFILE["benchmark"], "samples_per_second": 10.0}}
        a = c.join(alice, profile=slow)
        # 100,000 samples on 2 CPU threads take at least 50 s at the device ceiling (1,000/s per thread)
        assert a["lease"]["not_before"] == pytest.approx(a["lease"]["issued_at"] + 50.0)
        c.clock.advance(60.0)
        claim = c.complete(alice, a["session_id"], a["lease"]["lease_id"], 100_000).json()
        # 10 samples/s x 2 threads / 1 benchmarked x 1.5 tolerance x 60 s held, plus one accumulation of slack
        assert claim["credited_samples"] == 10 * 2 * 1.5 * 60 + 64 and claim["flagged"]
        assert "throughput cap" in claim["reason"]


def test_expired_leases_return_to_the_queue_and_the_run_finishes_when_all_shards_are_verified(
    tmp_path: Path,
) -> None:
    work = WorkSettings(lease_min_seconds=1.0, lease_max_seconds=1.0, max_leases_per_session=1)
    for c in make_clocked(tmp_path, work=work):
        c.create_run(task_config={"preset": "tiny", "num_shards": 2, "samples_per_shard": 8})
        alice, bob = c.register("alice"), c.register("bob")
        a = c.join(alice)
        too_many = c.take(alice, a["session_id"])
        assert too_many.status_code == 409 and too_many.json()["error"] == "too_many_leases"
        c.clock.advance(1.2)
        late = c.complete(alice, a["session_id"], a["lease"]["lease_id"], 8)
        assert late.status_code == 409 and late.json()["error"] == "lease_expired"
        b = c.join(bob)
        assert b["lease"]["shard"] == 0  # the expired shard is leased again
        swarm_sees(c, b["session_id"])
        c.clock.advance(0.5)
        assert c.complete(bob, b["session_id"], b["lease"]["lease_id"], 8).status_code == 200
        nxt = c.take(bob, b["session_id"]).json()["lease"]
        assert nxt["shard"] == 1
        c.clock.advance(0.5)
        assert c.complete(bob, b["session_id"], nxt["lease_id"], 8).status_code == 200
        last = c.take(bob, b["session_id"]).json()
        assert last["lease"] is None and last["run_state"] == "finished"
        run = c.client.get("/api/v1/runs/shapes").json()
        assert run["state"] == "finished" and run["stats"]["shards_done"] == 2


def test_leaving_returns_leases_at_once(coordinator: Coordinator) -> None:
    c = coordinator
    c.create_run()
    alice, bob = c.register("alice"), c.register("bob")
    a = c.join(alice)
    left = c.client.post(f"/api/v1/sessions/{a['session_id']}/leave", headers=alice.headers).json()
    assert left == {"session_id": a["session_id"], "state": "left", "leases_returned": 1}
    assert c.join(bob)["lease"]["shard"] == a["lease"]["shard"]
    assert c.heartbeat(alice, a["session_id"]).json()["error"] == "session_ended"


def test_join_and_heartbeat_are_rate_limited_per_credential(tmp_path: Path) -> None:
    limits = LimitSettings(join_per_minute=1, heartbeat_per_minute=1, burst=2)
    for c in make_coordinator(tmp_path, limits=limits):
        c.create_run()
        alice, bob = c.register("alice"), c.register("bob")
        a = c.join(alice)
        c.join(alice, peer_public_key=c.new_key()[1])
        limited = c.client.post(
            "/api/v1/runs/shapes/join",
            json={"profile": PROFILE, "agent_version": "t", "peer_public_key": c.new_key()[1]},
            headers=alice.headers,
        )
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"] == "rate_limited"
        assert c.join(bob)["session_id"]  # other credentials are unaffected
        assert c.heartbeat(alice, a["session_id"]).status_code == 200
        assert c.heartbeat(alice, a["session_id"]).status_code == 200
        assert c.heartbeat(alice, a["session_id"]).status_code == 429


def test_live_feed_pushes_stats_and_leaderboard_changes(tmp_path: Path) -> None:
    from coordinator.settings import CoordinatorSettings  # noqa: F401 - settings via make_coordinator

    for c in make_coordinator(tmp_path, live_interval=0.2):
        c.create_run()
        alice = c.register("alice")
        a = c.join(alice)
        with c.client.websocket_connect("/api/v1/runs/shapes/live") as ws:
            snapshot = ws.receive_json()
            assert snapshot["type"] == "snapshot" and snapshot["run"]["name"] == "shapes"
            assert snapshot["run"]["stats"]["samples_per_second"] == 0
            c.heartbeat(alice, a["session_id"], samples_total=128, samples_per_second=64.0, loss=2.5)
            update = ws.receive_json()
            assert update["type"] == "update"
            assert update["run"]["stats"]["samples_per_second"] == 64.0
            assert update["leaderboard"][0]["volunteer"] == "alice" and update["leaderboard"][0]["online"]
            ws.send_text("ping")
            assert ws.receive_json()["type"] == "pong"
        with c.client.websocket_connect("/api/v1/runs/nope/live") as ws:
            assert ws.receive_json() == {
                "type": "error",
                "error": "run_not_found",
                "detail": "no run named 'nope'",
            }


def test_secrets_never_reach_the_logs(coordinator: Coordinator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    coordinator.create_run()
    alice = coordinator.register("alice")
    answer = coordinator.join(alice)
    coordinator.heartbeat(alice, answer["session_id"])
    coordinator.client.post(
        "/api/v1/runs", json={"name": "x", "task": "shapes-dalle"}, headers=bearer("org_guess")
    )
    logged = caplog.text
    for secret in (alice.credential, answer["peer_token"], coordinator.admin_token, "org_guess"):
        assert secret not in logged


def test_join_hands_out_only_live_swarm_addresses(coordinator: Coordinator) -> None:
    """A swarm address left behind by a stopped swarm peer must not send workers to a dead port."""
    from sqlalchemy import select

    from coordinator.models import Run
    from coordinator.store import Store

    coordinator.create_run()
    alice = coordinator.register("alice")
    store = Store(coordinator.settings.resolved_database_url)
    address = "/ip4/127.0.0.1/tcp/4242/p2p/QmSwarmPeer"

    def publish(age: float) -> None:
        with store.write() as db:
            run = db.scalars(select(Run).where(Run.name == "shapes")).one()
            run.swarm_maddrs, run.swarm_updated_at = [address], time.time() - age

    try:
        publish(age=5)
        assert coordinator.join(alice)["initial_peers"] == [address]
        assert coordinator.client.get("/api/v1/runs/shapes").json()["initial_peers"] == [address]
        publish(age=600)  # the peer stopped re-publishing ten minutes ago
        assert coordinator.join(alice)["initial_peers"] == []
        assert coordinator.client.get("/api/v1/runs/shapes").json()["initial_peers"] == []
    finally:
        store.close()

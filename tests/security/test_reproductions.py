"""The twelve defects of issue 10 ("Hostile volunteers"), each replayed as the attacker did it.

Every test here failed before its fix; they stay so that none comes back. The broader standing attack
suite is in the other modules of ``tests/security``.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from starlette.websockets import WebSocketDisconnect

from coordinator.api import create_app
from coordinator.models import PeerSession
from coordinator.settings import LimitSettings
from tests.conftest import (
    PROFILE,
    REPO,
    python_env,
    register_and_join,
    settings_for,
    start_serve,
    stop_serve,
)
from tests.coordinator.conftest import Clocked, make_clocked, swarm_sees

INT64_MAX = 9223372036854775807
HEARTBEAT_INTEGERS = (
    "samples_total",
    "bytes_sent",
    "bytes_received",
    "global_epoch",
    "averaging_rounds",
    "local_epoch",
)


@pytest.fixture
def c(tmp_path: Path) -> Any:
    yield from make_clocked(tmp_path)


# 1 ------------------------------------------------------------------------------------------------
def test_01_one_volunteer_cannot_break_the_run_statistics_for_everyone(c: Clocked, tmp_path: Path) -> None:
    c.create_run()
    alice, bob = c.register("alice"), c.register("bob")
    sessions = [c.join(alice)["session_id"], c.join(bob)["session_id"]]
    for volunteer, session_id in zip((alice, bob), sessions, strict=True):
        answer = c.heartbeat(volunteer, session_id, samples_total=INT64_MAX)
        assert answer.status_code == 422 and "samples_total" in answer.json()["fields"]
    # Counters a hostile peer stored before the fix (the database of the report): still no 500.
    resources = c.client.app.state.resources  # type: ignore[attr-defined]
    with resources.store.write() as db:
        db.execute(update(PeerSession).values(samples_total=INT64_MAX))
    for path in ("/api/v1/runs", "/api/v1/runs/shapes", "/api/v1/runs/shapes/leaderboard"):
        assert c.client.get(path).status_code == 200, path
    with c.client.websocket_connect("/api/v1/runs/shapes/live") as ws:
        assert ws.receive_json()["type"] == "snapshot"
    # ... after a restart too, and an agent can still read the run and join it
    with TestClient(create_app(c.settings)) as restarted:
        assert restarted.get("/api/v1/runs/shapes").status_code == 200
        _, _, joined = register_and_join(restarted, "carol", tmp_path / "carol.rsa")
        assert joined.status_code == 200, joined.text


# 2 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limits", [LimitSettings(lease_per_minute=1e6, burst=1000)])
def test_02_a_self_reported_benchmark_neither_credits_shards_nor_ends_the_run(
    tmp_path: Path, limits: LimitSettings
) -> None:
    # the lease rate limit is lifted here to show that the credit rules hold on their own
    c = next(make_clocked(tmp_path, limits=limits))
    c.create_run(task_config={"preset": "tiny", "num_shards": 32, "samples_per_shard": 256})
    mallory = c.register("mallory")
    boasting = {**PROFILE, "benchmark": {"task": "shapes-dalle", "threads": 1, "micro_batch_size": 16,
                                          "samples_per_second": 1e7}}  # fmt: skip
    m = c.join(mallory, profile=boasting)
    sid, lease = m["session_id"], m["lease"]
    # take and complete in a loop, as fast as the server answers: every completion is too early
    for _ in range(32):
        done = c.complete(mallory, sid, lease["lease_id"], 256)
        assert done.status_code == 409 and done.json()["error"] == "lease_too_early"
        assert int(done.headers["Retry-After"]) >= 1
    # waiting out each lease's minimum duration (2 threads x 1,000 samples/s: 0.128 s) buys unverified
    # credit only: no shard is done, the run goes on, honest volunteers join and outrank the attacker
    for _ in range(32):
        c.clock.advance(0.2)
        answer = c.complete(mallory, sid, lease["lease_id"], 256).json()
        assert answer["credited_samples"] == 256 and not answer["verified"]
        nxt = c.take(mallory, sid).json()
        if nxt["lease"] is None:
            break
        lease = nxt["lease"]
    run = c.client.get("/api/v1/runs/shapes").json()
    assert run["state"] == "active" and run["stats"]["shards_done"] == 0
    assert run["stats"]["samples_verified"] == 0 and run["stats"]["samples_credited"] > 0
    alice = c.register("alice")
    a = c.join(alice)
    assert a["session_id"]
    swarm_sees(c, a["session_id"])
    c.clock.advance(1.0)
    if a["lease"] is None:  # every shard is held by mallory's claims: they go back once unverified too long
        c.clock.advance(c.settings.credit.progress_record_window + 1)
        assert c.sweep().requeued > 0
        assert c.heartbeat(alice, a["session_id"]).status_code == 200
        a["lease"] = c.take(alice, a["session_id"]).json()["lease"]
        c.clock.advance(1.0)
    swarm_sees(c, a["session_id"])
    assert c.complete(alice, a["session_id"], a["lease"]["lease_id"], 256).json()["verified"]
    board = c.board()
    assert [e["volunteer"] for e in board] == ["alice", "mallory"]
    assert board[1]["verified_samples"] == 0 and board[1]["unverified_samples"] > 0
    kinds = {f["kind"] for f in c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()}
    assert "lease_too_early" in kinds


def test_02_lease_take_and_complete_are_rate_limited(tmp_path: Path) -> None:
    for c in make_clocked(tmp_path, limits=LimitSettings(lease_per_minute=60, burst=5)):
        c.create_run()
        mallory = c.register("mallory")
        sid = c.join(mallory)["session_id"]
        codes = [c.take(mallory, sid).status_code for _ in range(8)]
        assert codes[-1] == 429 and 200 not in codes[5:]


# 3 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", HEARTBEAT_INTEGERS)
@pytest.mark.parametrize("value", [INT64_MAX, INT64_MAX + 1, 2**64, 10**30])
def test_03_huge_integers_in_heartbeat_fields_are_refused_cleanly(
    c: Clocked, caplog: pytest.LogCaptureFixture, field: str, value: int
) -> None:
    caplog.set_level(logging.INFO)
    c.create_run()
    alice = c.register("alice")
    sid = c.join(alice)["session_id"]
    answer = c.heartbeat(alice, sid, **{field: value})
    assert answer.status_code == 422 and field in answer.json()["fields"], answer.text
    assert "Traceback" not in caplog.text and "unhandled error" not in caplog.text
    assert c.heartbeat(alice, sid).status_code == 200


# 4 ------------------------------------------------------------------------------------------------
def test_04_a_volunteer_cannot_take_another_volunteers_peer_key(c: Clocked) -> None:
    c.create_run()
    c.create_run("other")
    alice, mallory = c.register("alice"), c.register("mallory")
    a = c.join(alice)
    c.client.post(f"/api/v1/sessions/{a['session_id']}/leave", headers=alice.headers)
    # alice has no active session: before the fix, this join succeeded and took her key
    stolen = c.join(mallory, peer_public_key=alice.public_key, expect=409)
    assert stolen["error"] == "peer_key_in_use"
    assert (
        c.join(mallory, "other", peer_public_key=alice.public_key, expect=409)["error"] == "peer_key_in_use"
    )
    assert c.join(alice)["session_id"]  # alice keeps her key
    flags = c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()
    assert [(f["volunteer"], f["kind"]) for f in flags] == [("mallory", "peer_key_refused")]


# 5 ------------------------------------------------------------------------------------------------
def test_05_a_ban_is_not_evaded_with_a_new_name_and_the_same_peer_key(c: Clocked) -> None:
    c.create_run()
    mallory = c.register("mallory")
    c.join(mallory)
    c.client.post("/api/v1/volunteers/mallory/ban", json={"reason": "cheating"}, headers=c.admin)
    again = c.register("mallory2")
    refused = c.join(again, peer_public_key=mallory.public_key, expect=403)
    assert refused["error"] == "peer_key_banned"
    assert c.join(again)["session_id"]  # a new key is a new machine: that much a ban cannot know


# 6 ------------------------------------------------------------------------------------------------
def test_06_a_token_refresh_retires_the_token_it_replaced(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    a = c.join(alice)
    url = f"/api/v1/sessions/{a['session_id']}/token"

    def refresh(token: str) -> Any:
        return c.client.post(url, json={"peer_token": token}, headers=alice.headers)

    first = refresh(a["peer_token"])
    assert first.status_code == 200
    replay = refresh(a["peer_token"])
    assert replay.status_code == 403 and replay.json()["error"] == "token_superseded"
    second = refresh(first.json()["peer_token"])
    assert second.status_code == 200
    assert refresh(first.json()["peer_token"]).json()["error"] == "token_superseded"


# 7 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "task", ["this:TASK", "this", ":", "..x:TASK", "os.path:sep", "workers.tasks.shapes_dalle:TASK", " "]
)
def test_07_over_http_only_installed_tasks_can_be_named(c: Clocked, task: str) -> None:
    before = set(sys.modules)
    answer = c.client.post("/api/v1/runs", json={"name": "x", "task": task}, headers=c.admin)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] in ("unknown_task", "invalid_request")
    assert "this" not in set(sys.modules) - before  # nothing was imported


def test_07_the_cli_refuses_unimportable_task_names_in_one_line(tmp_path: Path) -> None:
    for task in (":", "..x:TASK"):
        result = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(tmp_path / "d"),
             "--name", "x", "--task", task],
            capture_output=True, text=True, env=python_env(), timeout=120,
        )  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


# 8 ------------------------------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_08_the_store_and_its_companions_are_private_and_an_old_data_dir_is_tightened(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    with TestClient(create_app(settings)) as client:
        client.post("/api/v1/volunteers", json={"name": "alice"})
        db = settings.data_dir / "coordinator.db"
        for path in (db, db.with_name("coordinator.db-wal"), db.with_name("coordinator.db-shm")):
            assert path.exists() and _mode(path) == 0o600, path
    assert _mode(settings.data_dir) == 0o700
    # an existing data dir from an older version, readable by everyone
    os.chmod(settings.data_dir, 0o755)
    for path in settings.data_dir.glob("coordinator.db*"):
        os.chmod(path, 0o644)
    with TestClient(create_app(settings)):
        pass
    assert _mode(settings.data_dir) == 0o700
    assert all(_mode(p) == 0o600 for p in settings.data_dir.glob("coordinator.db*"))


# 9 ------------------------------------------------------------------------------------------------
def test_09_a_binary_websocket_frame_gets_a_close_code_not_a_traceback(
    c: Clocked, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c.create_run()
    with c.client.websocket_connect("/api/v1/runs/shapes/live") as ws:
        assert ws.receive_json()["type"] == "snapshot"
        ws.send_bytes(b"\x00\x01binary")
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1003
    assert "KeyError" not in caplog.text and "Traceback" not in caplog.text


# 10 -----------------------------------------------------------------------------------------------
def test_10_the_organizer_token_never_reaches_the_output_of_init_or_serve(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    data = tmp_path / "data"
    process = subprocess.Popen(  # the first serve creates the token
        [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(data), "--port", "0", "--no-swarm"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(), start_new_session=True,
    )  # fmt: skip
    kill_leftovers.append(process)
    assert process.stdout is not None
    output = []
    for line in process.stdout:
        output.append(line)
        if "serving at" in line:
            break
    url = output[-1].split("serving at ", 1)[1].split()[0]
    assert httpx.get(f"{url}/api/v1/health", timeout=30).status_code == 200
    assert stop_serve(process) == 0
    output.append(process.stdout.read())
    token = (data / "admin-token").read_text().strip()
    assert token not in "".join(output) and str((data / "admin-token").resolve()) in "".join(output)
    fresh = tmp_path / "fresh"
    init = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "init", "--data-dir", str(fresh)],
        capture_output=True, text=True, env=python_env(), timeout=120, check=True,
    )  # fmt: skip
    token = (fresh / "admin-token").read_text().strip()
    assert token not in init.stdout + init.stderr and "admin-token" in init.stdout
    # what the shipped unit and image run leaves the token out of journald and container logs too
    unit = (REPO / "packaging" / "systemd" / "volunteer-coordinator.service").read_text()
    assert "UMask=0077" in unit


# 11 -----------------------------------------------------------------------------------------------
def test_11_x_forwarded_for_from_loopback_does_not_dodge_per_address_limits(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    process, url = start_serve(tmp_path / "data", kill_leftovers, "--no-swarm")
    with httpx.Client(base_url=url, timeout=10) as http:
        codes = [
            http.post(
                "/api/v1/volunteers", json={"name": f"sybil{i}"}, headers={"X-Forwarded-For": f"10.0.0.{i}"}
            ).status_code
            for i in range(16)
        ]
        assert codes.count(201) == LimitSettings().burst and codes[-1] == 429
        reads = [http.get("/api/v1/runs/x/leaderboard").status_code for _ in range(80)]
        assert 429 in reads  # leaderboard reads are limited per address too
    assert stop_serve(process) == 0


def test_11_a_named_proxy_is_trusted_for_the_client_address(
    tmp_path: Path, kill_leftovers: list[Any]
) -> None:
    process, url = start_serve(
        tmp_path / "data", kill_leftovers, "--no-swarm", "--trusted-proxy", "127.0.0.1"
    )
    with httpx.Client(base_url=url, timeout=10) as http:
        codes = [
            http.post(
                "/api/v1/volunteers",
                json={"name": f"user{i}"},
                headers={"X-Forwarded-For": f"198.51.100.{i}"},
            ).status_code
            for i in range(16)
        ]
        assert codes == [201] * 16  # each real client behind the proxy has its own limit
    assert stop_serve(process) == 0


# 12 -----------------------------------------------------------------------------------------------
def test_12_names_differing_only_in_case_or_a_trailing_dot_are_one_name(c: Clocked) -> None:
    c.register("alice")
    for name in ("Alice", "ALICE", "alice.", "alice-", "alice_"):
        answer = c.client.post("/api/v1/volunteers", json={"name": name})
        assert answer.status_code in (409, 422), name
        assert answer.json()["error"] in ("name_taken", "invalid_request")
    assert c.client.post("/api/v1/volunteers", json={"name": "al.ice"}).status_code == 201


def test_12_the_openapi_document_declares_security_and_every_error_answer(c: Clocked) -> None:
    spec = c.client.get("/api/v1/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert {s["scheme"] for s in schemes.values()} == {"bearer"} and len(schemes) == 2
    join = spec["paths"]["/api/v1/runs/{name}/join"]["post"]
    assert join["security"] == [{"volunteer_credential": []}]
    assert {"401", "403", "409", "413", "422", "429"} <= set(join["responses"])
    create = spec["paths"]["/api/v1/runs"]["post"]
    assert create["security"] == [{"organizer_token": []}]
    assert {"401", "403", "413", "422", "429"} <= set(create["responses"])
    error_ref = join["responses"]["422"]["content"]["application/json"]["schema"]["$ref"]
    assert error_ref.endswith("/ErrorBody")
    # the 422 body is what the schema says
    invalid = c.client.post("/api/v1/volunteers", json={"name": ""}).json()
    assert set(invalid) == {"error", "detail", "fields"} and isinstance(invalid["fields"], dict)


def test_12_the_dashboard_sends_a_content_security_policy_that_forbids_framing(c: Clocked) -> None:
    for path in ("/dashboard/", "/dashboard/static/app.js", "/api/v1/runs", "/api/v1/docs"):
        headers = c.client.get(path).headers
        policy = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy, path
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    policy = c.client.get("/dashboard/").headers["content-security-policy"]
    assert "script-src 'self';" in policy and "unsafe-inline" not in policy


# found by the fuzzer (tests/security/test_fuzz.py) ------------------------------------------------
@pytest.mark.parametrize(
    "key", ["\u0088\U000b5f6f key", "ssh-dss AAAAB3NzaC1kc3M=", "ecdsa-sha2-nistp999 AAAA"]
)
def test_a_peer_key_of_an_unknown_type_is_a_422_not_a_500(c: Clocked, key: str) -> None:
    c.create_run()
    alice = c.register("alice")
    refused = c.join(alice, peer_public_key=key + " " + "A" * 120, expect=422)
    assert "peer_public_key" in refused["fields"]

"""Credit and trust (docs/credit-and-trust.md): caps from what the coordinator can check, verified-only ranking and data
epochs, organizer-visible flags, and the coordinator's side of proof-of-training spot checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.credit import spotchecks
from coordinator.errors import Conflict
from coordinator.models import Shard, SpotCheck
from coordinator.settings import CreditSettings, LimitSettings
from tests.conftest import PROFILE
from tests.coordinator.conftest import Clocked, make_clocked, swarm_sees

GPU_PROFILE = {
    **PROFILE,
    "benchmark": None,
    "gpus": [{"name": "RTX 4090", "memory_bytes": 24 * 1024**3}] * 64,
}


def _flags(c: Clocked) -> list[tuple[str, str]]:
    return [
        (f["volunteer"], f["kind"]) for f in c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()
    ]


def test_a_lease_has_a_minimum_duration_from_the_device_class_not_the_benchmark(clocked: Clocked) -> None:
    c = clocked
    c.create_run(task_config={"preset": "tiny", "num_shards": 4, "samples_per_shard": 4096})
    alice, bob = c.register("alice"), c.register("bob")
    boasting = {**PROFILE, "benchmark": {**PROFILE["benchmark"], "samples_per_second": 1e7}}
    a = c.join(alice, profile=boasting)
    lease = a["lease"]
    # 2 CPU threads x 1,000 samples/s: 4,096 samples take 2.048 s, whatever the benchmark says
    assert lease["not_before"] - lease["issued_at"] == pytest.approx(2.048, abs=1e-6)
    c.clock.advance(2.0)
    early = c.complete(alice, a["session_id"], lease["lease_id"], 4096)
    assert early.status_code == 409 and early.json()["error"] == "lease_too_early"
    assert early.headers["Retry-After"] == "1"
    # a smaller claim has a shorter minimum
    assert c.complete(alice, a["session_id"], lease["lease_id"], 2048).status_code == 200
    # 64 GPUs in a profile count as 8 (max_credited_gpus) x 50,000 samples/s
    b = c.join(bob, profile=GPU_PROFILE)
    assert b["lease"]["not_before"] - b["lease"]["issued_at"] == pytest.approx(4096 / 400_000, abs=1e-6)
    assert ("alice", "lease_too_early") in _flags(c)


def test_partial_and_unverified_claims_do_not_finish_shards(clocked: Clocked) -> None:
    c = clocked
    c.create_run(task_config={"preset": "tiny", "num_shards": 2, "samples_per_shard": 64})
    alice = c.register("alice")
    a = c.join(alice)
    sid = a["session_id"]
    c.clock.advance(1.0)
    partial = c.complete(alice, sid, a["lease"]["lease_id"], 32).json()
    assert partial["credited_samples"] == 32
    # half a shard: the shard is leased again, first in line
    again = c.take(alice, sid).json()["lease"]
    assert again["shard"] == a["lease"]["shard"]
    c.clock.advance(1.0)
    unverified = c.complete(alice, sid, again["lease_id"], 64).json()
    assert unverified["credited_samples"] == 64 and not unverified["verified"]
    assert "unverified: the swarm saw no signed progress records" in unverified["reason"]
    run = c.client.get("/api/v1/runs/shapes").json()["stats"]
    assert run["shards_done"] == 0 and run["samples_credited"] == 96 and run["samples_verified"] == 0
    # the swarm sees the peer a moment later: the sweeper verifies the claim and the shard is done
    swarm_sees(c, sid)
    swept = c.sweep()
    assert swept.verified == 1 and swept.requeued == 0
    run = c.client.get("/api/v1/runs/shapes").json()["stats"]
    assert run["shards_done"] == 1 and run["samples_verified"] == 64
    entry = c.board()[0]
    assert (entry["samples"], entry["verified_samples"], entry["unverified_samples"]) == (96, 64, 32)


def test_claims_the_swarm_never_confirms_go_back_to_the_queue_and_never_rank(clocked: Clocked) -> None:
    c = clocked
    c.create_run(task_config={"preset": "tiny", "num_shards": 1, "samples_per_shard": 64})
    mallory, alice = c.register("mallory"), c.register("alice")
    m = c.join(mallory)
    c.clock.advance(1.0)
    c.heartbeat(mallory, m["session_id"], samples_per_second=100.0)
    assert not c.complete(mallory, m["session_id"], m["lease"]["lease_id"], 64).json()["verified"]
    a = c.join(alice)
    assert a["lease"] is None  # the only shard waits for mallory's claim to be confirmed
    taken = c.take(alice, a["session_id"]).json()
    assert taken["lease"] is None and 5 <= taken["retry_after"] <= 30 and taken["run_state"] == "active"
    assert taken["waiting_for"] == "shards", "the agent tells its volunteer why no work comes"
    c.clock.advance(c.settings.credit.progress_record_window + 1)
    c.heartbeat(alice, a["session_id"])
    assert c.sweep().requeued == 1
    lease = c.take(alice, a["session_id"]).json()["lease"]
    assert lease["shard"] == 0
    swarm_sees(c, a["session_id"])
    c.clock.advance(1.0)
    assert c.complete(alice, a["session_id"], lease["lease_id"], 64).json()["verified"]
    assert c.take(alice, a["session_id"]).json()["run_state"] == "finished"  # ended on verified work
    board = c.board()
    # mallory has credit (shown apart), but alice ranks first although mallory is faster and was first
    assert [(e["volunteer"], e["verified_samples"], e["unverified_samples"]) for e in board] == [
        ("alice", 64, 0),
        ("mallory", 0, 64),
    ]
    assert ("mallory", "claim_unverified") in _flags(c)


def test_a_peer_lagging_behind_the_swarms_epoch_is_not_verified(clocked: Clocked) -> None:
    c = clocked
    c.create_run()
    alice, bob, carol = c.register("alice"), c.register("bob"), c.register("carol")
    sessions = {v.name: (v, c.join(v)) for v in (alice, bob, carol)}
    swarm_sees(c, sessions["alice"][1]["session_id"], epoch=10)
    swarm_sees(c, sessions["bob"][1]["session_id"], epoch=11)
    swarm_sees(c, sessions["carol"][1]["session_id"], epoch=3)  # never averages with the others
    c.clock.advance(1.0)
    results = {
        name: c.complete(volunteer, answer["session_id"], answer["lease"]["lease_id"], 64).json()
        for name, (volunteer, answer) in sessions.items()
    }
    assert results["alice"]["verified"] and results["bob"]["verified"]
    assert not results["carol"]["verified"]
    assert "took no part in the swarm's averaging rounds" in results["carol"]["reason"]


def test_a_peer_that_averaged_with_nobody_while_the_swarm_moved_on_is_flagged_and_not_verified(
    clocked: Clocked,
) -> None:
    """Two volunteers behind NAT as clients train side by side and average with nobody (tests/net shows it):
    their progress records keep up with the swarm's epoch, but their work never reaches the shared model."""
    c = clocked
    c.create_run()
    carol = c.register("carol")
    carol_session = c.join(carol)["session_id"]
    swarm_sees(c, carol_session, epoch=1)
    alice, bob = c.register("alice"), c.register("bob")
    sessions = {v.name: (v, c.join(v)) for v in (alice, bob)}  # both join at the swarm's epoch 1
    lag = c.settings.credit.isolation_epochs
    for name, rounds in (("alice", 3), ("bob", 0)):
        volunteer, answer = sessions[name]
        beat = c.heartbeat(
            volunteer, answer["session_id"], averaging_rounds=rounds, swarm_size=3, global_epoch=1 + lag
        )
        assert beat.status_code == 200
    for sid in (carol_session, *(answer["session_id"] for _, answer in sessions.values())):
        swarm_sees(c, sid, epoch=1 + lag)
    c.clock.advance(1.0)
    results = {
        name: c.complete(volunteer, answer["session_id"], answer["lease"]["lease_id"], 64).json()
        for name, (volunteer, answer) in sessions.items()
    }
    assert results["alice"]["verified"], results["alice"]
    assert not results["bob"]["verified"]
    assert "averaged with nobody" in results["bob"]["reason"] and "shared model" in results["bob"]["reason"]
    table = {
        p["volunteer"]: p["flags"] for p in c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()
    }
    assert "isolated" in table["bob"] and "isolated" not in table["alice"], table
    # a peer alone in its swarm has nobody to average with: that is not being cut off
    dave = c.register("dave")
    solo = c.join(dave)
    c.heartbeat(dave, solo["session_id"], averaging_rounds=0, swarm_size=1)
    table = {
        p["volunteer"]: p["flags"] for p in c.client.get("/api/v1/runs/shapes/peers", headers=c.admin).json()
    }
    assert "isolated" not in table["dave"]


def test_one_volunteer_cannot_move_the_swarms_epoch(clocked: Clocked) -> None:
    c = clocked
    c.create_run()
    alice, bob, mallory = c.register("alice"), c.register("bob"), c.register("mallory")
    a, b = c.join(alice), c.join(bob)
    m = c.join(mallory)
    swarm_sees(c, a["session_id"], epoch=5)
    swarm_sees(c, b["session_id"], epoch=5)
    swarm_sees(c, m["session_id"], epoch=2**31 - 1)  # a forged record from a far future
    c.clock.advance(1.0)
    assert c.complete(alice, a["session_id"], a["lease"]["lease_id"], 64).json()["verified"]
    # and a heartbeat cannot claim epochs or rounds the swarm did not see
    beat = c.heartbeat(bob, b["session_id"], global_epoch=10**6, averaging_rounds=10**6, samples_total=10**9)
    assert beat.status_code == 200
    stats = c.client.get("/api/v1/runs/shapes").json()["stats"]
    assert stats["global_epoch"] <= 5 + c.settings.credit.epoch_lag_tolerance + 1
    assert stats["samples_total"] < 10_000
    assert ("bob", "heartbeat_capped") in _flags(c)


def test_heartbeat_flags_merge_into_one_row_a_minute(clocked: Clocked) -> None:
    c = clocked
    c.create_run()
    mallory = c.register("mallory")
    sid = c.join(mallory)["session_id"]
    for _ in range(8):
        assert c.heartbeat(mallory, sid, samples_per_second=1e6).status_code == 200
    flags = c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()
    assert len(flags) == 1 and flags[0]["count"] == 8 and "samples/s above" in flags[0]["detail"]
    c.clock.advance(61.0)
    c.heartbeat(mallory, sid, samples_per_second=1e6)
    assert len(c.client.get("/api/v1/runs/shapes/flags", headers=c.admin).json()) == 2
    assert c.client.get("/api/v1/runs/shapes/flags").status_code == 401
    only = c.client.get("/api/v1/runs/shapes/flags?volunteer=MALLORY", headers=c.admin).json()
    assert len(only) == 2


def test_too_many_sessions_per_volunteer_are_refused(clocked: Clocked) -> None:
    c = clocked
    c.create_run()
    mallory = c.register("mallory")
    for _ in range(c.settings.work.max_sessions_per_volunteer):
        c.join(mallory, peer_public_key=c.new_key()[1])
    refused = c.join(mallory, peer_public_key=c.new_key()[1], expect=409)
    assert refused["error"] == "too_many_sessions"


# ------------------------------------------------------------------------------------------ spot checks
def _store(c: Clocked):  # type: ignore[no-untyped-def]
    return c.client.app.state.resources.store  # type: ignore[attr-defined]


def _verified_lease(c: Clocked, name: str, loss: float | None = 2.5) -> tuple[dict, dict]:  # type: ignore[type-arg]
    volunteer = c.register(name)
    answer = c.join(volunteer)
    swarm_sees(c, answer["session_id"])
    c.clock.advance(1.0)
    done = c.complete(volunteer, answer["session_id"], answer["lease"]["lease_id"], 64, loss=loss).json()
    return answer, done


def test_sampled_leases_wait_for_a_spot_check_and_a_failure_removes_the_credit(tmp_path: Path) -> None:
    for c in make_clocked(tmp_path, spot_check_fraction=1.0):
        c.create_run()
        answer, done = _verified_lease(c, "mallory", loss=0.01)
        assert done["verified"] and done["pending_check"] and done["credited_samples"] == 64
        entry = c.board()[0]
        assert (entry["samples"], entry["verified_samples"], entry["pending_samples"]) == (64, 64, 64)
        # the run's swarm peer (phase 2) fetches the check, recomputes, and records its verdict
        with _store(c).write() as db:
            (check,) = spotchecks.claim_pending(db, run_id=_run_id(c), now=c.clock(), settings=c.settings)
        assert (check.shard, check.samples, check.reported_loss) == (answer["lease"]["shard"], 64, 0.01)
        assert check.seed == answer["lease"]["seed"] and check.micro_batch_size == 16
        assert check.peer_public_key.startswith("ssh-rsa ")
        with _store(c).write() as db:  # claimed checks are not handed out twice
            assert spotchecks.claim_pending(db, run_id=_run_id(c), now=c.clock(), settings=c.settings) == []
        passed, detail = spotchecks.judge_loss(check.reported_loss, 2.4)
        assert not passed and "outside the tolerance" in detail
        with _store(c).write() as db:
            spotchecks.record_verdict(db, check_id=check.check_id, passed=False, detail=detail, now=c.clock(),
                                      recomputed_loss=2.4)  # fmt: skip
        with _store(c).write() as db, pytest.raises(Conflict):
            spotchecks.record_verdict(db, check_id=check.check_id, passed=True, detail="again", now=c.clock())
        entry = c.board()[0]
        assert (entry["samples"], entry["verified_samples"], entry["pending_samples"]) == (0, 0, 0)
        assert entry["flagged"] == 1
        assert ("mallory", "spot_check_failed") in _flags(c)
        with _store(c).read() as db:  # the shard is trained again by someone else
            assert db.get(Shard, (_run_id(c), 0, answer["lease"]["shard"])).state == "pending"


def test_a_passed_check_settles_the_credit_and_ranks_it(tmp_path: Path) -> None:
    for c in make_clocked(tmp_path, spot_check_fraction=1.0):
        c.create_run()
        _verified_lease(c, "alice", loss=2.5)
        assert c.board()[0]["pending_samples"] == 64
        with _store(c).write() as db:
            (check,) = spotchecks.claim_pending(db, run_id=_run_id(c), now=c.clock(), settings=c.settings)
        passed, detail = spotchecks.judge_loss(check.reported_loss, 2.45)
        assert passed
        with _store(c).write() as db:
            spotchecks.record_verdict(db, check_id=check.check_id, passed=True, detail=detail, now=c.clock())
        entry = c.board()[0]
        assert (entry["samples"], entry["verified_samples"], entry["pending_samples"]) == (64, 64, 0)


def test_checks_nobody_decides_expire_and_stale_claims_are_offered_again(tmp_path: Path) -> None:
    credit = CreditSettings(spot_check_fraction=1.0, spot_check_timeout=100.0)
    for c in make_clocked(tmp_path, credit=credit):
        c.create_run()
        _verified_lease(c, "alice")
        with _store(c).write() as db:
            first = spotchecks.claim_pending(db, run_id=_run_id(c), now=c.clock(), settings=c.settings)
        c.clock.advance(11.0)  # the checker died: after a tenth of the timeout the check is offered again
        with _store(c).write() as db:
            second = spotchecks.claim_pending(db, run_id=_run_id(c), now=c.clock(), settings=c.settings)
        assert [x.check_id for x in first] == [x.check_id for x in second]
        c.clock.advance(100.0)
        assert c.sweep().checks_expired == 1
        assert c.board()[0]["pending_samples"] == 0 and c.board()[0]["verified_samples"] == 64


def test_spot_checks_are_drawn_at_the_configured_rate_and_more_often_after_a_failure(tmp_path: Path) -> None:
    credit = CreditSettings(spot_check_fraction=0.25, flagged_spot_check_fraction=1.0)
    limits = LimitSettings(lease_per_minute=1e6, burst=1000)
    for c in make_clocked(tmp_path, credit=credit, seed=7, limits=limits):
        c.create_run(task_config={"preset": "tiny", "num_shards": 400, "samples_per_shard": 8})
        alice = c.register("alice")
        a = c.join(alice, max_threads=1)
        sid, lease = a["session_id"], a["lease"]
        picked = 0
        for _ in range(200):
            swarm_sees(c, sid)
            c.clock.advance(0.1)
            picked += c.complete(alice, sid, lease["lease_id"], 8).json()["pending_check"]
            lease = c.take(alice, sid).json()["lease"]
        assert 25 <= picked <= 75  # 0.25 of 200, loosely
        with _store(c).write() as db:
            check = db.query(SpotCheck).first()
            assert check is not None
            spotchecks.record_verdict(db, check_id=check.id, passed=False, detail="made up", now=c.clock())
        for _ in range(5):  # after a failed check, every lease of this volunteer is checked
            swarm_sees(c, sid)
            c.clock.advance(0.1)
            assert c.complete(alice, sid, lease["lease_id"], 8).json()["pending_check"]
            lease = c.take(alice, sid).json()["lease"]


def test_judge_loss_is_loose_about_drift_and_strict_about_nonsense() -> None:
    assert spotchecks.judge_loss(2.0, 2.3)[0]  # the model moved on a little
    assert not spotchecks.judge_loss(0.001, 2.3)[0]  # a made-up loss
    assert not spotchecks.judge_loss(None, 2.3)[0]
    assert not spotchecks.judge_loss(float("nan"), 2.3)[0]
    assert not spotchecks.judge_loss(2.0, float("inf"))[0]


def _run_id(c: Clocked) -> str:
    from coordinator.models import Run

    with _store(c).read() as db:
        return db.query(Run).filter(Run.name == "shapes").one().id


def test_a_peer_the_swarm_never_sees_cannot_sit_on_the_queue(clocked: Clocked) -> None:
    c = clocked
    c.create_run(task_config={"preset": "tiny", "num_shards": 16, "samples_per_shard": 64})
    mallory, alice = c.register("mallory"), c.register("alice")
    m = c.join(mallory)
    sid, lease = m["session_id"], m["lease"]
    taken = {"lease": lease}
    for _ in range(c.settings.work.max_unverified_claims):
        c.clock.advance(1.0)
        assert not c.complete(mallory, sid, taken["lease"]["lease_id"], 64).json()["verified"]
        taken = c.take(mallory, sid).json()
    # two claims the swarm has not confirmed: no more work for this session
    assert taken["lease"] is None and 5 <= taken["retry_after"] <= 30 and taken["run_state"] == "active"
    assert taken["waiting_for"] == "confirmation"
    a = c.join(alice)
    assert a["lease"] is not None  # the rest of the queue is there for everyone else
    # once the swarm confirms mallory's claims, mallory gets work again
    swarm_sees(c, sid)
    assert c.sweep().verified == 2
    assert c.take(mallory, sid).json()["lease"] is not None

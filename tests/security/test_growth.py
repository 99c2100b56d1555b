"""Security issue, defect 8: one address, every rate limit honoured, grew the store without bound.

The attacker registered credentials from one address and re-joined with maximal profiles (64 GPUs with
200-character names, 26 KB each): every join kept a new session row with the whole profile, and nothing
ever deleted one. These tests replay it against a real app on a real SQLite file, with the clock moved
instead of waited for, and check that the store stays bounded while honest volunteers keep their credit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from coordinator.models import Lease, LedgerEntry, PeerSession, Volunteer
from coordinator.retention import STORED_PROFILE_MAX_BYTES, stored_profile
from coordinator.settings import LimitSettings, WorkSettings
from tests.conftest import PROFILE
from tests.conftest import Volunteer as Peer
from tests.coordinator.conftest import CLIENT_HEADER, Clocked, make_clocked, swarm_sees
from volunteer_app.protocol import HardwareProfile

DAY = 24 * 3600.0

MAXIMAL_PROFILE: dict[str, Any] = {
    **PROFILE,
    "cpu_model": "C" * 200,
    "os": "O" * 200,
    "python": "P" * 40,
    "torch": "T" * 40,
    "gpus": [
        {
            "name": f"{i:02d}" + "G" * 198,
            "memory_bytes": 80 * 1024**3,
            "driver": "D" * 100,
            "cuda_capability": "9" * 20,
        }
        for i in range(64)
    ],
    "benchmark": {**PROFILE["benchmark"], "task": "k" * 200, "preset": "p" * 40},
}
"""The attacker's profile: every list and text at its schema's limit (26 KB of JSON)."""

ESCAPED_PROFILE: dict[str, Any] = {
    **MAXIMAL_PROFILE,
    "gpus": [{**gpu, "name": "é" * 200} for gpu in MAXIMAL_PROFILE["gpus"]],
}
"""Non-ASCII names: 2 bytes each on the wire, 6 once JSON-escaped in the store."""

LIFTED = {"register_per_minute": 1e6, "join_per_minute": 1e6, "heartbeat_per_minute": 1e6, "burst": 100_000}
"""The per-minute rates run on the real monotonic clock; lifted here, so that what is measured is what the
day-long quotas and the store allow (the attacker honoured the per-minute rates anyway)."""


@pytest.fixture
def c(tmp_path: Path) -> Iterator[Clocked]:
    yield from make_clocked(tmp_path, addresses=True, limits=LimitSettings(**LIFTED))


def _from(address: str) -> dict[str, str]:
    return {CLIENT_HEADER: address}


def _register(c: Clocked, name: str, address: str) -> Any:
    return c.client.post("/api/v1/volunteers", json={"name": name}, headers=_from(address))


def _store_figures(c: Clocked) -> dict[str, int]:
    """Rows, stored profile bytes and the bytes of the SQLite file in use (pages not on the free list)."""
    resources = c.client.app.state.resources  # type: ignore[attr-defined]
    with resources.store.read() as db:
        profiles = [
            len(text_) for text_ in db.scalars(text("SELECT CAST(profile AS TEXT) FROM peer_sessions"))
        ]
        page_size = db.execute(text("PRAGMA page_size")).scalar_one()
        pages = db.execute(text("PRAGMA page_count")).scalar_one()
        free = db.execute(text("PRAGMA freelist_count")).scalar_one()
        return {
            "sessions": db.scalar(select(func.count()).select_from(PeerSession)) or 0,
            "leases": db.scalar(select(func.count()).select_from(Lease)) or 0,
            "volunteers": db.scalar(select(func.count()).select_from(Volunteer)) or 0,
            "ledger": db.scalar(select(func.count()).select_from(LedgerEntry)) or 0,
            "profile_bytes": sum(profiles),
            "largest_profile": max(profiles, default=0),
            "used_bytes": (pages - free) * page_size,
        }


def _metric(c: Clocked, name: str, run: str = "shapes") -> float:
    for line in c.client.get("/metrics").text.splitlines():
        if line.startswith(f'volunteer_coordinator_{name}{{run="{run}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name} for run {run}")


@pytest.mark.parametrize("char", ["G", "é", "\U0001f600", "\x00", '"'])
def test_a_stored_profile_is_small_whatever_text_the_peer_sends(char: str) -> None:
    """JSON escapes non-ASCII and control characters (up to 12 bytes each): the bound is on stored bytes."""
    gpu = {"name": char * 200, "memory_bytes": 2**53 - 1, "driver": char * 100, "cuda_capability": char * 20}
    profile = HardwareProfile.model_validate(
        {
            **MAXIMAL_PROFILE,
            "cpu_model": char * 200,
            "os": char * 200,
            "python": char * 40,
            "torch": char * 40,
            "gpus": [gpu] * 64,
            "benchmark": {**MAXIMAL_PROFILE["benchmark"], "task": char * 200, "preset": char * 40},
        }
    )
    stored = stored_profile(profile)
    assert (
        len(json.dumps(stored)) <= STORED_PROFILE_MAX_BYTES < len(json.dumps(profile.model_dump(mode="json")))
    )
    assert stored["gpu_count"] == 64 and stored["cpu_cores"] == PROFILE["cpu_cores"]
    assert stored["benchmark"]["samples_per_second"] == PROFILE["benchmark"]["samples_per_second"]


def test_one_address_registers_at_most_a_days_quota_and_other_addresses_are_served(c: Clocked) -> None:
    quota = int(c.settings.limits.register_per_day)
    codes = [_register(c, f"sybil{i}", "203.0.113.7").status_code for i in range(quota + 20)]
    assert codes[:quota] == [201] * quota
    refused = _register(c, "sybil-late", "203.0.113.7")
    assert refused.status_code == 429 and refused.json()["error"] == "rate_limited"
    assert 1 <= int(refused.headers["Retry-After"]) <= DAY
    assert set(codes[quota:]) == {429}
    # other addresses register as usual
    assert _register(c, "neighbour", "2001:db8:1:2::9").status_code == 201
    assert _register(c, "honest", "198.51.100.20").status_code == 201
    # the quota refills over the day: a real volunteer behind that address can come back tomorrow
    c.clock.advance(DAY)
    assert _register(c, "tomorrow", "203.0.113.7").status_code == 201
    assert _store_figures(c)["volunteers"] == quota + 3
    # a refused registration (a taken name) creates nothing and does not count
    taken = [_register(c, "honest", "192.0.2.1").status_code for _ in range(quota + 10)]
    assert set(taken) == {409}
    assert _register(c, "fresh", "192.0.2.1").status_code == 201


def test_rejoins_with_maximal_profiles_keep_the_store_bounded(c: Clocked) -> None:
    """The issue's replay: 15 credentials from one address, each re-joining over and over with 26 KB
    profiles (and with two keys, as two workers). Before the fix every join kept another 26 KB row."""
    c.create_run(task_config={"preset": "tiny", "num_shards": 256, "samples_per_shard": 64})
    attackers = [c.register(f"mallory{i}") for i in range(15)]
    keys = {a.name: [a.public_key, c.new_key()[1]] for a in attackers}
    request_bytes = len(json.dumps(MAXIMAL_PROFILE))
    assert request_bytes > 25_000
    figures: list[dict[str, int]] = []
    for round_ in range(12):
        profile = ESCAPED_PROFILE if round_ % 3 == 2 else MAXIMAL_PROFILE
        for attacker in attackers:
            joined = c.join(attacker, profile=profile, peer_public_key=keys[attacker.name][round_ % 2])
            # a heartbeat with figures of its own: those go to the run's totals when the row goes
            assert c.heartbeat(attacker, joined["session_id"], samples_total=10).status_code == 200
        c.clock.advance(30.0)
        figures.append(_store_figures(c))
    last = figures[-1]
    # one session per (volunteer, key): a re-join replaces the row instead of adding one
    assert last["sessions"] <= 2 * len(attackers), last
    assert last["leases"] <= 2 * last["sessions"] * c.settings.work.max_leases_per_session, last
    assert last["largest_profile"] <= STORED_PROFILE_MAX_BYTES < request_bytes / 6, last
    assert last["profile_bytes"] <= last["sessions"] * STORED_PROFILE_MAX_BYTES
    # the file stops growing: rows of deleted sessions are reused (before: +12 MB over these rounds)
    assert last["used_bytes"] <= figures[1]["used_bytes"] + 512 * 1024, [f["used_bytes"] for f in figures]
    # what the deleted sessions reported is still in the run's figures (15 x 12 heartbeats of 10 samples)
    stats = c.client.get("/api/v1/runs/shapes").json()["stats"]
    assert stats["samples_total"] == 15 * 12 * 10 and stats["volunteers"] == 15
    assert _metric(c, "leases_issued_total") >= 15 * 12  # a lease per join, counted although deleted


def test_joins_per_volunteer_are_limited_per_day(tmp_path: Path) -> None:
    limits = LimitSettings(**LIFTED, join_per_day=20)
    for c in make_clocked(tmp_path, limits=limits):
        c.create_run()
        mallory, alice = c.register("mallory"), c.register("alice")
        for _ in range(30):  # refused joins add nothing to the store, and do not count
            junk = c.join(mallory, peer_public_key="ssh-rsa " + "A" * 200, expect=422)
            assert junk["error"] == "invalid"
        for _ in range(20):
            c.join(mallory)
        refused = c.join(mallory, expect=429)
        assert refused["error"] == "rate_limited"
        assert c.join(alice)["session_id"]  # per volunteer: others join as usual
        c.clock.advance(DAY / 20 + 1)  # one more join a twentieth of a day later
        assert c.join(mallory)["session_id"]


def _verified_lease(c: Clocked, peer: Peer, joined: dict[str, Any]) -> int:
    """Complete the session's lease with the swarm seeing the peer; returns the samples credited."""
    sid, lease = joined["session_id"], joined["lease"]
    swarm_sees(c, sid)
    c.clock.advance(1.0)
    done = c.complete(peer, sid, lease["lease_id"], lease["samples"])
    assert done.status_code == 200 and done.json()["verified"], done.text
    return int(done.json()["credited_samples"])


def test_the_sweeper_prunes_ended_sessions_after_retention_and_honest_credit_stays(tmp_path: Path) -> None:
    work = WorkSettings(ended_session_retention=3600.0)
    for c in make_clocked(tmp_path, work=work, limits=LimitSettings(**LIFTED)):
        c.create_run(task_config={"preset": "tiny", "num_shards": 16, "samples_per_shard": 64})
        alice, bob, carol = c.register("alice"), c.register("bob"), c.register("carol")
        # alice trains, is credited, and re-joins with her key: the credited session stays
        first = c.join(alice)
        credited = _verified_lease(c, alice, first)
        assert c.heartbeat(alice, first["session_id"], samples_total=64).status_code == 200
        again = c.join(alice)
        assert again["session_id"] != first["session_id"]
        # bob reports samples, leaves, and joins with another key: his old session goes at once
        b1 = c.join(bob)
        assert c.heartbeat(bob, b1["session_id"], samples_total=40).status_code == 200
        assert (
            c.client.post(f"/api/v1/sessions/{b1['session_id']}/leave", headers=bob.headers).status_code
            == 200
        )
        b2 = c.join(bob, peer_public_key=c.new_key()[1])
        # carol runs two workers; the first falls silent (lost), the second goes on
        c1 = c.join(carol)
        c2 = c.join(carol, peer_public_key=c.new_key()[1])
        issued = _metric(c, "leases_issued_total")
        with c.client.app.state.resources.store.read() as db:  # type: ignore[attr-defined]
            alive = set(db.scalars(select(PeerSession.id)))
        assert first["session_id"] in alive and b1["session_id"] not in alive
        assert {c1["session_id"], c2["session_id"]} <= alive

        c.clock.advance(c.settings.work.session_timeout + 60.0)  # past the leases' deadlines too
        for peer, joined in ((alice, again), (bob, b2), (carol, c2)):
            assert c.heartbeat(peer, joined["session_id"], samples_total=1).status_code == 200
        assert c.sweep().lost == 1  # carol's first worker
        with c.client.app.state.resources.store.read() as db:  # type: ignore[attr-defined]
            assert db.get(PeerSession, c1["session_id"]) is not None  # lost, kept for the retention period
        c.clock.advance(3600.0)
        for peer, joined in ((alice, again), (bob, b2), (carol, c2)):
            assert c.heartbeat(peer, joined["session_id"], samples_total=1).status_code == 200
        assert c.sweep().pruned == 1
        with c.client.app.state.resources.store.read() as db:  # type: ignore[attr-defined]
            alive = set(db.scalars(select(PeerSession.id)))
            assert db.scalar(select(func.count()).select_from(LedgerEntry)) == 1
        assert c1["session_id"] not in alive and first["session_id"] in alive, "credit keeps its session"
        # a silent agent that comes back is told to join again, and can
        gone = c.heartbeat(carol, c1["session_id"])
        assert gone.status_code == 404 and gone.json()["error"] == "session_not_found"
        assert c.join(carol)["session_id"]

        # nobody's figures moved: credit, reported samples, volunteers, lease counters
        board = {e["volunteer"]: e for e in c.board()}
        assert board["alice"]["verified_samples"] == credited == 64
        stats = c.client.get("/api/v1/runs/shapes").json()["stats"]
        assert stats["samples_total"] == 64 + 40 + 3 and stats["volunteers"] == 3
        assert stats["samples_verified"] == 64
        assert _metric(c, "leases_issued_total") >= issued
        detail = c.client.get("/api/v1/volunteers", headers=c.admin)
        assert detail.status_code == 200 and {v["name"] for v in detail.json()} == {"alice", "bob", "carol"}

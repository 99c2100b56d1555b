"""The contribution ledger: what each volunteer is credited with, and the leaderboard built from it.

Credits come only from leases the coordinator handed out and an authenticated session reported done.
A claim is capped at what the peer could have done: the shard's size and the peer's profiled throughput
(x ``throughput_tolerance``) over the time it held the lease. The swarm peer cross-checks heartbeats
against the signed progress records each peer publishes in the DHT (which the other peers rely on to
time their averaging, so they cannot be inflated without disturbing training); sessions whose heartbeats
keep claiming more than those records show have their credits flagged. A capped claim is credited at the
cap and flagged with the reason; a claim the swarm never saw progress records for is credited but not
*verified* (the leaderboard shows both). hivemind's reported throughput is a smoothed estimate that
drops while a peer waits or pauses, so it flags but never cuts a claim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from coordinator.models import Lease, LedgerEntry, PeerSession, Run, Shard, Volunteer
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import Leaderboard, LeaderboardEntry, RunStats

# Heartbeats whose throughput disagreed with the profile or the DHT before a session's credits are flagged.
_MISMATCHES_BEFORE_FLAG = 3
# A claim may exceed the throughput cap by this many samples (one accumulation of micro-batches).
_CLAIM_SLACK_SAMPLES = 64


@dataclass(frozen=True)
class Credit:
    samples: int
    verified: bool
    flagged: bool
    reason: str | None


def assess_claim(
    *,
    lease: Lease,
    session: PeerSession,
    claimed: int,
    compute_seconds: float,
    now: float,
    settings: CoordinatorSettings,
) -> Credit:
    """How much of a lease-completion claim to credit, and why any of it was cut."""
    reasons: list[str] = []
    credited = claimed
    if credited > lease.samples:
        credited = lease.samples
        reasons.append(f"claimed {claimed} samples for a shard of {lease.samples}")
    held = max(0.0, now - lease.issued_at)
    if compute_seconds > held + 5.0:
        reasons.append(f"claimed {compute_seconds:.0f}s of compute in {held:.0f}s")
    profile_cap = int(session.max_samples_per_second * held) + _CLAIM_SLACK_SAMPLES
    if credited > profile_cap:
        credited = profile_cap
        reasons.append(
            f"{claimed} samples in {held:.0f}s exceeds the profiled throughput ({session.max_samples_per_second:.0f} samples/s)"
        )
    window = settings.credit.progress_record_window
    verified = session.dht_seen_at is not None and session.dht_seen_at >= lease.issued_at - window
    if session.flagged_heartbeats >= _MISMATCHES_BEFORE_FLAG:
        reasons.append(
            f"{session.flagged_heartbeats} heartbeats claimed more throughput than the profile or the swarm's progress records show"
        )
    if not verified:
        reasons.append("no signed progress records from this peer were seen in the swarm")
    flagged = bool(reasons)
    return Credit(
        samples=max(0, credited), verified=verified, flagged=flagged, reason="; ".join(reasons) or None
    )


def run_stats(db: Session, *, run: Run, settings: CoordinatorSettings) -> RunStats:
    now = time.time()
    online_after = now - settings.work.session_timeout
    active = (
        (PeerSession.run_id == run.id)
        & (PeerSession.state == "active")
        & (PeerSession.last_heartbeat_at >= online_after)
    )
    row = db.execute(
        select(
            func.count(),
            func.coalesce(func.sum(PeerSession.samples_per_second), 0.0),
            func.avg(PeerSession.loss),
        ).where(active)
    ).one()
    totals = db.execute(
        select(
            func.coalesce(func.sum(PeerSession.samples_total), 0),
            func.coalesce(func.max(PeerSession.global_epoch), 0),
            func.count(func.distinct(PeerSession.volunteer_id)),
        ).where(PeerSession.run_id == run.id)
    ).one()
    shards_done = (
        db.scalar(
            select(func.count()).select_from(Shard).where(Shard.run_id == run.id, Shard.state == "done")
        )
        or 0
    )
    credited = (
        db.scalar(select(func.coalesce(func.sum(LedgerEntry.samples), 0)).where(LedgerEntry.run_id == run.id))
        or 0
    )
    return RunStats(
        active_peers=int(row[0]),
        samples_per_second=float(row[1] or 0.0),
        loss=float(row[2]) if row[2] is not None else None,
        samples_total=int(totals[0]),
        global_epoch=int(totals[1]),
        volunteers=int(totals[2]),
        shards_done=int(shards_done),
        shards_total=run.num_shards * run.data_epochs,
        data_epoch=run.current_data_epoch,
        samples_credited=int(credited),
    )


def leaderboard(
    db: Session, *, settings: CoordinatorSettings, run: Run | None = None, limit: int = 100
) -> Leaderboard:
    """Volunteers ranked by credited samples (per run, or overall when ``run`` is None)."""
    now = time.time()
    online_after = now - settings.work.session_timeout
    credit_query = select(
        LedgerEntry.volunteer_id,
        func.sum(LedgerEntry.samples),
        func.sum(case((LedgerEntry.verified, LedgerEntry.samples), else_=0)),
        func.sum(LedgerEntry.compute_seconds),
        func.sum(case((LedgerEntry.flagged, 1), else_=0)),
    ).group_by(LedgerEntry.volunteer_id)
    session_query = select(
        PeerSession.volunteer_id,
        PeerSession.state,
        PeerSession.last_heartbeat_at,
        PeerSession.samples_per_second,
        PeerSession.profile,
    )
    if run is not None:
        credit_query = credit_query.where(LedgerEntry.run_id == run.id)
        session_query = session_query.where(PeerSession.run_id == run.id)
    credits = {row[0]: row[1:] for row in db.execute(credit_query)}
    throughput: dict[str, float] = {}
    online: dict[str, bool] = {}
    devices: dict[str, list[str]] = {}
    for volunteer_id, state, last_heartbeat, sps, profile in db.execute(session_query):
        is_online = state == "active" and last_heartbeat >= online_after
        online[volunteer_id] = online.get(volunteer_id, False) or is_online
        if is_online:
            throughput[volunteer_id] = throughput.get(volunteer_id, 0.0) + float(sps or 0.0)
        known = devices.setdefault(volunteer_id, [])
        for device in _profile_devices(profile):
            if device not in known and len(known) < 4:
                known.append(device)
    ids = set(credits) | set(devices)
    volunteers = {v.id: v for v in db.scalars(select(Volunteer).where(Volunteer.id.in_(ids)))} if ids else {}
    entries = []
    for volunteer_id in ids:
        volunteer = volunteers.get(volunteer_id)
        if volunteer is None or volunteer.banned_at is not None:
            continue
        samples, verified, compute, flagged = credits.get(volunteer_id, (0, 0, 0.0, 0))
        entries.append(
            LeaderboardEntry(
                rank=0,
                volunteer=volunteer.name,
                samples=int(samples or 0),
                verified_samples=int(verified or 0),
                compute_seconds=float(compute or 0.0),
                samples_per_second=round(throughput.get(volunteer_id, 0.0), 2),
                last_seen=volunteer.last_seen,
                devices=devices.get(volunteer_id, []),
                flagged=int(flagged or 0),
                online=online.get(volunteer_id, False),
            )
        )
    entries.sort(key=lambda e: (-e.samples, -e.samples_per_second, e.volunteer))
    for rank, entry in enumerate(entries, start=1):
        entry.rank = rank
    return Leaderboard(run=run.name if run is not None else None, entries=entries[:limit], generated_at=now)


def _profile_devices(profile: dict | None) -> list[str]:
    if not profile:
        return []
    gpus = profile.get("gpus") or []
    if gpus:
        return [str(g.get("name", "GPU")) for g in gpus]
    return [f"{profile.get('cpu_model', 'CPU')} ({profile.get('cpu_cores', '?')} cores)"]


def ledger_totals(db: Session, *, run: Run) -> dict[str, int]:
    """Samples credited and leases completed for a run (the dashboard's headline numbers)."""
    samples = (
        db.scalar(select(func.coalesce(func.sum(LedgerEntry.samples), 0)).where(LedgerEntry.run_id == run.id))
        or 0
    )
    leases = (
        db.scalar(
            select(func.count()).select_from(Lease).where(Lease.run_id == run.id, Lease.state == "completed")
        )
        or 0
    )
    return {"samples": int(samples), "leases": int(leases)}

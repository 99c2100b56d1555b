"""The contribution ledger: how claims become credit, and the leaderboard built from it.

Credit never rests on what a volunteer says about itself (docs/credit-and-trust.md):

* **Only leased work counts.** Credit comes from leases the coordinator handed out and an authenticated
  session reported done, at most the shard's samples, once per lease.
* **Device-class ceilings, not benchmarks.** Each session's throughput is bounded by a plausible ceiling
  for its device class (per assigned CPU thread, per GPU, with capped counts); the benchmark the peer
  reports can only lower that bound. A lease cannot be completed faster than its samples at the ceiling
  (its minimum duration, ``Lease.not_before``); a claim above the benchmark-derived cap is credited at
  the cap and flagged.
* **Verified means the swarm saw it.** A claim is *verified* when the coordinator's swarm peer read the
  peer's signed progress records while it held the lease and the peer's epoch kept up with the swarm's
  averaging rounds (the median epoch over volunteers, so one volunteer cannot move it). Only verified,
  settled credit ranks; unverified credit is shown apart. A shard is done, and a data epoch ends, on
  verified work only: an unverified claim holds its shard for ``progress_record_window`` seconds and then
  the shard goes back to the queue.
* **Spot checks.** A sampled fraction of completions gets a proof-of-training check
  (:mod:`coordinator.credit.spotchecks`); their credit is *pending* until the check passes, and a failed check
  removes it and flags the volunteer.
* **Flags.** Every capped or refused claim leaves an organizer-visible flag (:mod:`coordinator.credit.flags`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, select
from sqlalchemy.orm import Session

from coordinator.credit import flags
from coordinator.models import Lease, LedgerEntry, PeerSession, Run, Shard, SpotCheck, Volunteer
from coordinator.retention import profile_gpu_count, pruned_totals
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import UNVERIFIED_REASON_PREFIX, Leaderboard, LeaderboardEntry, RunStats
from volunteer_app.states import OPEN_SPOT_CHECK_STATES, LeaseState, SessionState, ShardState

# Heartbeats whose throughput disagreed with the profile or the DHT before a session's credits are flagged.
_MISMATCHES_BEFORE_FLAG = 3
# A claim may exceed the throughput cap by this many samples (one accumulation of micro-batches).
_CLAIM_SLACK_SAMPLES = 64
# A progress record read this long before a lease was issued still counts as seeing the peer during it: the
# swarm peer polls every few seconds and a record lives a minute in the DHT.
SIGHTING_SLACK_SECONDS = 30.0
# Reasons that say a claim is unverified start with this, so that a later verification can drop them (and
# the agent can tell "awaiting the swarm's confirmation" from a flag).
UNVERIFIED_PREFIX = UNVERIFIED_REASON_PREFIX
# Spot checks whose credit is not settled yet.
OPEN_CHECK_STATES = OPEN_SPOT_CHECK_STATES


@dataclass(frozen=True)
class Credit:
    samples: int
    verified: bool
    flagged: bool
    reason: str | None
    capped: bool = False
    """True when the claim itself was cut (more than the shard, or more than the throughput cap)."""


# ------------------------------------------------------------------------------------------ ceilings
def rate_ceiling(
    *, profile: dict[str, Any], assignment: dict[str, Any], settings: CoordinatorSettings
) -> float:
    """The most samples per second the device class could train: per GPU or per assigned CPU thread, with the
    counts themselves capped. Nothing the peer measured about itself enters here."""
    credit = settings.credit
    if assignment.get("device") == "cuda":
        gpus = min(profile_gpu_count(profile), credit.max_credited_gpus)
        return max(1, gpus) * credit.gpu_max_samples_per_second
    threads = min(max(1, int(assignment.get("threads") or 1)), credit.max_credited_cpu_threads)
    return threads * credit.cpu_thread_max_samples_per_second


def session_rate_cap(
    *, profile: dict[str, Any], assignment: dict[str, Any], settings: CoordinatorSettings
) -> float:
    """The throughput a session's claims are capped at: its device-class ceiling, lowered (never raised) by
    the peer's own benchmark x ``throughput_tolerance`` when the benchmark ran on the assigned device."""
    ceiling = rate_ceiling(profile=profile, assignment=assignment, settings=settings)
    benchmark = profile.get("benchmark") or {}
    rate = float(benchmark.get("samples_per_second") or 0.0)
    if rate > 0 and benchmark.get("device", "cpu") == assignment.get("device"):
        scale = max(1.0, float(assignment.get("threads") or 1) / max(1, int(benchmark.get("threads") or 1)))
        if assignment.get("device") == "cuda":
            scale = 1.0
        return min(ceiling, rate * scale * settings.credit.throughput_tolerance)
    return ceiling


def session_ceiling(session: PeerSession, settings: CoordinatorSettings) -> float:
    return rate_ceiling(profile=session.profile or {}, assignment=session.assignment or {}, settings=settings)


# ------------------------------------------------------------------------------------------ the swarm's view
def swarm_epoch(db: Session, *, run_id: str, now: float, settings: CoordinatorSettings) -> int | None:
    """The swarm's epoch as its progress records show it: the median over volunteers (each at its furthest
    session) seen within ``progress_record_window``. None when the swarm peer saw nobody."""
    rows = db.execute(
        select(PeerSession.volunteer_id, func.max(PeerSession.dht_epoch))
        .where(
            PeerSession.run_id == run_id,
            PeerSession.dht_epoch.is_not(None),
            PeerSession.dht_seen_at >= now - settings.credit.progress_record_window,
        )
        .group_by(PeerSession.volunteer_id)
    ).all()
    epochs = [int(epoch) for _, epoch in rows if epoch is not None]
    if not epochs:
        return None
    return int(statistics.median_low(epochs))


def swarm_confirms(
    *, session: PeerSession, lease: Lease, epoch: int | None, settings: CoordinatorSettings
) -> tuple[bool, str | None]:
    """Whether the swarm's records confirm that ``session`` trained while it held ``lease``, and if not, why."""
    seen = session.dht_seen_at
    if seen is None or seen < lease.issued_at - SIGHTING_SLACK_SECONDS:
        return False, "the swarm saw no signed progress records from this peer while it held the lease"
    if cut_off(session, epoch=epoch, settings=settings):
        return False, (
            f"this peer has averaged with nobody while the swarm went from epoch {session.epoch_at_join} to "
            f"{epoch}: its work has not reached the shared model"
        )
    lag = settings.credit.epoch_lag_tolerance
    if epoch is not None and session.dht_epoch is not None and session.dht_epoch < epoch - lag:
        return False, (
            f"this peer's progress records are at epoch {session.dht_epoch} while the swarm is at {epoch}: "
            "it took no part in the swarm's averaging rounds"
        )
    return True, None


def cut_off(session: PeerSession, *, epoch: int | None, settings: CoordinatorSettings) -> bool:
    """Whether ``session`` has averaged with nobody (its own count of rounds: a peer that says none is believed,
    since it only costs it) while others trained with it (a swarm of two or more, by its count) and the swarm's
    epoch moved ``credit.isolation_epochs`` past the one it joined at."""
    return (
        epoch is not None
        and session.epoch_at_join is not None
        and epoch - session.epoch_at_join >= settings.credit.isolation_epochs
        and not session.averaging_rounds
        and (session.swarm_size or 0) >= 2
    )


def record_sighting(
    db: Session, *, session: PeerSession, now: float, samples_per_second: float, epoch: int
) -> None:
    """What the run's swarm peer writes when it reads a session's signed progress record from the DHT
    (``coordinator.swarm.peer.SwarmPeer.read_progress`` does the same inline). Tests that play the swarm
    use it."""
    session.dht_seen_at = now
    session.dht_samples_per_second = samples_per_second
    session.dht_epoch = epoch


# ------------------------------------------------------------------------------------------ claims
def assess_claim(
    *,
    lease: Lease,
    session: PeerSession,
    claimed: int,
    compute_seconds: float,
    now: float,
    settings: CoordinatorSettings,
    epoch: int | None = None,
) -> Credit:
    """How much of a lease-completion claim to credit, whether the swarm confirms it, and why any was cut.

    ``epoch`` is the swarm's epoch (:func:`swarm_epoch`), or None when no progress records were read.
    """
    reasons: list[str] = []
    capped = False
    credited = claimed
    if credited > lease.samples:
        credited = lease.samples
        capped = True
        reasons.append(f"claimed {claimed} samples for a shard of {lease.samples}")
    held = max(0.0, now - lease.issued_at)
    if compute_seconds > held + 5.0:
        reasons.append(f"claimed {compute_seconds:.0f}s of compute in {held:.0f}s")
    profile_cap = int(session.max_samples_per_second * held) + _CLAIM_SLACK_SAMPLES
    if credited > profile_cap:
        credited = profile_cap
        capped = True
        reasons.append(
            f"{claimed} samples in {held:.0f}s exceeds this peer's throughput cap "
            f"({session.max_samples_per_second:.0f} samples/s)"
        )
    if session.flagged_heartbeats >= _MISMATCHES_BEFORE_FLAG:
        reasons.append(
            f"{session.flagged_heartbeats} heartbeats claimed more than the coordinator or the swarm's "
            "progress records can account for"
        )
    verified, why = swarm_confirms(session=session, lease=lease, epoch=epoch, settings=settings)
    if not verified:
        reasons.append(UNVERIFIED_PREFIX + (why or "not confirmed by the swarm"))
    return Credit(
        samples=max(0, credited),
        verified=verified,
        flagged=bool(reasons),
        reason="; ".join(reasons) or None,
        capped=capped,
    )


def _without_unverified(reason: str | None) -> str | None:
    if not reason:
        return None
    kept = [part for part in reason.split("; ") if not part.startswith(UNVERIFIED_PREFIX)]
    return "; ".join(kept) or None


def mark_verified(db: Session, *, lease: Lease, entry: LedgerEntry | None) -> None:
    """A claim the swarm (or a spot check) confirmed after the fact: verified, its shard done."""
    reason = _without_unverified(lease.flag_reason)
    lease.flag_reason = reason
    lease.flagged = reason is not None
    if entry is not None:
        entry.verified = True
        entry.reason = _without_unverified(entry.reason)
        entry.flagged = entry.reason is not None
    db.execute(
        Shard.__table__.update()
        .where(
            Shard.run_id == lease.run_id,
            Shard.data_epoch == lease.data_epoch,
            Shard.shard == lease.shard,
            Shard.lease_id == lease.id,
            Shard.state == ShardState.CLAIMED,
        )
        .values(state=ShardState.DONE)
    )


def settle_claims(db: Session, *, settings: CoordinatorSettings, now: float) -> tuple[int, int]:
    """Verify claimed shards the swarm has since confirmed; send those unconfirmed for longer than
    ``progress_record_window`` back to the queue (their credit stays, unverified, shown apart).

    Called by the coordinator's sweeper every few seconds. Returns (verified, re-queued)."""
    rows = db.execute(
        select(Shard, Lease, PeerSession, LedgerEntry)
        .join(Lease, Lease.id == Shard.lease_id)
        .join(PeerSession, PeerSession.id == Lease.session_id)
        .outerjoin(LedgerEntry, LedgerEntry.lease_id == Lease.id)
        .where(Shard.state == ShardState.CLAIMED)
    ).all()
    epochs: dict[str, int | None] = {}
    verified = requeued = 0
    for shard, lease, session, entry in rows:
        if lease.run_id not in epochs:
            epochs[lease.run_id] = swarm_epoch(db, run_id=lease.run_id, now=now, settings=settings)
        confirmed, why = swarm_confirms(
            session=session, lease=lease, epoch=epochs[lease.run_id], settings=settings
        )
        if confirmed:
            mark_verified(db, lease=lease, entry=entry)
            verified += 1
        elif now > (lease.completed_at or now) + settings.credit.progress_record_window:
            shard.state = ShardState.PENDING
            shard.lease_id = None
            shard.done_at = None
            requeued += 1
            flags.flag_lease(
                db,
                lease,
                kind=flags.CLAIM_UNVERIFIED,
                detail=f"shard {lease.shard} went back to the queue: {why}",
                now=now,
            )
    return verified, requeued


# ------------------------------------------------------------------------------------------ views
def run_stats(db: Session, *, run: Run, settings: CoordinatorSettings, now: float | None = None) -> RunStats:
    import time

    now = time.time() if now is None else now
    online_after = now - settings.work.session_timeout
    active = (
        (PeerSession.run_id == run.id)
        & (PeerSession.state == SessionState.ACTIVE)
        & (PeerSession.last_heartbeat_at >= online_after)
    )
    row = db.execute(
        select(
            func.count(),
            func.coalesce(func.sum(PeerSession.samples_per_second), 0.0),
            func.avg(PeerSession.loss),
        ).where(active)
    ).one()
    # Summed as floats: a sum of integers can overflow SQLite's 64-bit INTEGER (and break every page).
    totals = db.execute(
        select(
            func.coalesce(func.sum(cast(PeerSession.samples_total, Float)), 0.0),
            func.coalesce(func.max(PeerSession.global_epoch), 0),
            func.count(func.distinct(PeerSession.volunteer_id)),
        ).where(PeerSession.run_id == run.id)
    ).one()
    pruned = pruned_totals(db, run_id=run.id)  # what deleted sessions had reported
    shards_done = (
        db.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.run_id == run.id, Shard.state == ShardState.DONE)
        )
        or 0
    )
    credited, verified = db.execute(
        select(
            func.coalesce(func.sum(LedgerEntry.samples), 0),
            func.coalesce(func.sum(case((LedgerEntry.verified, LedgerEntry.samples), else_=0)), 0),
        ).where(LedgerEntry.run_id == run.id)
    ).one()
    return RunStats(
        active_peers=int(row[0]),
        samples_per_second=float(row[1] or 0.0),
        loss=float(row[2]) if row[2] is not None else None,
        samples_total=int((totals[0] or 0) + pruned.samples_total),
        global_epoch=max(int(totals[1]), pruned.global_epoch),
        volunteers=int(totals[2]),
        shards_done=int(shards_done),
        shards_total=run.num_shards * run.data_epochs,
        data_epoch=run.current_data_epoch,
        samples_credited=int(credited or 0),
        samples_verified=int(verified or 0),
    )


def leaderboard(
    db: Session,
    *,
    settings: CoordinatorSettings,
    run: Run | None = None,
    limit: int = 100,
    now: float | None = None,
) -> Leaderboard:
    """Volunteers ranked by settled credit: verified samples not under a spot check, then by name. Unverified
    samples are listed apart and never rank, and neither does any throughput a peer reports (per run, or
    overall when ``run`` is None)."""
    import time

    now = time.time() if now is None else now
    online_after = now - settings.work.session_timeout
    open_check = and_(SpotCheck.state.in_(OPEN_CHECK_STATES), LedgerEntry.verified)
    credit_query = (
        select(
            LedgerEntry.volunteer_id,
            func.sum(LedgerEntry.samples),
            func.sum(case((LedgerEntry.verified, LedgerEntry.samples), else_=0)),
            func.sum(case((open_check, LedgerEntry.samples), else_=0)),
            func.sum(LedgerEntry.compute_seconds),
            func.sum(case((LedgerEntry.flagged, 1), else_=0)),
        )
        .outerjoin(SpotCheck, SpotCheck.lease_id == LedgerEntry.lease_id)
        .group_by(LedgerEntry.volunteer_id)
    )
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
        is_online = state == SessionState.ACTIVE and last_heartbeat >= online_after
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
        samples, verified, pending, compute, flagged = credits.get(volunteer_id, (0, 0, 0, 0.0, 0))
        samples, verified, pending = int(samples or 0), int(verified or 0), int(pending or 0)
        entries.append(
            LeaderboardEntry(
                rank=0,
                volunteer=volunteer.name,
                samples=samples,
                verified_samples=verified,
                pending_samples=pending,
                unverified_samples=samples - verified,
                compute_seconds=float(compute or 0.0),
                samples_per_second=round(throughput.get(volunteer_id, 0.0), 2),
                last_seen=volunteer.last_seen,
                devices=devices.get(volunteer_id, []),
                flagged=int(flagged or 0),
                online=online.get(volunteer_id, False),
            )
        )
    # Nothing a peer says about itself orders the board: settled credit, then the name.
    entries.sort(key=lambda e: (-(e.verified_samples - e.pending_samples), e.volunteer.lower(), e.volunteer))
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
            select(func.count())
            .select_from(Lease)
            .where(Lease.run_id == run.id, Lease.state == LeaseState.COMPLETED)
        )
        or 0
    )
    return {"samples": int(samples), "leases": int(leases)}

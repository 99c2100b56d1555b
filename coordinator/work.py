"""Work leases: a run's data set is numbered shards; a lease hands one shard to one session with a
deadline sized from the peer's throughput. Expired leases go back to the queue, completions are credited
once, and when every shard of the last data epoch is done the run finishes.
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from coordinator.authority import new_id
from coordinator.errors import Conflict, NotFound
from coordinator.ledger import assess_claim
from coordinator.models import Lease, LedgerEntry, PeerSession, Run, Shard
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import LeaseCompleteRequest, LeaseCompleteResponse, LeaseOut


def add_shards(db: Session, *, run: Run, data_epoch: int) -> None:
    """Queue every shard of ``data_epoch``."""
    db.execute(
        insert(Shard),
        [
            {"run_id": run.id, "data_epoch": data_epoch, "shard": i, "state": "pending"}
            for i in range(run.num_shards)
        ],
    )


def finish_run(db: Session, *, run: Run) -> None:
    """End a run: no more leases; outstanding ones are returned (their peers get `stop` on the next heartbeat)."""
    now = time.time()
    run.state = "finished"
    run.finished_at = now
    run.updated_at = now
    for lease in db.scalars(select(Lease).where(Lease.run_id == run.id, Lease.state == "active")):
        lease.state = "returned"
        _release_shard(db, lease)


def lease_out(lease: Lease) -> LeaseOut:
    return LeaseOut(
        lease_id=lease.id,
        shard=lease.shard,
        data_epoch=lease.data_epoch,
        samples=lease.samples,
        seed=lease.seed,
        issued_at=lease.issued_at,
        deadline=lease.deadline,
    )


def expire_leases(db: Session, *, run_id: str | None = None, now: float | None = None) -> int:
    """Return overdue leases' shards to the queue. Returns how many leases expired."""
    now = time.time() if now is None else now
    query = select(Lease).where(Lease.state == "active", Lease.deadline < now)
    if run_id is not None:
        query = query.where(Lease.run_id == run_id)
    expired = list(db.scalars(query))
    for lease in expired:
        lease.state = "expired"
        _release_shard(db, lease)
    return len(expired)


def _release_shard(db: Session, lease: Lease) -> None:
    db.execute(
        update(Shard)
        .where(
            Shard.run_id == lease.run_id,
            Shard.data_epoch == lease.data_epoch,
            Shard.shard == lease.shard,
            Shard.lease_id == lease.id,
            Shard.state == "leased",
        )
        .values(state="pending", lease_id=None)
    )


def lease_deadline(*, samples: int, session: PeerSession, settings: CoordinatorSettings) -> float:
    """Seconds a peer gets for a shard: its expected time x the safety factor, within the configured bounds."""
    throughput = session.samples_per_second or 0.0
    if throughput <= 0:
        benchmark = (session.profile or {}).get("benchmark") or {}
        throughput = float(benchmark.get("samples_per_second") or 0.0)
    if throughput <= 0:
        throughput = settings.work.default_samples_per_second
    seconds = samples / throughput * settings.work.lease_safety_factor + settings.work.lease_min_seconds
    return min(max(seconds, settings.work.lease_min_seconds), settings.work.lease_max_seconds)


def take_lease(
    db: Session, *, run: Run, session: PeerSession, settings: CoordinatorSettings
) -> tuple[Lease | None, float | None]:
    """Lease the next pending shard to ``session``. Returns (lease, None) or (None, retry_after seconds).

    A session holds at most ``max_leases_per_session`` leases. When the current data epoch has no
    pending shard but all are done, the next data epoch starts, or the run finishes after the last.
    """
    now = time.time()
    if run.state != "active" or session.state != "active":
        return None, None
    expire_leases(db, run_id=run.id, now=now)
    held = db.scalar(
        select(func.count()).select_from(Lease).where(Lease.session_id == session.id, Lease.state == "active")
    )
    if held and held >= settings.work.max_leases_per_session:
        raise Conflict(
            f"this session already holds {held} leases; complete one before taking another",
            code="too_many_leases",
        )
    while True:
        shard = db.scalars(
            select(Shard)
            .where(
                Shard.run_id == run.id, Shard.data_epoch == run.current_data_epoch, Shard.state == "pending"
            )
            .order_by(Shard.shard)
            .limit(1)
        ).first()
        if shard is not None:
            break
        remaining = db.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.run_id == run.id, Shard.data_epoch == run.current_data_epoch, Shard.state != "done")
        )
        if remaining:
            next_deadline = db.scalar(
                select(func.min(Lease.deadline)).where(Lease.run_id == run.id, Lease.state == "active")
            )
            retry = max(5.0, (next_deadline or now + 30.0) - now)
            return None, min(retry, 300.0)
        if run.current_data_epoch + 1 >= run.data_epochs:
            finish_run(db, run=run)
            return None, None
        run.current_data_epoch += 1
        run.updated_at = now
        add_shards(db, run=run, data_epoch=run.current_data_epoch)
        db.flush()
    lease = Lease(
        id=new_id(),
        run_id=run.id,
        session_id=session.id,
        volunteer_id=session.volunteer_id,
        data_epoch=shard.data_epoch,
        shard=shard.shard,
        seed=secrets.randbits(31),
        samples=run.samples_per_shard,
        state="active",
        issued_at=now,
        deadline=now + lease_deadline(samples=run.samples_per_shard, session=session, settings=settings),
    )
    db.add(lease)
    shard.state = "leased"
    shard.lease_id = lease.id
    return lease, None


def complete_lease(
    db: Session,
    *,
    session: PeerSession,
    lease_id: str,
    report: LeaseCompleteRequest,
    settings: CoordinatorSettings,
) -> LeaseCompleteResponse:
    """Credit a finished lease once. Reporting the same lease again answers the first result unchanged."""
    lease = db.get(Lease, lease_id)
    if lease is None or lease.session_id != session.id:
        raise NotFound(f"this session holds no lease {lease_id!r}", code="lease_not_found")
    if lease.state == "completed":
        return LeaseCompleteResponse(
            lease_id=lease.id,
            credited_samples=lease.samples_credited or 0,
            flagged=lease.flagged,
            reason=lease.flag_reason,
            already_completed=True,
        )
    now = time.time()
    if lease.state == "active" and lease.deadline < now:
        lease.state = "expired"
        _release_shard(db, lease)
    if lease.state != "active":
        raise Conflict(
            f"lease {lease_id} is {lease.state} (deadline passed or returned); its shard went back to the queue",
            code=f"lease_{lease.state}",
        )
    credit = assess_claim(
        lease=lease,
        session=session,
        claimed=report.samples,
        compute_seconds=report.compute_seconds,
        now=now,
        settings=settings,
    )
    lease.state = "completed"
    lease.completed_at = now
    lease.samples_claimed = report.samples
    lease.samples_credited = credit.samples
    lease.compute_seconds = report.compute_seconds
    lease.flagged = credit.flagged
    lease.flag_reason = credit.reason
    db.execute(
        update(Shard)
        .where(Shard.run_id == lease.run_id, Shard.data_epoch == lease.data_epoch, Shard.shard == lease.shard)
        .values(state="done", lease_id=lease.id, done_at=now)
    )
    db.add(
        LedgerEntry(
            run_id=lease.run_id,
            volunteer_id=lease.volunteer_id,
            session_id=session.id,
            lease_id=lease.id,
            samples=credit.samples,
            samples_claimed=report.samples,
            compute_seconds=min(report.compute_seconds, max(0.0, now - lease.issued_at) + 5.0),
            verified=credit.verified,
            flagged=credit.flagged,
            reason=credit.reason,
            created_at=now,
        )
    )
    return LeaseCompleteResponse(
        lease_id=lease.id, credited_samples=credit.samples, flagged=credit.flagged, reason=credit.reason
    )


def return_session_leases(db: Session, *, session: PeerSession) -> int:
    """Give a departing session's unfinished leases back to the queue."""
    leases = list(db.scalars(select(Lease).where(Lease.session_id == session.id, Lease.state == "active")))
    for lease in leases:
        lease.state = "returned"
        _release_shard(db, lease)
    return len(leases)

"""Work leases: a run's data set is numbered shards; a lease hands one shard to one session with a
deadline sized from the peer's throughput and a minimum duration from its device-class ceiling. Expired
leases go back to the queue, completions are credited once, and a shard is *done* only when its whole
claim is verified by the swarm (:mod:`coordinator.credit.ledger`); when every shard of the last data epoch is
done the run finishes, so claims nobody can check never end a run.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from typing import NamedTuple

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from coordinator.accounts.authority import new_id
from coordinator.credit import flags, spotchecks
from coordinator.credit.ledger import assess_claim, session_ceiling, swarm_epoch
from coordinator.errors import Conflict, NotFound
from coordinator.models import Lease, LedgerEntry, PeerSession, Run, Shard, SpotCheck
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import LeaseCompleteRequest, LeaseCompleteResponse, LeaseOut, LeaseReturnResponse
from volunteer_app.states import LeaseState, RunState, SessionState, ShardState, SpotCheckState


class LeaseTooEarly(Conflict):
    """A lease reported complete before its minimum duration: the shard cannot have been trained yet."""

    def __init__(self, *, lease: Lease, retry_after: float, claimed: int):
        wait = max(1, math.ceil(retry_after))
        super().__init__(
            f"lease {lease.id} cannot be complete yet: {claimed} samples take at least until "
            f"{lease.not_before or lease.issued_at:.0f} on this peer's device class; report it again in {wait} s",
            code="lease_too_early",
            headers={"Retry-After": str(wait)},
        )
        self.lease_id, self.run_id, self.session_id = lease.id, lease.run_id, lease.session_id
        self.volunteer_id = lease.volunteer_id


def add_shards(db: Session, *, run: Run, data_epoch: int) -> None:
    """Queue every shard of ``data_epoch``."""
    db.execute(
        insert(Shard),
        [
            {"run_id": run.id, "data_epoch": data_epoch, "shard": i, "state": ShardState.PENDING}
            for i in range(run.num_shards)
        ],
    )


def finish_run(db: Session, *, run: Run) -> None:
    """End a run: no more leases; outstanding ones are returned (their peers get `stop` on the next heartbeat)."""
    now = time.time()
    run.state = RunState.FINISHED
    run.finished_at = now
    run.updated_at = now
    for lease in db.scalars(select(Lease).where(Lease.run_id == run.id, Lease.state == LeaseState.ACTIVE)):
        lease.state = LeaseState.RETURNED
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
        not_before=lease.not_before,
    )


def expire_leases(db: Session, *, run_id: str | None = None, now: float | None = None) -> int:
    """Return overdue leases' shards to the queue. Returns how many leases expired."""
    now = time.time() if now is None else now
    query = select(Lease).where(Lease.state == LeaseState.ACTIVE, Lease.deadline < now)
    if run_id is not None:
        query = query.where(Lease.run_id == run_id)
    expired = list(db.scalars(query))
    for lease in expired:
        lease.state = LeaseState.EXPIRED
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
            Shard.state == ShardState.LEASED,
        )
        .values(state=ShardState.PENDING, lease_id=None)
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


WAITING_FOR_CONFIRMATION = "confirmation"
"""No lease: the swarm has not yet confirmed this session's completed shards (``max_unverified_claims``)."""
WAITING_FOR_SHARDS = "shards"
"""No lease: every shard of the data epoch is leased to someone or awaits the swarm's confirmation."""
WAITING_FOR_RUN = "run"
"""No lease: the run (or the session) is not active."""


class LeaseOffer(NamedTuple):
    lease: Lease | None
    retry_after: float | None
    waiting_for: str | None


def take_lease(
    db: Session,
    *,
    run: Run,
    session: PeerSession,
    settings: CoordinatorSettings,
    now: float | None = None,
) -> LeaseOffer:
    """Lease the next pending shard to ``session``: a :class:`LeaseOffer` with the lease, or with none, the
    seconds after which to ask again and what the peer waits for.

    A session holds at most ``max_leases_per_session`` leases. When the current data epoch has no
    pending shard but all are done (verified), the next data epoch starts, or the run finishes after the
    last. Shards whose claims wait for the swarm's confirmation are neither pending nor done: the answer
    is then to retry once a lease expires or a claim is settled.
    """
    now = time.time() if now is None else now
    if run.state != RunState.ACTIVE or session.state != SessionState.ACTIVE:
        return LeaseOffer(None, None, WAITING_FOR_RUN)
    expire_leases(db, run_id=run.id, now=now)
    held = db.scalar(
        select(func.count())
        .select_from(Lease)
        .where(Lease.session_id == session.id, Lease.state == LeaseState.ACTIVE)
    )
    if held and held >= settings.work.max_leases_per_session:
        raise Conflict(
            f"this session already holds {held} leases; complete one before taking another",
            code="too_many_leases",
        )
    waiting = db.execute(
        select(func.count(), func.min(Lease.completed_at))
        .select_from(Shard)
        .join(Lease, Lease.id == Shard.lease_id)
        .where(Shard.run_id == run.id, Shard.state == ShardState.CLAIMED, Lease.session_id == session.id)
    ).one()
    if waiting[0] >= settings.work.max_unverified_claims:
        # more work once the swarm confirms a claim (the sweeper looks every few seconds) or its window ends
        window_end = (waiting[1] or now) + settings.credit.progress_record_window
        return LeaseOffer(None, max(5.0, min(30.0, window_end - now)), WAITING_FOR_CONFIRMATION)
    while True:
        shard = db.scalars(
            select(Shard)
            .where(
                Shard.run_id == run.id,
                Shard.data_epoch == run.current_data_epoch,
                Shard.state == ShardState.PENDING,
            )
            .order_by(Shard.shard)
            .limit(1)
        ).first()
        if shard is not None:
            break
        remaining = db.scalar(
            select(func.count())
            .select_from(Shard)
            .where(
                Shard.run_id == run.id,
                Shard.data_epoch == run.current_data_epoch,
                Shard.state != ShardState.DONE,
            )
        )
        if remaining:
            next_deadline = db.scalar(
                select(func.min(Lease.deadline)).where(
                    Lease.run_id == run.id, Lease.state == LeaseState.ACTIVE
                )
            )
            oldest_claim = db.scalar(
                select(func.min(Lease.completed_at))
                .join(Shard, Shard.lease_id == Lease.id)
                .where(Shard.run_id == run.id, Shard.state == ShardState.CLAIMED)
            )
            events = [next_deadline] if next_deadline is not None else []
            if oldest_claim is not None:
                # the sweeper may verify a claim at any moment; at the latest its window ends
                events.append(min(now + 30.0, oldest_claim + settings.credit.progress_record_window))
            retry = max(5.0, (min(events) if events else now + 30.0) - now)
            return LeaseOffer(None, min(retry, 300.0), WAITING_FOR_SHARDS)
        if run.current_data_epoch + 1 >= run.data_epochs:
            finish_run(db, run=run)
            return LeaseOffer(None, None, WAITING_FOR_RUN)
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
        state=LeaseState.ACTIVE,
        issued_at=now,
        deadline=now + lease_deadline(samples=run.samples_per_shard, session=session, settings=settings),
        not_before=now + run.samples_per_shard / session_ceiling(session, settings),
    )
    db.add(lease)
    shard.state = ShardState.LEASED
    shard.lease_id = lease.id
    return LeaseOffer(lease, None, None)


def complete_lease(
    db: Session,
    *,
    session: PeerSession,
    lease_id: str,
    report: LeaseCompleteRequest,
    settings: CoordinatorSettings,
    now: float | None = None,
    rng: random.Random | None = None,
) -> LeaseCompleteResponse:
    """Credit a finished lease once. Reporting the same lease again answers the first result unchanged.

    :raises LeaseTooEarly: the claim came sooner than the device-class ceiling allows (the lease stays
      active: report it again after ``Retry-After``).
    """
    lease = db.get(Lease, lease_id)
    if lease is None or lease.session_id != session.id:
        raise NotFound(f"this session holds no lease {lease_id!r}", code="lease_not_found")
    if lease.state == LeaseState.COMPLETED:
        entry = db.scalars(select(LedgerEntry).where(LedgerEntry.lease_id == lease.id)).first()
        check = db.scalars(select(SpotCheck).where(SpotCheck.lease_id == lease.id)).first()
        return LeaseCompleteResponse(
            lease_id=lease.id,
            credited_samples=lease.samples_credited or 0,
            flagged=lease.flagged,
            reason=lease.flag_reason,
            already_completed=True,
            verified=bool(entry is not None and entry.verified),
            pending_check=check is not None
            and check.state in (SpotCheckState.PENDING, SpotCheckState.RUNNING),
        )
    now = time.time() if now is None else now
    if lease.state == LeaseState.ACTIVE and lease.deadline < now:
        lease.state = LeaseState.EXPIRED
        _release_shard(db, lease)
    if lease.state != LeaseState.ACTIVE:
        raise Conflict(
            f"lease {lease_id} is {lease.state} (deadline passed or returned); its shard went back to the queue",
            code=f"lease_{lease.state}",
        )
    claimed = min(report.samples, lease.samples)
    earliest = lease.issued_at + claimed / session_ceiling(session, settings)
    if now < earliest:
        raise LeaseTooEarly(lease=lease, retry_after=earliest - now, claimed=claimed)
    credit = assess_claim(
        lease=lease,
        session=session,
        claimed=report.samples,
        compute_seconds=report.compute_seconds,
        now=now,
        settings=settings,
        epoch=swarm_epoch(db, run_id=lease.run_id, now=now, settings=settings),
    )
    lease.state = LeaseState.COMPLETED
    lease.completed_at = now
    lease.samples_claimed = report.samples
    lease.samples_credited = credit.samples
    lease.compute_seconds = report.compute_seconds
    lease.flagged = credit.flagged
    lease.flag_reason = credit.reason
    if credit.samples >= lease.samples:
        # the whole shard: done once the swarm confirms it (now, or within progress_record_window)
        db.execute(
            update(Shard)
            .where(
                Shard.run_id == lease.run_id, Shard.data_epoch == lease.data_epoch, Shard.shard == lease.shard
            )
            .values(
                state=ShardState.DONE if credit.verified else ShardState.CLAIMED,
                lease_id=lease.id,
                done_at=now,
            )
        )
    else:
        _release_shard(db, lease)  # part of a shard: the rest still needs training
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
    if credit.capped:
        flags.flag_lease(
            db,
            lease,
            kind=flags.CLAIM_CAPPED,
            detail=f"credited {credit.samples} of {report.samples} claimed samples: {credit.reason}",
            now=now,
        )
    check = None
    if credit.samples > 0:
        db.flush()
        check = spotchecks.maybe_sample(
            db, lease=lease, session=session, reported_loss=report.loss, settings=settings, now=now, rng=rng
        )
    return LeaseCompleteResponse(
        lease_id=lease.id,
        credited_samples=credit.samples,
        flagged=credit.flagged,
        reason=credit.reason,
        verified=credit.verified,
        pending_check=check is not None,
    )


def return_lease(
    db: Session, *, session: PeerSession, lease_id: str, now: float | None = None
) -> LeaseReturnResponse:
    """A peer gives back a lease it will not finish in time (its volunteer paused): the shard is queued again.

    Returning twice answers the same; a lease already past its deadline is expired instead (same effect).
    """
    lease = db.get(Lease, lease_id)
    if lease is None or lease.session_id != session.id:
        raise NotFound(f"this session holds no lease {lease_id!r}", code="lease_not_found")
    if lease.state == LeaseState.COMPLETED:
        raise Conflict(f"lease {lease_id} was already completed and credited", code="lease_completed")
    if lease.state in (LeaseState.RETURNED, LeaseState.EXPIRED):
        return LeaseReturnResponse(lease_id=lease.id, state=lease.state, already_returned=True)
    now = time.time() if now is None else now
    lease.state = LeaseState.EXPIRED if lease.deadline < now else LeaseState.RETURNED
    _release_shard(db, lease)
    return LeaseReturnResponse(lease_id=lease.id, state=lease.state)


def return_session_leases(db: Session, *, session: PeerSession) -> int:
    """Give a departing session's unfinished leases back to the queue."""
    leases = list(
        db.scalars(select(Lease).where(Lease.session_id == session.id, Lease.state == LeaseState.ACTIVE))
    )
    for lease in leases:
        lease.state = LeaseState.RETURNED
        _release_shard(db, lease)
    return len(leases)

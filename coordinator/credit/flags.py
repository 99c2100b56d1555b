"""Flags: every claim the coordinator capped or refused, kept for the organizers (``GET /runs/{name}/flags``,
``volunteer-coordinator runs flags NAME``).

A flag names the volunteer, the session and, where there is one, the lease, with a reason a person can
read. Repeats of one kind from one session within :data:`MERGE_SECONDS` bump a counter on the same row,
so a peer that misreports on every heartbeat costs one row a minute, not one per request.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.models import Flag, Lease, Volunteer

MERGE_SECONDS = 60.0

# Flag kinds (stable strings: the organizers' tools filter on them).
HEARTBEAT_CAPPED = "heartbeat_capped"
"""A heartbeat reported more samples, throughput, epochs or averaging rounds than the coordinator can check."""
CLAIM_CAPPED = "claim_capped"
"""A lease completion claimed more than the shard holds."""
CLAIM_UNVERIFIED = "claim_unverified"
"""A completed lease the swarm's progress records never confirmed (credited apart, never ranked)."""
LEASE_TOO_EARLY = "lease_too_early"
"""A lease reported complete faster than the device class could train it (refused)."""
SPOT_CHECK_FAILED = "spot_check_failed"
"""A proof-of-training spot check failed: the lease's credit was removed."""
PEER_KEY_REFUSED = "peer_key_refused"
"""A join with a peer key that belongs to another volunteer, or to a banned one."""


def record_flag(
    db: Session,
    *,
    run_id: str,
    volunteer_id: str,
    kind: str,
    detail: str,
    now: float,
    session_id: str | None = None,
    lease_id: str | None = None,
) -> Flag:
    """Add a flag, or count a repeat of the same kind from the same session within a minute."""
    detail = detail[:500]
    if session_id is not None and lease_id is None:
        recent = db.scalars(
            select(Flag)
            .where(
                Flag.session_id == session_id,
                Flag.kind == kind,
                Flag.lease_id.is_(None),
                Flag.last_at >= now - MERGE_SECONDS,
            )
            .order_by(Flag.last_at.desc())
            .limit(1)
        ).first()
        if recent is not None:
            recent.count += 1
            recent.last_at = now
            recent.detail = detail
            return recent
    flag = Flag(
        run_id=run_id,
        volunteer_id=volunteer_id,
        session_id=session_id,
        lease_id=lease_id,
        kind=kind,
        detail=detail,
        count=1,
        created_at=now,
        last_at=now,
    )
    db.add(flag)
    return flag


def flag_lease(db: Session, lease: Lease, *, kind: str, detail: str, now: float) -> Flag:
    """Flag one lease: :func:`record_flag` with the lease's run, volunteer, session and id."""
    return record_flag(
        db, run_id=lease.run_id, volunteer_id=lease.volunteer_id, session_id=lease.session_id, lease_id=lease.id,
        kind=kind, detail=detail, now=now,
    )  # fmt: skip


def list_flags(
    db: Session, *, run_id: str, volunteer_id: str | None = None, limit: int = 500
) -> list[tuple[Flag, str]]:
    """A run's flags, newest first, each with its volunteer's name."""
    query = (
        select(Flag, Volunteer.name)
        .join(Volunteer, Volunteer.id == Flag.volunteer_id)
        .where(Flag.run_id == run_id)
        .order_by(Flag.last_at.desc(), Flag.id.desc())
        .limit(limit)
    )
    if volunteer_id is not None:
        query = query.where(Flag.volunteer_id == volunteer_id)
    return [(flag, name) for flag, name in db.execute(query).all()]


class FlagOut(BaseModel):
    """One flag as the organizers see it (``GET /api/v1/runs/{name}/flags``)."""

    volunteer: str
    kind: str = Field(description="heartbeat_capped, claim_capped, claim_unverified, lease_too_early, ...")
    detail: str
    count: int = Field(description="how many times it happened within a minute of the last time")
    session_id: str | None = None
    lease_id: str | None = None
    first_at: float
    last_at: float


def flag_out(flag: Flag, volunteer_name: str) -> FlagOut:
    return FlagOut(
        volunteer=volunteer_name,
        kind=flag.kind,
        detail=flag.detail,
        count=flag.count,
        session_id=flag.session_id,
        lease_id=flag.lease_id,
        first_at=flag.created_at,
        last_at=flag.last_at,
    )

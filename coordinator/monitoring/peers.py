"""What the organizers see of the peers: a run's peers table and a volunteer's history across runs.

Every figure here is what the peer reported (after the coordinator's caps) or what the coordinator
recorded itself; ``flags`` sums up what a organizer should look at:

* ``capped``: a heartbeat or a claim of this peer was cut to what the coordinator can check;
* ``unverified``: credit of this peer the swarm has not confirmed, or a peer training for longer than
  ``progress_record_window`` whose signed progress records the swarm peer never read;
* ``stale``: no heartbeat for more than two and a half heartbeat intervals (lost after ``session_timeout``);
* ``nan_loss``: training, samples reported, yet no finite loss (its model diverged: workers drop NaN losses
  from their average, so only NaN ones leave it empty);
* ``isolated``: it has averaged with nobody while the swarm moved ``credit.isolation_epochs`` epochs on
  (:func:`coordinator.credit.ledger.cut_off`: behind NAT as a client, say); its claims stay unverified.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import Float, case, cast, func, select
from sqlalchemy.orm import Session

from coordinator.credit import flags as flag_kinds
from coordinator.credit.ledger import cut_off, swarm_epoch
from coordinator.models import Flag, Lease, LedgerEntry, PeerSession, Run, Volunteer
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import VolunteerOut
from volunteer_app.states import LeaseState, SessionState

CAPPING_KINDS = (flag_kinds.HEARTBEAT_CAPPED, flag_kinds.CLAIM_CAPPED, flag_kinds.LEASE_TOO_EARLY)
STALE_INTERVALS = 2.5


class GpuOut(BaseModel):
    name: str
    memory_bytes: int = 0


class HardwareOut(BaseModel):
    cpu_model: str
    cpu_cores: int | None = None
    cpu_threads: int | None = None
    ram_bytes: int | None = None
    os: str | None = None
    gpus: list[GpuOut] = Field(default_factory=list)
    benchmark_samples_per_second: float | None = Field(
        default=None, description="the peer's own speed test (it can only lower its throughput cap)"
    )


class AssignmentOut(BaseModel):
    device: str | None = None
    threads: int | None = None
    micro_batch_size: int | None = None
    accumulation_steps: int | None = None
    client_mode: bool | None = None
    reachability: str | None = Field(
        default=None, description="direct, relayed (through the run's swarm peer) or client; set at join"
    )
    reachability_reason: str | None = None


class LeaseBrief(BaseModel):
    lease_id: str
    shard: int
    data_epoch: int
    samples: int
    issued_at: float
    deadline: float


class PeerOut(BaseModel):
    """One peer (a worker's session) as the organizers' peers table shows it."""

    session_id: str
    run: str
    volunteer: str
    volunteer_banned: bool
    peer_key: str = Field(description="SHA-256 of the worker's hivemind key, shortened (its identity)")
    state: str = Field(description="active, lost, left or stopped")
    worker_state: str
    online: bool
    agent_version: str
    hardware: HardwareOut
    assignment: AssignmentOut
    samples_per_second: float
    throughput_cap: float = Field(description="samples/s this peer's claims are capped at")
    samples_total: int
    loss: float | None
    global_epoch: int
    averaging_rounds: int
    bytes_sent: int
    bytes_received: int
    lease: LeaseBrief | None = Field(description="the lease it holds (the oldest, when two)")
    leases_held: int
    credited_samples: int
    unverified_samples: int
    created_at: float
    last_heartbeat_at: float
    token_expires_at: float
    swarm_seen_at: float | None = Field(description="when the swarm peer last read its progress record")
    flag_count: int = Field(description="flags recorded for this session")
    flags: list[str] = Field(description="capped, unverified, stale, nan_loss, isolated")


def peer_key_hint(public_key: str) -> str:
    return "SHA256:" + hashlib.sha256(public_key.strip().encode("utf-8")).hexdigest()[:16]


def _hardware(profile: dict[str, Any] | None) -> HardwareOut:
    profile = profile or {}
    gpus = [
        GpuOut(name=str(g.get("name", "GPU")), memory_bytes=int(g.get("memory_bytes") or 0))
        for g in profile.get("gpus") or []
        if isinstance(g, dict)
    ]
    benchmark = profile.get("benchmark") or {}
    return HardwareOut(
        cpu_model=str(profile.get("cpu_model", "unknown")),
        cpu_cores=profile.get("cpu_cores"),
        cpu_threads=profile.get("cpu_threads"),
        ram_bytes=profile.get("ram_bytes"),
        os=profile.get("os"),
        gpus=gpus,
        benchmark_samples_per_second=benchmark.get("samples_per_second")
        if isinstance(benchmark, dict)
        else None,
    )


def _assignment(assignment: dict[str, Any] | None) -> AssignmentOut:
    assignment = assignment or {}
    return AssignmentOut(
        device=assignment.get("device"),
        threads=assignment.get("threads"),
        micro_batch_size=assignment.get("micro_batch_size"),
        accumulation_steps=assignment.get("accumulation_steps"),
        client_mode=assignment.get("client_mode"),
        reachability=assignment.get("reachability"),
        reachability_reason=assignment.get("reachability_reason"),
    )


def _peer_rows(
    db: Session,
    sessions: list[PeerSession],
    *,
    settings: CoordinatorSettings,
    now: float,
) -> list[PeerOut]:
    if not sessions:
        return []
    ids = [s.id for s in sessions]
    run_names = {
        r.id: r.name for r in db.scalars(select(Run).where(Run.id.in_({s.run_id for s in sessions})))
    }
    people = {
        v.id: v
        for v in db.scalars(select(Volunteer).where(Volunteer.id.in_({s.volunteer_id for s in sessions})))
    }
    leases: dict[str, list[Lease]] = {}
    for lease in db.scalars(
        select(Lease)
        .where(Lease.session_id.in_(ids), Lease.state == LeaseState.ACTIVE)
        .order_by(Lease.issued_at)
    ):
        leases.setdefault(lease.session_id, []).append(lease)
    credit = {
        row[0]: (int(row[1] or 0), int(row[2] or 0))
        for row in db.execute(
            select(
                LedgerEntry.session_id,
                func.sum(cast(LedgerEntry.samples, Float)),
                func.sum(case((LedgerEntry.verified, 0.0), else_=cast(LedgerEntry.samples, Float))),
            )
            .where(LedgerEntry.session_id.in_(ids))
            .group_by(LedgerEntry.session_id)
        )
    }
    flag_counts: dict[str, tuple[int, bool]] = {}
    for session_id, count, capping in db.execute(
        select(
            Flag.session_id,
            func.sum(Flag.count),
            func.max(case((Flag.kind.in_(CAPPING_KINDS), 1), else_=0)),
        )
        .where(Flag.session_id.in_(ids))
        .group_by(Flag.session_id)
    ):
        flag_counts[session_id] = (int(count or 0), bool(capping))
    online_after = now - settings.work.session_timeout
    stale_after = now - STALE_INTERVALS * settings.work.heartbeat_interval
    window = settings.credit.progress_record_window
    epochs = {
        run_id: swarm_epoch(db, run_id=run_id, now=now, settings=settings)
        for run_id in {s.run_id for s in sessions}
    }
    rows = []
    for session in sessions:
        volunteer = people.get(session.volunteer_id)
        held = leases.get(session.id, [])
        credited, unverified = credit.get(session.id, (0, 0))
        count, capping = flag_counts.get(session.id, (0, False))
        online = session.state == SessionState.ACTIVE and session.last_heartbeat_at >= online_after
        marks = []
        if capping or session.flagged_heartbeats > 0:
            marks.append("capped")
        unseen = session.dht_seen_at is None or session.dht_seen_at < now - window
        if unverified > 0 or (online and session.created_at < now - window and unseen):
            marks.append("unverified")
        if session.state == SessionState.ACTIVE and session.last_heartbeat_at < stale_after:
            marks.append("stale")
        if session.worker_state == "training" and session.samples_total > 0 and session.loss is None:
            marks.append("nan_loss")
        if online and cut_off(session, epoch=epochs.get(session.run_id), settings=settings):
            marks.append("isolated")
        current = held[0] if held else None
        rows.append(
            PeerOut(
                session_id=session.id,
                run=run_names.get(session.run_id, "?"),
                volunteer=volunteer.name if volunteer else "?",
                volunteer_banned=bool(volunteer and volunteer.banned_at is not None),
                peer_key=peer_key_hint(session.peer_public_key),
                state=session.state,
                worker_state=session.worker_state,
                online=online,
                agent_version=session.agent_version,
                hardware=_hardware(session.profile),
                assignment=_assignment(session.assignment),
                samples_per_second=float(session.samples_per_second or 0.0),
                throughput_cap=float(session.max_samples_per_second),
                samples_total=int(session.samples_total or 0),
                loss=session.loss,
                global_epoch=int(session.global_epoch or 0),
                averaging_rounds=int(session.averaging_rounds or 0),
                bytes_sent=int(session.bytes_sent or 0),
                bytes_received=int(session.bytes_received or 0),
                lease=LeaseBrief(
                    lease_id=current.id,
                    shard=current.shard,
                    data_epoch=current.data_epoch,
                    samples=current.samples,
                    issued_at=current.issued_at,
                    deadline=current.deadline,
                )
                if current is not None
                else None,
                leases_held=len(held),
                credited_samples=credited,
                unverified_samples=unverified,
                created_at=session.created_at,
                last_heartbeat_at=session.last_heartbeat_at,
                token_expires_at=session.token_expires_at,
                swarm_seen_at=session.dht_seen_at,
                flag_count=count,
                flags=marks,
            )
        )
    return rows


def run_peers(
    db: Session, *, run: Run, settings: CoordinatorSettings, now: float, include_ended: bool = False
) -> list[PeerOut]:
    """The run's peers: active and lost sessions (and ended ones when asked), newest first, at most 1000."""
    query = select(PeerSession).where(PeerSession.run_id == run.id)
    if not include_ended:
        query = query.where(PeerSession.state.in_((SessionState.ACTIVE, SessionState.LOST)))
    sessions = list(db.scalars(query.order_by(PeerSession.created_at.desc()).limit(1000)))
    return _peer_rows(db, sessions, settings=settings, now=now)


# ------------------------------------------------------------------------------------------ volunteers
class VolunteerSummary(VolunteerOut):
    """A volunteer in the organizers' list, with its totals over every run."""

    ban_reason: str | None = None
    runs: int = Field(default=0, description="runs joined")
    samples: int = Field(default=0, description="samples credited, verified or not")
    verified_samples: int = 0
    flags: int = Field(default=0, description="flags recorded, all runs")
    online: bool = False


class VolunteerRunOut(BaseModel):
    """A volunteer's part in one run."""

    run: str
    run_state: str
    sessions: int
    active_sessions: int
    samples: int
    verified_samples: int
    compute_seconds: float
    first_joined: float
    last_heartbeat: float
    flags: int


class VolunteerFlag(flag_kinds.FlagOut):
    run: str


class VolunteerDetail(VolunteerSummary):
    """A volunteer's page: who, every run it took part in, its recent sessions and flags."""

    history: list[VolunteerRunOut]
    sessions: list[PeerOut] = Field(description="its 50 newest sessions, every run")
    recent_flags: list[VolunteerFlag] = Field(description="its 50 newest flags, every run")


def volunteer_summaries(db: Session, *, settings: CoordinatorSettings, now: float) -> list[VolunteerSummary]:
    """Every volunteer with its totals (at most 5000, by name)."""
    people = list(db.scalars(select(Volunteer).order_by(Volunteer.name_key).limit(5000)))
    credit = {
        row[0]: (int(row[1] or 0), int(row[2] or 0))
        for row in db.execute(
            select(
                LedgerEntry.volunteer_id,
                func.sum(cast(LedgerEntry.samples, Float)),
                func.sum(case((LedgerEntry.verified, cast(LedgerEntry.samples, Float)), else_=0.0)),
            ).group_by(LedgerEntry.volunteer_id)
        )
    }
    online_after = now - settings.work.session_timeout
    joined: dict[str, tuple[int, bool]] = {}
    for volunteer_id, runs, online in db.execute(
        select(
            PeerSession.volunteer_id,
            func.count(func.distinct(PeerSession.run_id)),
            func.max(
                case(
                    (
                        (PeerSession.state == SessionState.ACTIVE)
                        & (PeerSession.last_heartbeat_at >= online_after),
                        1,
                    ),
                    else_=0,
                )
            ),
        ).group_by(PeerSession.volunteer_id)
    ):
        joined[volunteer_id] = (int(runs or 0), bool(online))
    flagged = {
        row[0]: int(row[1] or 0)
        for row in db.execute(select(Flag.volunteer_id, func.sum(Flag.count)).group_by(Flag.volunteer_id))
    }
    out = []
    for v in people:
        samples, verified = credit.get(v.id, (0, 0))
        runs, online = joined.get(v.id, (0, False))
        out.append(
            VolunteerSummary(
                volunteer_id=v.id,
                name=v.name,
                created_at=v.created_at,
                banned=v.banned_at is not None,
                last_seen=v.last_seen,
                ban_reason=v.ban_reason,
                runs=runs,
                samples=samples,
                verified_samples=verified,
                flags=flagged.get(v.id, 0),
                online=online,
            )
        )
    return out


def volunteer_detail(
    db: Session, *, volunteer: Volunteer, settings: CoordinatorSettings, now: float
) -> VolunteerDetail:
    runs = {r.id: r for r in db.scalars(select(Run))}
    history: dict[str, dict[str, Any]] = {}
    online_after = now - settings.work.session_timeout
    for run_id, count, active, first, last in db.execute(
        select(
            PeerSession.run_id,
            func.count(),
            func.sum(
                case(
                    (
                        (PeerSession.state == SessionState.ACTIVE)
                        & (PeerSession.last_heartbeat_at >= online_after),
                        1,
                    ),
                    else_=0,
                )
            ),
            func.min(PeerSession.created_at),
            func.max(PeerSession.last_heartbeat_at),
        )
        .where(PeerSession.volunteer_id == volunteer.id)
        .group_by(PeerSession.run_id)
    ):
        history[run_id] = {
            "sessions": int(count),
            "active_sessions": int(active or 0),
            "first_joined": float(first),
            "last_heartbeat": float(last),
        }
    credit = {
        row[0]: (int(row[1] or 0), int(row[2] or 0), float(row[3] or 0.0))
        for row in db.execute(
            select(
                LedgerEntry.run_id,
                func.sum(cast(LedgerEntry.samples, Float)),
                func.sum(case((LedgerEntry.verified, cast(LedgerEntry.samples, Float)), else_=0.0)),
                func.sum(LedgerEntry.compute_seconds),
            )
            .where(LedgerEntry.volunteer_id == volunteer.id)
            .group_by(LedgerEntry.run_id)
        )
    }
    flag_totals = {
        row[0]: int(row[1] or 0)
        for row in db.execute(
            select(Flag.run_id, func.sum(Flag.count))
            .where(Flag.volunteer_id == volunteer.id)
            .group_by(Flag.run_id)
        )
    }
    rows = []
    for run_id, part in history.items():
        run = runs.get(run_id)
        if run is None:
            continue
        samples, verified, compute = credit.get(run_id, (0, 0, 0.0))
        rows.append(
            VolunteerRunOut(
                run=run.name,
                run_state=run.state,
                samples=samples,
                verified_samples=verified,
                compute_seconds=compute,
                flags=flag_totals.get(run_id, 0),
                **part,
            )
        )
    rows.sort(key=lambda r: r.last_heartbeat, reverse=True)
    sessions = list(
        db.scalars(
            select(PeerSession)
            .where(PeerSession.volunteer_id == volunteer.id)
            .order_by(PeerSession.created_at.desc())
            .limit(50)
        )
    )
    recent = db.execute(
        select(Flag)
        .where(Flag.volunteer_id == volunteer.id)
        .order_by(Flag.last_at.desc(), Flag.id.desc())
        .limit(50)
    ).scalars()
    total_samples = sum(r.samples for r in rows)
    total_verified = sum(r.verified_samples for r in rows)
    return VolunteerDetail(
        volunteer_id=volunteer.id,
        name=volunteer.name,
        created_at=volunteer.created_at,
        banned=volunteer.banned_at is not None,
        last_seen=volunteer.last_seen,
        ban_reason=volunteer.ban_reason,
        runs=len(rows),
        samples=total_samples,
        verified_samples=total_verified,
        flags=sum(flag_totals.values()),
        online=any(r.active_sessions for r in rows),
        history=rows,
        sessions=_peer_rows(db, sessions, settings=settings, now=now),
        recent_flags=[
            VolunteerFlag(
                **flag_kinds.flag_out(f, volunteer.name).model_dump(),
                run=runs[f.run_id].name if f.run_id in runs else "?",
            )
            for f in recent
        ],
    )

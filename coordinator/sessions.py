"""Peer sessions: join, heartbeat, token refresh, leave, and the sweep that notices silent peers."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_ssh_public_key
from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from coordinator.accounts.authority import Caller, TokenAuthority, new_id
from coordinator.accounts.invites import InviteGuard
from coordinator.accounts.volunteers import run_for_invite_code
from coordinator.credit import flags
from coordinator.credit.ledger import session_rate_cap, settle_claims, swarm_epoch
from coordinator.credit.spotchecks import expire_checks
from coordinator.credit.work import expire_leases, lease_out, return_session_leases, take_lease
from coordinator.errors import Conflict, Forbidden, Invalid, NotFound
from coordinator.models import PeerKey, PeerSession, Revocation, Run, RunMember, Volunteer
from coordinator.reachability import Reachability
from coordinator.retention import prune_sessions, stored_profile
from coordinator.runs import get_run, live_swarm_maddrs, run_config_out
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.assignment import AssignmentError
from volunteer_app.assignment import derive_assignment as assignment_policy
from volunteer_app.protocol import (
    CLIENT,
    Command,
    CoordinatorKey,
    HardwareProfile,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    OptimizerSettings,
    PeerAssignment,
    SessionLeaveResponse,
    TokenRefreshResponse,
)
from volunteer_app.states import RunState, SessionState, WorkerState
from volunteer_app.tokens import PeerToken, hash_secret

# A volunteer's last-seen time is written at most this often (seconds), not on every heartbeat.
_LAST_SEEN_RESOLUTION = 15.0


def check_peer_public_key(text: str) -> str:
    """A worker's hivemind key must be an OpenSSH RSA public key of at least 2048 bits. Returns it in the
    exact form hivemind writes it (``ssh-rsa AAAA…``, no comment), which is what tokens are bound to."""
    try:
        key = load_ssh_public_key(text.encode("utf-8"))
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise Invalid(
            "peer_public_key is not an OpenSSH public key",
            fields={"peer_public_key": f"not an OpenSSH public key: {exc}"},
        ) from exc
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 2048:
        raise Invalid(
            "peer_public_key must be an RSA key of 2048 bits or more",
            fields={"peer_public_key": "must be RSA >= 2048 bits"},
        )
    return key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode("ascii")


def derive_assignment(
    *, profile: HardwareProfile, optimizer: OptimizerSettings, max_threads: int | None, device: str
) -> PeerAssignment:
    """The shared assignment policy (:mod:`volunteer_app.assignment`), with its refusal as a 422."""
    try:
        return assignment_policy(profile=profile, optimizer=optimizer, max_threads=max_threads, device=device)
    except AssignmentError as exc:
        raise Invalid(str(exc), fields={exc.field: "no GPU in profile"}) from exc


# A heartbeat's samples_total may run ahead of rate cap x session age by this much (a worker's first
# accumulation, clock skew) before it is capped.
_SAMPLES_TOTAL_SLACK = 1024


def peer_key_fingerprint(peer_public_key: str) -> str:
    """The id of a worker's key in ``peer_keys``: SHA-256 of its OpenSSH form."""
    return hashlib.sha256(peer_public_key.strip().encode("utf-8")).hexdigest()


def token_hash(token: PeerToken) -> str:
    return hash_secret(token.encode())


def _claim_peer_key(db: Session, *, run: Run, volunteer: Volunteer, peer_public_key: str, now: float) -> None:
    """A peer key belongs to the first volunteer who joins with it, in every run, and stays banned with it.

    Without this a volunteer could join with someone else's key (the swarm's progress records, matched to
    sessions by key, would credit it with their work), or dodge a ban under a new name with the same key.
    """
    fingerprint = peer_key_fingerprint(peer_public_key)
    owned = db.get(PeerKey, fingerprint)
    if owned is None:
        db.add(PeerKey(fingerprint=fingerprint, volunteer_id=volunteer.id, first_used_at=now))
        db.flush()
        return
    if owned.volunteer_id == volunteer.id:
        return
    owner = db.get(Volunteer, owned.volunteer_id)
    flag = {
        "run_id": run.id,
        "volunteer_id": volunteer.id,
        "kind": flags.PEER_KEY_REFUSED,
        "now": now,
    }
    if owner is not None and owner.banned_at is not None:
        raise Forbidden(
            "this peer key belongs to a banned volunteer; it cannot join any run",
            code="peer_key_banned",
            flag={**flag, "detail": f"joined with the peer key of banned volunteer {owner.name!r}"},
        )
    raise Conflict(
        "this peer key belongs to another volunteer; generate a new key",
        code="peer_key_in_use",
        flag={**flag, "detail": f"joined with the peer key of volunteer {owner.name if owner else '?'!r}"},
    )


def _check_membership(
    db: Session,
    *,
    run: Run,
    volunteer: Volunteer,
    invite_code: str | None,
    invite_guard: InviteGuard | None,
    now: float,
) -> None:
    """An invite-only run admits its members, and makes a volunteer with its code one (a wrong code spends
    a guess of the caller's address, ``invite_guard``); open runs admit everyone."""
    if run.visibility != "invite":
        return
    if db.get(RunMember, (run.id, volunteer.id)) is not None:
        return
    if invite_code is None:
        raise Forbidden(f"run {run.name!r} is invite-only; pass its invite code", code="invite_required")
    admitted = run_for_invite_code(db, invite_code, now=now, guard=invite_guard, for_run=run)
    if admitted is None or admitted.id != run.id:
        raise Forbidden(f"that invite code is not valid for run {run.name!r}", code="invalid_invite_code")
    db.add(RunMember(run_id=run.id, volunteer_id=volunteer.id, joined_at=now))


def join(
    db: Session,
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    credential: Caller,
    run_name: str,
    request: JoinRequest,
    invite_guard: InviteGuard | None = None,
    now: float | None = None,
    reachability: Reachability | None = None,
) -> JoinResponse:
    """Admit a worker to a run: a new session with its peer token, assignment and first lease.

    ``reachability`` (the route's dial-back, :mod:`coordinator.reachability`) sets how the worker takes part;
    without it, it is direct unless the profile says the machine accepts no connections (then a client).

    A worker that joins again with its key replaces its previous session (whose leases go back to the
    queue), and the volunteer's older ended sessions in the run are deleted when nothing must keep them
    (``coordinator.retention``), so re-joining cannot grow the store. Only a compact profile is stored.
    """
    now = time.time() if now is None else now
    run = get_run(db, name=run_name)
    if run.state == RunState.FINISHED:
        raise Conflict(f"run {run.name!r} has finished; pick another run", code="run_finished")
    if run.state == RunState.PAUSED:
        raise Conflict(f"run {run.name!r} is paused by its organizers; try again later", code="run_paused")
    volunteer = db.get(Volunteer, credential.volunteer_id)
    assert volunteer is not None  # authenticate() checked it
    _check_membership(
        db,
        run=run,
        volunteer=volunteer,
        invite_code=request.invite_code,
        invite_guard=invite_guard,
        now=now,
    )
    peer_public_key = check_peer_public_key(request.peer_public_key)
    assignment = derive_assignment(
        profile=request.profile,
        optimizer=OptimizerSettings.model_validate(run.optimizer),
        max_threads=request.max_threads,
        device=request.device,
    )
    if reachability is not None:
        assignment = assignment.model_copy(
            update={
                "reachability": reachability.mode,
                "reachability_reason": reachability.reason[:300],
                "client_mode": reachability.mode == CLIENT,
            }
        )
    _claim_peer_key(db, run=run, volunteer=volunteer, peer_public_key=peer_public_key, now=now)
    others = db.scalar(
        select(func.count())
        .select_from(PeerSession)
        .where(
            PeerSession.run_id == run.id,
            PeerSession.volunteer_id == volunteer.id,
            PeerSession.state == SessionState.ACTIVE,
            PeerSession.peer_public_key != peer_public_key,
        )
    )
    if others and others >= settings.work.max_sessions_per_volunteer:
        raise Conflict(
            f"this volunteer already has {others} workers in run {run.name!r}; leave one before joining again",
            code="too_many_sessions",
        )
    # A worker that restarts with the same key replaces its previous session.
    for previous in db.scalars(
        select(PeerSession).where(
            PeerSession.run_id == run.id,
            PeerSession.peer_public_key == peer_public_key,
            PeerSession.state == SessionState.ACTIVE,
        )
    ):
        if previous.volunteer_id != volunteer.id:
            raise Conflict(
                "this peer key belongs to another volunteer's session; generate a new key",
                code="peer_key_in_use",
            )
        previous.state = SessionState.LEFT
        previous.ended_at = now
        return_session_leases(db, session=previous)
    session_id = new_id()
    profile = stored_profile(request.profile)
    token = authority.issue_peer_token(
        run=run.name, volunteer=volunteer.id, session=session_id, peer_public_key=peer_public_key
    )
    session = PeerSession(
        id=session_id,
        run_id=run.id,
        volunteer_id=volunteer.id,
        credential_id=credential.id,
        peer_public_key=peer_public_key,
        agent_version=request.agent_version,
        profile=profile,
        assignment=assignment.model_dump(mode="json"),
        state=SessionState.ACTIVE,
        worker_state="starting",
        created_at=now,
        last_heartbeat_at=now,
        token_expires_at=token.claims.expires_at,
        token_hash=token_hash(token),
        epoch_at_join=swarm_epoch(db, run_id=run.id, now=now, settings=settings),
        max_samples_per_second=session_rate_cap(
            profile=profile, assignment=assignment.model_dump(mode="json"), settings=settings
        ),
    )
    db.add(session)
    volunteer.last_seen = now
    db.flush()
    # overdue leases first, so that a lost session whose lease just expired can go too
    expire_leases(db, run_id=run.id, now=now)
    prune_sessions(db, ended_before=None, run_id=run.id, volunteer_id=volunteer.id, keep=session.id)
    lease = take_lease(db, run=run, session=session, settings=settings, now=now).lease
    return JoinResponse(
        session_id=session.id,
        volunteer_id=volunteer.id,
        peer_token=token.encode(),
        token_expires_at=token.claims.expires_at,
        coordinator_keys=[CoordinatorKey(**record) for record in authority.verifying_keys.records()],
        initial_peers=live_swarm_maddrs(run, now),
        run=run_config_out(run, settings=settings),
        assignment=assignment,
        lease=lease_out(lease) if lease is not None else None,
        heartbeat_interval=settings.work.heartbeat_interval,
    )


def get_session(db: Session, *, credential: Caller, session_id: str) -> PeerSession:
    """The caller's own session; another volunteer's session is reported as missing."""
    session = db.get(PeerSession, session_id)
    if session is None or session.volunteer_id != credential.volunteer_id:
        raise NotFound(f"no session {session_id!r} for this volunteer", code="session_not_found")
    return session


def _is_revoked(db: Session, session: PeerSession) -> bool:
    return db.scalars(select(Revocation).where(Revocation.session_id == session.id)).first() is not None


def _require_live(db: Session, session: PeerSession) -> None:
    if session.state == SessionState.STOPPED or _is_revoked(db, session):
        raise Forbidden("this session was stopped by the organizers", code="session_stopped")
    if session.state == SessionState.LEFT:
        raise Conflict("this session has ended; join again", code="session_ended")


def heartbeat(
    store: Store,
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    credential: Caller,
    session_id: str,
    report: HeartbeatRequest,
    now: float | None = None,
) -> tuple[HeartbeatResponse, str]:
    """Record a worker's progress; answer with commands (pause, resume, stop, new token).

    Heartbeats are the coordinator's hottest write, so everything that only reads happens outside the
    write lock and the write itself is a single UPDATE (two when the volunteer's last-seen time is stale;
    a flag row when the report claimed more than can be checked). Returns the answer and the run's name.
    """
    now = time.time() if now is None else now
    with store.write() as db:
        row = db.execute(
            select(
                PeerSession.volunteer_id,
                PeerSession.state,
                PeerSession.max_samples_per_second,
                PeerSession.paused_by_coordinator,
                PeerSession.token_expires_at,
                PeerSession.peer_public_key,
                PeerSession.created_at,
                PeerSession.dht_epoch,
                PeerSession.epoch_at_join,
                PeerSession.run_id,
                Run.name,
                Run.state,
                Volunteer.last_seen,
                select(Revocation.id).where(Revocation.session_id == PeerSession.id).exists(),
            )
            .join(Run, Run.id == PeerSession.run_id)
            .join(Volunteer, Volunteer.id == PeerSession.volunteer_id)
            .where(PeerSession.id == session_id)
        ).first()
        if row is None or row[0] != credential.volunteer_id:
            raise NotFound(f"no session {session_id!r} for this volunteer", code="session_not_found")
        (
            volunteer_id,
            state,
            max_rate,
            paused_by_coordinator,
            token_expires_at,
            peer_key,
            created_at,
            dht_epoch,
            epoch_at_join,
            run_id,
            run_name,
            run_state,
            last_seen,
            revoked,
        ) = row
        if state == SessionState.STOPPED or revoked:
            raise Forbidden("this session was stopped by the organizers", code="session_stopped")
        if state == SessionState.LEFT:
            raise Conflict("this session has ended; join again", code="session_ended")
        checked, capped = _checked_report(
            report,
            settings=settings,
            max_rate=max_rate,
            age=max(0.0, now - created_at),
            dht_epoch=dht_epoch,
            epoch_at_join=epoch_at_join,
        )
        values, commands = _heartbeat_changes(
            authority=authority,
            settings=settings,
            report=checked,
            now=now,
            session_id=session_id,
            volunteer_id=volunteer_id,
            paused_by_coordinator=paused_by_coordinator,
            token_expires_at=token_expires_at,
            peer_key=peer_key,
            run_name=run_name,
            run_state=run_state,
        )
        if capped:
            values["flagged_heartbeats"] = PeerSession.flagged_heartbeats + 1
            flags.record_flag(
                db,
                run_id=run_id,
                volunteer_id=volunteer_id,
                session_id=session_id,
                kind=flags.HEARTBEAT_CAPPED,
                detail="heartbeat capped: " + "; ".join(capped),
                now=now,
            )
        db.execute(update(PeerSession).where(PeerSession.id == session_id).values(**values))
        if last_seen is None or now - last_seen > _LAST_SEEN_RESOLUTION:
            db.execute(update(Volunteer).where(Volunteer.id == volunteer_id).values(last_seen=now))
    answer = HeartbeatResponse(
        commands=commands,
        run_state=run_state,  # type: ignore[arg-type]
        server_time=now,
        next_heartbeat=settings.work.heartbeat_interval,
    )
    return answer, run_name


def _checked_report(
    report: HeartbeatRequest,
    *,
    settings: CoordinatorSettings,
    max_rate: float,
    age: float,
    dht_epoch: int | None,
    epoch_at_join: int | None,
) -> tuple[HeartbeatRequest, list[str]]:
    """The heartbeat with every figure the coordinator can bound cut to that bound, and what was cut.

    Throughput and samples are bounded by the session's rate cap (device-class ceiling, lowered by its
    benchmark) over its age; epochs and averaging rounds by the swarm's progress records of this peer (its
    epoch as the swarm saw it, or the swarm's epoch when it joined), plus ``epoch_lag_tolerance``.
    """
    capped: list[str] = []
    changes: dict[str, Any] = {}
    if report.samples_per_second > max_rate:
        capped.append(f"{report.samples_per_second:.0f} samples/s above this peer's cap of {max_rate:.0f}")
        changes["samples_per_second"] = max_rate
    sample_cap = int(max_rate * (age + settings.work.heartbeat_interval)) + _SAMPLES_TOTAL_SLACK
    if report.samples_total > sample_cap:
        capped.append(f"samples_total {report.samples_total} above {sample_cap} in {age:.0f}s")
        changes["samples_total"] = sample_cap
    lag = settings.credit.epoch_lag_tolerance
    start = epoch_at_join or 0
    seen = max(start, dht_epoch if dht_epoch is not None else start)
    for name in ("global_epoch", "local_epoch"):
        value = getattr(report, name)
        if value > seen + lag + 1:
            capped.append(f"{name} {value} above the swarm's records ({seen})")
            changes[name] = seen + lag + 1
    rounds_cap = (seen - start) + lag + 1
    if report.averaging_rounds > rounds_cap:
        capped.append(
            f"averaging_rounds {report.averaging_rounds} above the {seen - start} epochs the swarm saw"
        )
        changes["averaging_rounds"] = rounds_cap
    return (report.model_copy(update=changes) if changes else report), capped


def _heartbeat_changes(
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    report: HeartbeatRequest,
    now: float,
    session_id: str,
    volunteer_id: str,
    paused_by_coordinator: bool,
    token_expires_at: float,
    peer_key: str,
    run_name: str,
    run_state: str,
) -> tuple[dict[str, Any], list[Command]]:
    """The session's new column values and the commands for the agent, from one (checked) heartbeat."""
    values: dict[str, Any] = {
        **report.figures(),  # the session's columns of the same names (TrainingFigures)
        "state": SessionState.ACTIVE,  # a session marked lost was only silent for a while
        "last_heartbeat_at": now,
        "worker_state": report.state,
        # a late or replayed heartbeat never moves these back
        "samples_total": case(
            (PeerSession.samples_total < report.samples_total, report.samples_total),
            else_=PeerSession.samples_total,
        ),
        "global_epoch": case(
            (PeerSession.global_epoch < report.global_epoch, report.global_epoch),
            else_=PeerSession.global_epoch,
        ),
    }
    commands: list[Command] = []
    if run_state == RunState.FINISHED:
        commands.append(Command(type="stop", reason=f"run {run_name!r} has finished"))
    elif run_state == RunState.PAUSED:
        if report.state != WorkerState.PAUSED:
            commands.append(Command(type="pause", reason=f"run {run_name!r} was paused by its organizers"))
        values["paused_by_coordinator"] = True
    elif paused_by_coordinator:
        commands.append(Command(type="resume", reason=f"run {run_name!r} was resumed"))
        values["paused_by_coordinator"] = False
    ttl = settings.tokens.peer_token_ttl
    if run_state != RunState.FINISHED and token_expires_at - now < ttl * (
        1.0 - settings.tokens.refresh_fraction
    ):
        token = authority.issue_peer_token(
            run=run_name, volunteer=volunteer_id, session=session_id, peer_public_key=peer_key
        )
        values["token_expires_at"] = token.claims.expires_at
        values["token_hash"] = token_hash(token)
        commands.append(
            Command(type="new_token", peer_token=token.encode(), expires_at=token.claims.expires_at)
        )
    return values, commands


def refresh_token(
    db: Session, *, authority: TokenAuthority, session: PeerSession, presented: str
) -> TokenRefreshResponse:
    """Trade the session's current peer token for a new one (proof that the caller holds it).

    Only the newest token of a session can be traded, once: the answer's token replaces it, so a copied
    old token cannot be exchanged again and again.
    """
    _require_live(db, session)
    run = db.get(Run, session.run_id)
    assert run is not None
    authority.check_presented_peer_token(
        presented,
        run=run.name,
        session=session.id,
        peer_public_key=session.peer_public_key,
        revoked=_is_revoked(db, session),
        current_hash=session.token_hash,
    )
    if run.state == RunState.FINISHED:
        raise Conflict(f"run {run.name!r} has finished", code="run_finished")
    token = authority.issue_peer_token(
        run=run.name,
        volunteer=session.volunteer_id,
        session=session.id,
        peer_public_key=session.peer_public_key,
    )
    session.token_expires_at = token.claims.expires_at
    session.token_hash = token_hash(token)
    return TokenRefreshResponse(peer_token=token.encode(), expires_at=token.claims.expires_at)


def leave(db: Session, *, session: PeerSession, now: float | None = None) -> SessionLeaveResponse:
    """End a session on purpose; its unfinished leases go back to the queue at once. Idempotent."""
    returned = 0
    if session.state in (SessionState.ACTIVE, SessionState.LOST):
        session.state = SessionState.LEFT
        session.ended_at = time.time() if now is None else now
        returned = return_session_leases(db, session=session)
    return SessionLeaveResponse(session_id=session.id, state=session.state, leases_returned=returned)


@dataclass(frozen=True)
class SweepResult:
    lost: int
    expired: int
    verified: int
    requeued: int
    checks_expired: int
    pruned: int = 0
    """Ended sessions deleted (``coordinator.retention``)."""

    def __bool__(self) -> bool:
        return any((self.lost, self.expired, self.verified, self.requeued, self.checks_expired, self.pruned))


def sweep(db: Session, *, settings: CoordinatorSettings, now: float | None = None) -> SweepResult:
    """Mark silent sessions lost, expire overdue leases, settle claims the swarm has confirmed since (or
    re-queue those it never did), expire spot checks nobody decided, and delete sessions that ended more
    than ``work.ended_session_retention`` ago and that nothing must keep (a batch per sweep)."""
    now = time.time() if now is None else now
    lost = 0
    for session in db.scalars(
        select(PeerSession).where(
            PeerSession.state == SessionState.ACTIVE,
            PeerSession.last_heartbeat_at < now - settings.work.session_timeout,
        )
    ):
        session.state = SessionState.LOST
        lost += 1
    expired = expire_leases(db, now=now)
    verified, requeued = settle_claims(db, settings=settings, now=now)
    checks_expired = expire_checks(db, now=now, settings=settings)
    pruned = prune_sessions(db, ended_before=now - settings.work.ended_session_retention)
    return SweepResult(lost, expired, verified, requeued, checks_expired, pruned)

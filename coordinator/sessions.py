"""Peer sessions: join, heartbeat, token refresh, leave, and the sweep that notices silent peers."""

from __future__ import annotations

import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_ssh_public_key
from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from coordinator.authority import Caller, TokenAuthority, new_id
from coordinator.errors import Conflict, Forbidden, Invalid, NotFound
from coordinator.models import PeerSession, Revocation, Run, RunMember, Volunteer
from coordinator.runs import get_run, live_swarm_maddrs, run_config_out
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from coordinator.volunteers import run_for_invite_code
from coordinator.work import expire_leases, lease_out, return_session_leases, take_lease
from volunteer_app.protocol import (
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

# A volunteer's last-seen time is written at most this often (seconds), not on every heartbeat.
_LAST_SEEN_RESOLUTION = 15.0
# Below this many bytes of GPU memory, keep optimizer state in host memory (offload) to fit the model.
_SMALL_GPU_BYTES = 6 * 1024**3
# A CPU peer calls Optimizer.step about once per this many samples: each call writes a signed progress
# record to the DHT, so batching micro-batches saves helper-process CPU (measured: 0.67 -> 0.81 efficiency).
_CPU_SAMPLES_PER_STEP = 64


def check_peer_public_key(text: str) -> str:
    """A worker's hivemind key must be an OpenSSH RSA public key of at least 2048 bits. Returns it in the
    exact form hivemind writes it (``ssh-rsa AAAA…``, no comment), which is what tokens are bound to."""
    try:
        key = load_ssh_public_key(text.encode("utf-8"))
    except (ValueError, TypeError) as exc:
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
    """Per-peer settings from the profile and the volunteer's limits.

    CPU peers: one thread per physical core up to the volunteer's limit, micro-batches accumulated to
    about 64 samples per optimizer step, optimizer on the same device, no delayed step (a background
    step would steal the cores that train). GPU peers: AMP, delayed optimizer step and gradient averaging
    overlapped with compute, optimizer state offloaded to host memory on small GPUs.
    """
    has_gpu = bool(profile.gpus)
    if device == "cuda" and not has_gpu:
        raise Invalid(
            "device 'cuda' was asked for but the profile lists no NVIDIA GPU",
            fields={"device": "no GPU in profile"},
        )
    use_gpu = has_gpu and device in ("auto", "cuda")
    threads = profile.cpu_cores
    if max_threads is not None:
        threads = min(threads, max_threads)
    threads = max(1, threads)
    benchmark = profile.benchmark
    if benchmark is not None and benchmark.device == ("cuda" if use_gpu else "cpu"):
        micro_batch = benchmark.micro_batch_size
    else:
        micro_batch = 64 if use_gpu else 16
    if use_gpu:
        memory = min(g.memory_bytes for g in profile.gpus)
        return PeerAssignment(
            device="cuda",
            threads=min(threads, 2),
            micro_batch_size=micro_batch,
            accumulation_steps=1,
            client_mode=profile.accepts_connections is False,
            amp=True,
            offload_optimizer=memory < _SMALL_GPU_BYTES,
            delay_optimizer_step=not optimizer.use_local_updates,
        )
    return PeerAssignment(
        device="cpu",
        threads=threads,
        micro_batch_size=micro_batch,
        accumulation_steps=max(1, _CPU_SAMPLES_PER_STEP // micro_batch),
        client_mode=profile.accepts_connections is False,
        amp=False,
        offload_optimizer=False,
        delay_optimizer_step=False,
    )


def max_samples_per_second(profile: HardwareProfile, settings: CoordinatorSettings) -> float:
    if profile.benchmark is not None and profile.benchmark.samples_per_second > 0:
        return profile.benchmark.samples_per_second * settings.credit.throughput_tolerance
    return settings.credit.unprofiled_max_samples_per_second


def _check_membership(db: Session, *, run: Run, volunteer: Volunteer, invite_code: str | None) -> None:
    if run.visibility != "invite":
        return
    if db.get(RunMember, (run.id, volunteer.id)) is not None:
        return
    if invite_code is None:
        raise Forbidden(f"run {run.name!r} is invite-only; pass its invite code", code="invite_required")
    if run_for_invite_code(db, invite_code) is not run:
        raise Forbidden(f"that invite code is not valid for run {run.name!r}", code="invalid_invite_code")
    db.add(RunMember(run_id=run.id, volunteer_id=volunteer.id, joined_at=time.time()))


def join(
    db: Session,
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    credential: Caller,
    run_name: str,
    request: JoinRequest,
) -> JoinResponse:
    run = get_run(db, name=run_name)
    if run.state == "finished":
        raise Conflict(f"run {run.name!r} has finished; pick another run", code="run_finished")
    if run.state == "paused":
        raise Conflict(f"run {run.name!r} is paused by its organizers; try again later", code="run_paused")
    volunteer = db.get(Volunteer, credential.volunteer_id)
    assert volunteer is not None  # authenticate() checked it
    _check_membership(db, run=run, volunteer=volunteer, invite_code=request.invite_code)
    peer_public_key = check_peer_public_key(request.peer_public_key)
    assignment = derive_assignment(
        profile=request.profile,
        optimizer=OptimizerSettings.model_validate(run.optimizer),
        max_threads=request.max_threads,
        device=request.device,
    )
    now = time.time()
    # A worker that restarts with the same key replaces its previous session.
    for previous in db.scalars(
        select(PeerSession).where(
            PeerSession.run_id == run.id,
            PeerSession.peer_public_key == peer_public_key,
            PeerSession.state == "active",
        )
    ):
        if previous.volunteer_id != volunteer.id:
            raise Conflict(
                "this peer key belongs to another volunteer's session; generate a new key",
                code="peer_key_in_use",
            )
        previous.state = "left"
        previous.ended_at = now
        return_session_leases(db, session=previous)
    session_id = new_id()
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
        profile=request.profile.model_dump(mode="json"),
        assignment=assignment.model_dump(mode="json"),
        state="active",
        worker_state="starting",
        created_at=now,
        last_heartbeat_at=now,
        token_expires_at=token.claims.expires_at,
        max_samples_per_second=max_samples_per_second(request.profile, settings),
    )
    db.add(session)
    volunteer.last_seen = now
    db.flush()
    lease, _retry = take_lease(db, run=run, session=session, settings=settings)
    return JoinResponse(
        session_id=session.id,
        volunteer_id=volunteer.id,
        peer_token=token.encode(),
        token_expires_at=token.claims.expires_at,
        coordinator_keys=[CoordinatorKey(**record) for record in authority.verifying_keys.records()],
        initial_peers=live_swarm_maddrs(run, now),
        run=run_config_out(run),
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
    if session.state == "stopped" or _is_revoked(db, session):
        raise Forbidden("this session was stopped by the organizers", code="session_stopped")
    if session.state == "left":
        raise Conflict("this session has ended; join again", code="session_ended")


def heartbeat(
    store: Store,
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    credential: Caller,
    session_id: str,
    report: HeartbeatRequest,
) -> tuple[HeartbeatResponse, str]:
    """Record a worker's progress; answer with commands (pause, resume, stop, new token).

    Heartbeats are the coordinator's hottest write, so everything that only reads happens outside the
    write lock and the write itself is a single UPDATE (two when the volunteer's last-seen time is stale).
    Returns the answer and the run's name.
    """
    now = time.time()
    with store.write() as db:
        row = db.execute(
            select(
                PeerSession.volunteer_id,
                PeerSession.state,
                PeerSession.max_samples_per_second,
                PeerSession.paused_by_coordinator,
                PeerSession.token_expires_at,
                PeerSession.peer_public_key,
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
            run_name,
            run_state,
            last_seen,
            revoked,
        ) = row
        if state == "stopped" or revoked:
            raise Forbidden("this session was stopped by the organizers", code="session_stopped")
        if state == "left":
            raise Conflict("this session has ended; join again", code="session_ended")
        values, commands = _heartbeat_changes(
            authority=authority,
            settings=settings,
            report=report,
            now=now,
            session_id=session_id,
            volunteer_id=volunteer_id,
            max_rate=max_rate,
            paused_by_coordinator=paused_by_coordinator,
            token_expires_at=token_expires_at,
            peer_key=peer_key,
            run_name=run_name,
            run_state=run_state,
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


def _heartbeat_changes(
    *,
    authority: TokenAuthority,
    settings: CoordinatorSettings,
    report: HeartbeatRequest,
    now: float,
    session_id: str,
    volunteer_id: str,
    max_rate: float,
    paused_by_coordinator: bool,
    token_expires_at: float,
    peer_key: str,
    run_name: str,
    run_state: str,
) -> tuple[dict[str, Any], list[Command]]:
    """The session's new column values and the commands for the agent, from one heartbeat."""
    values: dict[str, Any] = {
        "state": "active",  # a session marked lost was only silent for a while
        "last_heartbeat_at": now,
        "worker_state": report.state,
        "samples_per_second": min(report.samples_per_second, max_rate),
        "samples_total": case(
            (PeerSession.samples_total < report.samples_total, report.samples_total),
            else_=PeerSession.samples_total,
        ),
        "loss": report.loss,
        "local_epoch": report.local_epoch,
        "global_epoch": case(
            (PeerSession.global_epoch < report.global_epoch, report.global_epoch),
            else_=PeerSession.global_epoch,
        ),
        "swarm_size": report.swarm_size,
        "averaging_rounds": report.averaging_rounds,
        "bytes_sent": report.bytes_sent,
        "bytes_received": report.bytes_received,
    }
    if report.samples_per_second > max_rate:
        values["flagged_heartbeats"] = PeerSession.flagged_heartbeats + 1
    commands: list[Command] = []
    if run_state == "finished":
        commands.append(Command(type="stop", reason=f"run {run_name!r} has finished"))
    elif run_state == "paused":
        if report.state != "paused":
            commands.append(Command(type="pause", reason=f"run {run_name!r} was paused by its organizers"))
        values["paused_by_coordinator"] = True
    elif paused_by_coordinator:
        commands.append(Command(type="resume", reason=f"run {run_name!r} was resumed"))
        values["paused_by_coordinator"] = False
    ttl = settings.tokens.peer_token_ttl
    if run_state != "finished" and token_expires_at - now < ttl * (1.0 - settings.tokens.refresh_fraction):
        token = authority.issue_peer_token(
            run=run_name, volunteer=volunteer_id, session=session_id, peer_public_key=peer_key
        )
        values["token_expires_at"] = token.claims.expires_at
        commands.append(
            Command(type="new_token", peer_token=token.encode(), expires_at=token.claims.expires_at)
        )
    return values, commands


def refresh_token(
    db: Session, *, authority: TokenAuthority, session: PeerSession, presented: str
) -> TokenRefreshResponse:
    """Trade the session's current peer token for a new one (proof that the caller holds it)."""
    _require_live(db, session)
    run = db.get(Run, session.run_id)
    assert run is not None
    authority.check_presented_peer_token(
        presented,
        run=run.name,
        session=session.id,
        peer_public_key=session.peer_public_key,
        revoked=_is_revoked(db, session),
    )
    if run.state == "finished":
        raise Conflict(f"run {run.name!r} has finished", code="run_finished")
    token = authority.issue_peer_token(
        run=run.name,
        volunteer=session.volunteer_id,
        session=session.id,
        peer_public_key=session.peer_public_key,
    )
    session.token_expires_at = token.claims.expires_at
    return TokenRefreshResponse(peer_token=token.encode(), expires_at=token.claims.expires_at)


def leave(db: Session, *, session: PeerSession) -> SessionLeaveResponse:
    """End a session on purpose; its unfinished leases go back to the queue at once. Idempotent."""
    returned = 0
    if session.state in ("active", "lost"):
        session.state = "left"
        session.ended_at = time.time()
        returned = return_session_leases(db, session=session)
    return SessionLeaveResponse(session_id=session.id, state=session.state, leases_returned=returned)


def sweep(db: Session, *, settings: CoordinatorSettings) -> tuple[int, int]:
    """Mark silent sessions lost and expire overdue leases. Returns (sessions lost, leases expired)."""
    now = time.time()
    lost = 0
    for session in db.scalars(
        select(PeerSession).where(
            PeerSession.state == "active", PeerSession.last_heartbeat_at < now - settings.work.session_timeout
        )
    ):
        session.state = "lost"
        lost += 1
    return lost, expire_leases(db, now=now)

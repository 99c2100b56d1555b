"""Volunteers: registration (open, or by a run's invite code), listing and banning."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.accounts import invites
from coordinator.accounts.authority import TokenAuthority, new_id
from coordinator.credit.work import return_session_leases
from coordinator.errors import Conflict, Forbidden, NotFound
from coordinator.models import (
    Credential,
    PeerSession,
    Revocation,
    Run,
    RunMember,
    Volunteer,
    volunteer_name_key,
)
from volunteer_app.protocol import RegisterRequest, RegisterResponse, VolunteerOut
from volunteer_app.states import SessionState


def run_for_invite_code(
    db: Session,
    code: str,
    *,
    now: float | None = None,
    guard: invites.InviteGuard | None = None,
    for_run: Run | None = None,
) -> Run | None:
    """The open run an invite code admits to (the code made with the run, or one the organizers added
    later, counting its use), or None for an unknown, revoked or used-up code
    (``coordinator.accounts.invites``).

    With a ``guard`` (every API request has one) a wrong code, or one for another run than ``for_run``,
    spends one of the caller's address's guesses, and a spent budget refuses any code with 429."""
    now = time.time() if now is None else now
    if guard is None:
        return invites.redeem(db, code, now=now)
    return guard.redeem(db, code, now=now, for_run=for_run)


def register(
    db: Session,
    *,
    request: RegisterRequest,
    invite_guard: invites.InviteGuard | None = None,
    now: float | None = None,
) -> RegisterResponse:
    """Create a volunteer and its credential. An invite code also admits it to that invite-only run; a wrong
    one spends a guess of the caller's address (``invite_guard``)."""
    key = volunteer_name_key(request.name)
    taken = db.scalars(select(Volunteer).where(Volunteer.name_key == key)).first()
    if taken is not None:
        same = "is taken" if taken.name == request.name else f"is too close to the taken name {taken.name!r}"
        raise Conflict(
            f"the name {request.name!r} {same} (names differing only in case are one name); pick another",
            code="name_taken",
        )
    now = time.time() if now is None else now
    run = None
    if request.invite_code is not None:
        run = run_for_invite_code(db, request.invite_code, now=now, guard=invite_guard)
        if run is None:
            raise Forbidden("that invite code does not match any open run", code="invalid_invite_code")
    volunteer = Volunteer(id=new_id(), name=request.name, name_key=key, created_at=now)
    db.add(volunteer)
    db.flush()
    if run is not None:
        db.add(RunMember(run_id=run.id, volunteer_id=volunteer.id, joined_at=now))
    secret = TokenAuthority.new_volunteer_credential(db, volunteer_id=volunteer.id)
    return RegisterResponse(volunteer_id=volunteer.id, name=volunteer.name, credential=secret)


def volunteer_out(volunteer: Volunteer) -> VolunteerOut:
    return VolunteerOut(
        volunteer_id=volunteer.id,
        name=volunteer.name,
        created_at=volunteer.created_at,
        banned=volunteer.banned_at is not None,
        last_seen=volunteer.last_seen,
    )


def list_volunteers(db: Session) -> list[Volunteer]:
    return list(db.scalars(select(Volunteer).order_by(Volunteer.created_at)))


def get_volunteer(db: Session, *, name: str) -> Volunteer:
    volunteer = db.scalars(select(Volunteer).where(Volunteer.name == name)).first()
    if volunteer is None:  # the organizers may type "Ada" for "ada"
        volunteer = db.scalars(
            select(Volunteer).where(Volunteer.name_key == volunteer_name_key(name))
        ).first()
    if volunteer is None:
        raise NotFound(f"no volunteer named {name!r}", code="volunteer_not_found")
    return volunteer


def ban(db: Session, *, name: str, reason: str) -> tuple[Volunteer, int]:
    """Ban a volunteer: its credentials stop working at once, its sessions stop and their peer tokens are
    revoked (the swarm peers publish the revocation in the DHT). Returns the volunteer and how many
    sessions were revoked. Banning twice is harmless."""
    volunteer = get_volunteer(db, name=name)
    now = time.time()
    if volunteer.banned_at is None:
        volunteer.banned_at = now
        volunteer.ban_reason = reason
    for credential in db.scalars(
        select(Credential).where(Credential.volunteer_id == volunteer.id, Credential.revoked_at.is_(None))
    ):
        credential.revoked_at = now
    revoked = 0
    sessions = db.scalars(select(PeerSession).where(PeerSession.volunteer_id == volunteer.id))
    for session in sessions:
        if session.token_expires_at < now:
            continue
        if db.scalars(select(Revocation).where(Revocation.session_id == session.id)).first() is None:
            db.add(
                Revocation(
                    run_id=session.run_id,
                    volunteer_id=volunteer.id,
                    session_id=session.id,
                    reason=reason,
                    created_at=now,
                    expires_at=session.token_expires_at,
                )
            )
            revoked += 1
        if session.state == SessionState.ACTIVE:
            session.state = SessionState.STOPPED
            session.ended_at = now
            return_session_leases(db, session=session)
    return volunteer, revoked


def unban(db: Session, *, name: str) -> Volunteer:
    """Lift a ban: the credentials the ban revoked work again, and the volunteer's peer keys may join again.
    The sessions the ban stopped stay stopped (the agent joins anew). Unbanning someone not banned is harmless.
    """
    volunteer = get_volunteer(db, name=name)
    if volunteer.banned_at is None:
        return volunteer
    # ban() revokes every live credential at the ban's own timestamp; credentials revoked before stay revoked
    for credential in db.scalars(
        select(Credential).where(
            Credential.volunteer_id == volunteer.id, Credential.revoked_at == volunteer.banned_at
        )
    ):
        credential.revoked_at = None
    volunteer.banned_at = None
    volunteer.ban_reason = None
    return volunteer


def revoked_sessions(db: Session, *, run_id: str, now: float | None = None) -> list[Revocation]:
    """Revocations of a run whose tokens could still be valid."""
    now = time.time() if now is None else now
    return list(
        db.scalars(select(Revocation).where(Revocation.run_id == run_id, Revocation.expires_at >= now))
    )

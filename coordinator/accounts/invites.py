"""Invite codes: how volunteers get into an invite-only run.

A run made with ``visibility: invite`` has the code it was made with (``runs.invite_code_hash``, shown once
at creation); organizers add more codes (one per group, a single-use code per person, ...) and revoke any
of them, from the dashboard or ``POST /api/v1/runs/{name}/invites``. Registering or joining with a code
admits the volunteer to its run for good: revoking a code stops new admissions, never removes members.
Codes are stored as hashes; each keeps its first characters (``hint``) so organizers can tell them apart.

Guessing is bounded per client address, not per credential (credentials are free): every wrong code an
address presents, at registration or join, over all its credentials and runs, spends one of
``limits.invite_guesses`` per ``limits.invite_guess_window`` (:class:`InviteGuard`); once they are spent,
every code from that address is refused with 429 until the window ends. Generated codes carry 120 random
bits; a code an organizer picks must be long enough that this budget cannot find it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.accounts.authority import new_id
from coordinator.accounts.limits import GuessLimiter
from coordinator.errors import Conflict, NotFound
from coordinator.models import InviteCode, Run
from coordinator.settings import LimitSettings
from volunteer_app.states import RunState
from volunteer_app.tokens import hash_secret, new_secret

RUN_CODE_ID = "run"
"""The id under which the code a run was made with is listed (it lives on the run itself)."""
_HINT = 8
_GENERATED_LENGTH = 24
"""A generated code: ``inv_`` and 20 URL-safe base64 characters, 120 random bits."""


class InviteCreate(BaseModel):
    model_config = {"extra": "forbid"}

    label: str = Field(default="", max_length=100, description="who the code is for (shown to organizers)")
    max_uses: int | None = Field(
        default=None, ge=1, le=1_000_000, description="admissions allowed with it (none: no limit)"
    )


class InviteOut(BaseModel):
    invite_id: str
    hint: str = Field(description="the code's first characters")
    label: str
    uses: int
    max_uses: int | None
    created_at: float | None
    last_used_at: float | None
    revoked: bool
    usable: bool = Field(description="not revoked, not used up, and its run not finished")


class InviteCreated(InviteOut):
    code: str = Field(description="the invite code, shown once")


def _out(invite: InviteCode, run: Run) -> InviteOut:
    used_up = invite.max_uses is not None and invite.uses >= invite.max_uses
    return InviteOut(
        invite_id=invite.id,
        hint=invite.hint,
        label=invite.label,
        uses=invite.uses,
        max_uses=invite.max_uses,
        created_at=invite.created_at,
        last_used_at=invite.last_used_at,
        revoked=invite.revoked_at is not None,
        usable=invite.revoked_at is None and not used_up and run.state != RunState.FINISHED,
    )


def _run_code_out(run: Run) -> InviteOut:
    return InviteOut(
        invite_id=RUN_CODE_ID,
        hint="",
        label="made with the run",
        uses=0,
        max_uses=None,
        created_at=run.created_at,
        last_used_at=None,
        revoked=False,
        usable=run.state != RunState.FINISHED,
    )


def list_invites(db: Session, *, run: Run) -> list[InviteOut]:
    """The run's codes, newest first; the code it was made with (while not revoked) last."""
    rows = db.scalars(
        select(InviteCode).where(InviteCode.run_id == run.id).order_by(InviteCode.created_at.desc())
    )
    listed = [_out(invite, run) for invite in rows]
    if run.invite_code_hash is not None:
        listed.append(_run_code_out(run))
    return listed


def create_invite(db: Session, *, run: Run, request: InviteCreate, now: float) -> InviteCreated:
    if run.state == RunState.FINISHED:
        raise Conflict(f"run {run.name!r} has finished; it takes no new volunteers", code="run_finished")
    code = new_secret("inv")[:_GENERATED_LENGTH]
    invite = InviteCode(
        id=new_id(),
        run_id=run.id,
        code_hash=hash_secret(code),
        hint=code[:_HINT],
        label=request.label.strip(),
        max_uses=request.max_uses,
        uses=0,
        created_at=now,
    )
    db.add(invite)
    db.flush()
    return InviteCreated(**_out(invite, run).model_dump(), code=code)


def revoke_invite(db: Session, *, run: Run, invite_id: str, now: float) -> InviteOut:
    """Stop a code from admitting anyone new (idempotent)."""
    if invite_id == RUN_CODE_ID:
        if run.invite_code_hash is None:
            raise NotFound(f"run {run.name!r} has no code of its own any more", code="invite_not_found")
        run.invite_code_hash = None
        out = _run_code_out(run)
        return out.model_copy(update={"revoked": True, "usable": False})
    invite = db.get(InviteCode, invite_id)
    if invite is None or invite.run_id != run.id:
        raise NotFound(f"run {run.name!r} has no invite {invite_id!r}", code="invite_not_found")
    if invite.revoked_at is None:
        invite.revoked_at = now
    return _out(invite, run)


def redeem(db: Session, code: str, *, now: float) -> Run | None:
    """The open run a code admits to, counting the use; None for an unknown, revoked or used-up code."""
    digest = hash_secret(code)
    run = db.scalars(
        select(Run).where(Run.invite_code_hash == digest, Run.state != RunState.FINISHED)
    ).first()
    if run is not None:
        return run
    invite = db.scalars(select(InviteCode).where(InviteCode.code_hash == digest)).first()
    if invite is None or invite.revoked_at is not None:
        return None
    if invite.max_uses is not None and invite.uses >= invite.max_uses:
        return None
    run = db.get(Run, invite.run_id)
    if run is None or run.state == RunState.FINISHED:
        return None
    invite.uses += 1
    invite.last_used_at = now
    return run


@dataclass(frozen=True)
class InviteGuard:
    """One client address's budget of wrong invite codes, as the services that check codes use it.

    Built per request by the API (``coordinator.api.deps``) from the caller's address; code that checks a
    code without a guard (the CLI, tests of the services) is not limited.
    """

    guesses: GuessLimiter
    address: str
    limits: LimitSettings

    def redeem(self, db: Session, code: str, *, now: float, for_run: Run | None = None) -> Run | None:
        """:func:`redeem`, counted against the address's budget: a code that admits to no open run (or not to
        ``for_run``) spends a guess; a right one spends none. Raises ``RateLimited`` (429, Retry-After)
        before looking at the code when the budget is spent, so a right code is refused too until the
        window ends."""
        self.guesses.take(
            self.address,
            budget=self.limits.invite_guesses,
            window=self.limits.invite_guess_window,
            what="invite codes",
        )
        run = redeem(db, code, now=now)
        if run is not None and (for_run is None or run.id == for_run.id):
            self.guesses.refund(self.address)
        return run

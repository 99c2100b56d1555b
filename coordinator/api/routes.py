"""Routes of ``/api/v1``. Each parses, calls one service function in a unit of work, returns a schema."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect, status
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from coordinator import ledger, runs, sessions, volunteers, work
from coordinator.api.deps import OrganizerCredential, Res, VolunteerCredential, client_address
from coordinator.models import Run
from volunteer_app import __version__
from volunteer_app.protocol import (
    HealthOut,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    Leaderboard,
    LeaseCompleteRequest,
    LeaseCompleteResponse,
    LeaseTakeResponse,
    RegisterRequest,
    RegisterResponse,
    RunCreate,
    RunOut,
    SessionLeaveResponse,
    TokenRefreshRequest,
    TokenRefreshResponse,
    VolunteerOut,
)

router = APIRouter(prefix="/api/v1")


class RunCreated(RunOut):
    invite_code: str | None = Field(default=None, description="the generated invite code, shown once")


class BanRequest(BaseModel):
    reason: str = Field(default="banned by the organizers", max_length=500)


class BanResponse(VolunteerOut):
    sessions_revoked: int


# ------------------------------------------------------------------------------------------ public
@router.get("/health", tags=["public"])
def health(res: Res) -> HealthOut:
    with res.store.read() as db:
        active = db.scalar(select(func.count()).select_from(Run).where(Run.state == "active")) or 0
    return HealthOut(status="ok", version=__version__, database=res.store.dialect, runs_active=active)


@router.get("/time", tags=["public"])
def server_time() -> dict[str, float]:
    """The server clock. Agents compare it with theirs: hivemind refuses peers whose clocks differ by a minute."""
    return {"server_time": time.time()}


@router.get("/runs", tags=["public"])
def list_runs(res: Res) -> list[RunOut]:
    with res.store.read() as db:
        return [runs.run_out(db, run=run, settings=res.settings) for run in runs.list_runs(db)]


@router.get("/runs/{name}", tags=["public"])
def get_run(name: str, res: Res) -> RunOut:
    with res.store.read() as db:
        return runs.run_out(db, run=runs.get_run(db, name=name), settings=res.settings)


@router.get("/runs/{name}/leaderboard", tags=["public"])
def run_leaderboard(name: str, res: Res) -> Leaderboard:
    with res.store.read() as db:
        return ledger.leaderboard(db, settings=res.settings, run=runs.get_run(db, name=name))


@router.get("/leaderboard", tags=["public"])
def overall_leaderboard(res: Res) -> Leaderboard:
    with res.store.read() as db:
        return ledger.leaderboard(db, settings=res.settings)


@router.post("/volunteers", status_code=status.HTTP_201_CREATED, tags=["volunteers"])
def register(body: RegisterRequest, request: Request, res: Res) -> RegisterResponse:
    res.limiter.check("register", client_address(request), per_minute=res.settings.limits.register_per_minute)
    with res.store.write() as db:
        return volunteers.register(db, request=body)


# ------------------------------------------------------------------------------------------ volunteers
@router.post("/runs/{name}/join", tags=["volunteers"])
def join(name: str, body: JoinRequest, credential: VolunteerCredential, res: Res) -> JoinResponse:
    res.limiter.check("join", credential.id, per_minute=res.settings.limits.join_per_minute)
    with res.store.write() as db:
        answer = sessions.join(
            db,
            authority=res.authority,
            settings=res.settings,
            credential=credential,
            run_name=name,
            request=body,
        )
    res.hub.mark_dirty(name)
    return answer


@router.post("/sessions/{session_id}/heartbeat", tags=["volunteers"])
def heartbeat(
    session_id: str, body: HeartbeatRequest, credential: VolunteerCredential, res: Res
) -> HeartbeatResponse:
    res.limiter.check("heartbeat", credential.id, per_minute=res.settings.limits.heartbeat_per_minute)
    answer, run_name = sessions.heartbeat(
        res.store,
        authority=res.authority,
        settings=res.settings,
        credential=credential,
        session_id=session_id,
        report=body,
    )
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/token", tags=["volunteers"])
def refresh_token(
    session_id: str, body: TokenRefreshRequest, credential: VolunteerCredential, res: Res
) -> TokenRefreshResponse:
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        return sessions.refresh_token(db, authority=res.authority, session=session, presented=body.peer_token)


@router.post("/sessions/{session_id}/leases", tags=["volunteers"])
def take_lease(session_id: str, credential: VolunteerCredential, res: Res) -> LeaseTakeResponse:
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        run = db.get(Run, session.run_id)
        assert run is not None
        lease, retry = work.take_lease(db, run=run, session=session, settings=res.settings)
        answer = LeaseTakeResponse(
            lease=work.lease_out(lease) if lease is not None else None,
            retry_after=retry,
            run_state=run.state,  # type: ignore[arg-type]
        )
        run_name = run.name
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/leases/{lease_id}/complete", tags=["volunteers"])
def complete_lease(
    session_id: str, lease_id: str, body: LeaseCompleteRequest, credential: VolunteerCredential, res: Res
) -> LeaseCompleteResponse:
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        answer = work.complete_lease(
            db, session=session, lease_id=lease_id, report=body, settings=res.settings
        )
        run_name = db.get(Run, session.run_id).name  # type: ignore[union-attr]
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/leave", tags=["volunteers"])
def leave(session_id: str, credential: VolunteerCredential, res: Res) -> SessionLeaveResponse:
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        answer = sessions.leave(db, session=session)
        run_name = db.get(Run, session.run_id).name  # type: ignore[union-attr]
    res.hub.mark_dirty(run_name)
    return answer


# ------------------------------------------------------------------------------------------ organizers
@router.post("/runs", status_code=status.HTTP_201_CREATED, tags=["organizers"])
def create_run(body: RunCreate, _: OrganizerCredential, res: Res) -> RunCreated:
    with res.store.write() as db:
        run, invite_code = runs.create_run(db, settings=res.settings, request=body)
        out = runs.run_out(db, run=run, settings=res.settings)
    return RunCreated(**out.model_dump(), invite_code=invite_code)


def _set_state(name: str, state: str, res: Res) -> RunOut:
    with res.store.write() as db:
        run = runs.set_run_state(db, name=name, state=state)
        out = runs.run_out(db, run=run, settings=res.settings)
    res.hub.mark_dirty(name)
    return out


@router.post("/runs/{name}/pause", tags=["organizers"])
def pause_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, "paused", res)


@router.post("/runs/{name}/resume", tags=["organizers"])
def resume_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, "active", res)


@router.post("/runs/{name}/finish", tags=["organizers"])
def finish_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, "finished", res)


@router.get("/volunteers", tags=["organizers"])
def list_volunteers(_: OrganizerCredential, res: Res) -> list[VolunteerOut]:
    with res.store.read() as db:
        return [volunteers.volunteer_out(v) for v in volunteers.list_volunteers(db)]


@router.post("/volunteers/{name}/ban", tags=["organizers"])
def ban_volunteer(name: str, body: BanRequest, _: OrganizerCredential, res: Res) -> BanResponse:
    with res.store.write() as db:
        volunteer, revoked = volunteers.ban(db, name=name, reason=body.reason)
        out = volunteers.volunteer_out(volunteer)
    return BanResponse(**out.model_dump(), sessions_revoked=revoked)


# ------------------------------------------------------------------------------------------ live feed
@router.websocket("/runs/{name}/live")
async def live(websocket: WebSocket, name: str) -> None:
    hub = websocket.state.resources.hub
    await websocket.accept()
    if not await hub.subscribe(name, websocket):
        await websocket.send_json(
            {"type": "error", "error": "run_not_found", "detail": f"no run named {name!r}"}
        )
        await websocket.close(code=4404)
        return
    try:
        while True:
            message = await websocket.receive_text()
            if message == "ping":
                await websocket.send_json({"type": "pong", "server_time": time.time()})
    except WebSocketDisconnect:
        pass
    finally:
        hub.unsubscribe(name, websocket)

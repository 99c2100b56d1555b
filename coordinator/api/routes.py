"""Routes of ``/api/v1``. Each parses, calls one service function in a unit of work, returns a schema.

Every answer a route can give is declared in the OpenAPI document (``responses=``), including the JSON
error bodies, and ``tests/security`` checks the served document against the answers with schemathesis.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect, status
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from coordinator import runs, sessions
from coordinator.accounts import volunteers
from coordinator.api.deps import (
    ClientInviteGuard,
    JoinQuota,
    OrganizerCredential,
    PublicRead,
    RegisterQuota,
    Res,
    Resources,
    VolunteerCredential,
    client_address,
)
from coordinator.credit import flags, ledger, work
from coordinator.errors import CoordinatorError, RateLimited
from coordinator.models import PeerSession, Run
from coordinator.monitoring import peers
from coordinator.reachability import decide as decide_reachability
from volunteer_app import __version__
from volunteer_app.protocol import (
    ErrorBody,
    HealthOut,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    Leaderboard,
    LeaseCompleteRequest,
    LeaseCompleteResponse,
    LeaseReturnResponse,
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
from volunteer_app.states import RunState

_ERROR_TEXT = {
    400: "Malformed request (e.g. an invalid Content-Length header).",
    401: "Missing, unknown or forged credential or token.",
    403: "Revoked or banned credential, wrong kind of credential, or a refused peer key.",
    404: "No such run, session, lease or volunteer (another volunteer's session is reported as missing).",
    409: "The request conflicts with the current state (name taken, run finished, lease too early, ...).",
    413: "Request body larger than the coordinator accepts.",
    422: "Request body or parameters are invalid; `fields` names each problem.",
    429: "Rate-limited; the Retry-After header says when to try again.",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for JSON error answers ``{"error", "detail", "fields"?}``."""
    answers: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        answer: dict[str, Any] = {"model": ErrorBody, "description": _ERROR_TEXT[code]}
        if code == 429:
            answer["headers"] = {
                "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer", "minimum": 1}}
            }
        answers[code] = answer
    return answers


# Answers any route may give: a refused body (middleware), validation, limits.
router = APIRouter(prefix="/api/v1", responses=errors(400, 413, 422, 429))
PUBLIC = errors(404)
VOLUNTEER = errors(401, 403, 404, 409)
ORGANIZER = errors(401, 403, 404, 409)


class RunCreated(RunOut):
    invite_code: str | None = Field(default=None, description="the generated invite code, shown once")


class BanRequest(BaseModel):
    model_config = {"extra": "forbid"}

    reason: str = Field(default="banned by the organizers", max_length=500)


class BanResponse(VolunteerOut):
    sessions_revoked: int


@contextlib.contextmanager
def _recording_flags(res: Resources) -> Iterator[None]:
    """Refusals that carry a flag (a stolen peer key, a lease reported too early) are kept for the
    organizers: the refused unit of work was rolled back, so the flag gets its own."""
    try:
        yield
    except CoordinatorError as exc:
        if exc.flag is not None:
            with res.store.write() as db:
                flags.record_flag(db, **exc.flag)
        raise


# ------------------------------------------------------------------------------------------ public
@router.get("/health", tags=["public"], dependencies=[PublicRead])
def health(res: Res) -> HealthOut:
    with res.store.read() as db:
        active = db.scalar(select(func.count()).select_from(Run).where(Run.state == RunState.ACTIVE)) or 0
    return HealthOut(status="ok", version=__version__, database=res.store.dialect, runs_active=active)


@router.get("/time", tags=["public"])
def server_time(res: Res) -> dict[str, float]:
    """The server clock. Agents compare it with theirs: hivemind refuses peers whose clocks differ by a minute."""
    return {"server_time": res.clock()}


@router.get("/runs", tags=["public"], dependencies=[PublicRead])
def list_runs(res: Res) -> list[RunOut]:
    with res.store.read() as db:
        return [runs.run_out(db, run=run, settings=res.settings) for run in runs.list_runs(db)]


@router.get("/runs/{name}", tags=["public"], responses=PUBLIC, dependencies=[PublicRead])
def get_run(name: str, res: Res) -> RunOut:
    with res.store.read() as db:
        return runs.run_out(db, run=runs.get_run(db, name=name), settings=res.settings)


@router.get("/runs/{name}/leaderboard", tags=["public"], responses=PUBLIC, dependencies=[PublicRead])
def run_leaderboard(name: str, res: Res) -> Leaderboard:
    with res.store.read() as db:
        return ledger.leaderboard(db, settings=res.settings, run=runs.get_run(db, name=name), now=res.clock())


@router.get("/leaderboard", tags=["public"], dependencies=[PublicRead])
def overall_leaderboard(res: Res) -> Leaderboard:
    with res.store.read() as db:
        return ledger.leaderboard(db, settings=res.settings, now=res.clock())


@router.post(
    "/volunteers",
    status_code=status.HTTP_201_CREATED,
    tags=["volunteers"],
    responses=errors(403, 409),
    dependencies=[RegisterQuota],
)
def register(body: RegisterRequest, guard: ClientInviteGuard, res: Res) -> RegisterResponse:
    """Register a volunteer (per client address: a few a minute, ``limits.register_per_day`` a day). A wrong
    invite code spends one of the address's ``limits.invite_guesses``; once spent, codes get 429."""
    with res.store.write() as db:
        return volunteers.register(db, request=body, invite_guard=guard, now=res.clock())


# ------------------------------------------------------------------------------------------ volunteers
@router.post("/runs/{name}/join", tags=["volunteers"], responses=VOLUNTEER, dependencies=[JoinQuota])
def join(
    name: str,
    body: JoinRequest,
    credential: VolunteerCredential,
    guard: ClientInviteGuard,
    res: Res,
    http: Request,
) -> JoinResponse:
    """Join a run (per credential ``limits.join_per_minute``, per volunteer ``limits.join_per_day``). A wrong
    invite code spends one of the client address's ``limits.invite_guesses``; once spent, codes get 429.

    With ``listen_port`` the coordinator first dials the caller back there (``coordinator.reachability``): the
    answer's assignment says whether the worker is dialled directly, through the run's relay, or not at all."""
    swarm = res.settings.swarm
    reachability = decide_reachability(
        body,
        client_host=http.client.host if http.client is not None else "unknown",
        relay=swarm.enabled and swarm.relay,
    )
    with _recording_flags(res), res.store.write() as db:
        answer = sessions.join(
            db,
            authority=res.authority,
            settings=res.settings,
            credential=credential,
            run_name=name,
            request=body,
            invite_guard=guard,
            now=res.clock(),
            reachability=reachability,
        )
    res.hub.mark_dirty(name)
    return answer


@router.post("/sessions/{session_id}/heartbeat", tags=["volunteers"], responses=VOLUNTEER)
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
        now=res.clock(),
    )
    res.metrics.heartbeats.labels(run=run_name).inc()
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/token", tags=["volunteers"], responses=VOLUNTEER)
def refresh_token(
    session_id: str, body: TokenRefreshRequest, credential: VolunteerCredential, res: Res
) -> TokenRefreshResponse:
    res.limiter.check("refresh", credential.id, per_minute=res.settings.limits.refresh_per_minute)
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        return sessions.refresh_token(db, authority=res.authority, session=session, presented=body.peer_token)


@router.post("/sessions/{session_id}/leases", tags=["volunteers"], responses=VOLUNTEER)
def take_lease(session_id: str, credential: VolunteerCredential, res: Res) -> LeaseTakeResponse:
    res.limiter.check("lease_take", credential.id, per_minute=res.settings.limits.lease_per_minute)
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        run = db.get(Run, session.run_id)
        assert run is not None
        offer = work.take_lease(db, run=run, session=session, settings=res.settings, now=res.clock())
        answer = LeaseTakeResponse(
            lease=work.lease_out(offer.lease) if offer.lease is not None else None,
            retry_after=offer.retry_after,
            waiting_for=offer.waiting_for,  # type: ignore[arg-type]
            run_state=run.state,  # type: ignore[arg-type]
        )
        run_name = run.name
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/leases/{lease_id}/complete", tags=["volunteers"], responses=VOLUNTEER)
def complete_lease(
    session_id: str, lease_id: str, body: LeaseCompleteRequest, credential: VolunteerCredential, res: Res
) -> LeaseCompleteResponse:
    res.limiter.check("lease_complete", credential.id, per_minute=res.settings.limits.lease_per_minute)
    try:
        with res.store.write() as db:
            session = sessions.get_session(db, credential=credential, session_id=session_id)
            answer = work.complete_lease(
                db,
                session=session,
                lease_id=lease_id,
                report=body,
                settings=res.settings,
                now=res.clock(),
                rng=res.rng,
            )
            run_name = db.get(Run, session.run_id).name  # type: ignore[union-attr]
    except work.LeaseTooEarly as exc:
        with res.store.write() as db:
            flags.record_flag(
                db,
                run_id=exc.run_id,
                volunteer_id=exc.volunteer_id,
                session_id=exc.session_id,
                lease_id=exc.lease_id,
                kind=flags.LEASE_TOO_EARLY,
                detail=exc.detail,
                now=res.clock(),
            )
        raise
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/leases/{lease_id}/return", tags=["volunteers"], responses=VOLUNTEER)
def return_lease(
    session_id: str, lease_id: str, credential: VolunteerCredential, res: Res
) -> LeaseReturnResponse:
    """Give back a lease this peer will not finish by its deadline (paused): the shard goes back to the queue."""
    res.limiter.check("lease_return", credential.id, per_minute=res.settings.limits.lease_per_minute)
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        answer = work.return_lease(db, session=session, lease_id=lease_id, now=res.clock())
        run_name = db.get(Run, session.run_id).name  # type: ignore[union-attr]
    res.hub.mark_dirty(run_name)
    return answer


@router.post("/sessions/{session_id}/leave", tags=["volunteers"], responses=VOLUNTEER)
def leave(session_id: str, credential: VolunteerCredential, res: Res) -> SessionLeaveResponse:
    with res.store.write() as db:
        session = sessions.get_session(db, credential=credential, session_id=session_id)
        answer = sessions.leave(db, session=session, now=res.clock())
        run_name = db.get(Run, session.run_id).name  # type: ignore[union-attr]
    res.hub.mark_dirty(run_name)
    return answer


# ------------------------------------------------------------------------------------------ organizers
@router.post("/runs", status_code=status.HTTP_201_CREATED, tags=["organizers"], responses=ORGANIZER)
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


@router.post("/runs/{name}/pause", tags=["organizers"], responses=ORGANIZER)
def pause_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, RunState.PAUSED, res)


@router.post("/runs/{name}/resume", tags=["organizers"], responses=ORGANIZER)
def resume_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, RunState.ACTIVE, res)


@router.post("/runs/{name}/finish", tags=["organizers"], responses=ORGANIZER)
def finish_run(name: str, _: OrganizerCredential, res: Res) -> RunOut:
    return _set_state(name, RunState.FINISHED, res)


@router.get("/runs/{name}/flags", tags=["organizers"], responses=ORGANIZER)
def run_flags(
    name: str, _: OrganizerCredential, res: Res, volunteer: str | None = None
) -> list[flags.FlagOut]:
    """Every claim in the run that the coordinator capped or refused, and every failed spot check."""
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
        volunteer_id = volunteers.get_volunteer(db, name=volunteer).id if volunteer is not None else None
        return [
            flags.flag_out(f, n) for f, n in flags.list_flags(db, run_id=run.id, volunteer_id=volunteer_id)
        ]


@router.get("/volunteers", tags=["organizers"], responses=ORGANIZER)
def list_volunteers(_: OrganizerCredential, res: Res) -> list[peers.VolunteerSummary]:
    """Every volunteer, with its ban, the runs it joined, its credit and flags over all runs."""
    with res.store.read() as db:
        return peers.volunteer_summaries(db, settings=res.settings, now=res.clock())


@router.post("/volunteers/{name}/ban", tags=["organizers"], responses=ORGANIZER)
def ban_volunteer(name: str, body: BanRequest, _: OrganizerCredential, res: Res) -> BanResponse:
    """Ban a volunteer: its credentials are refused at once (its next heartbeat too), its sessions stop and
    their peer tokens are revoked in the swarm; it leaves every leaderboard."""
    with res.store.write() as db:
        volunteer, revoked = volunteers.ban(db, name=name, reason=body.reason)
        out = volunteers.volunteer_out(volunteer)
        touched = list(
            db.scalars(
                select(Run.name)
                .join(PeerSession, PeerSession.run_id == Run.id)
                .where(PeerSession.volunteer_id == volunteer.id)
                .distinct()
            )
        )
    for run_name in touched:
        res.hub.mark_dirty(run_name)
    return BanResponse(**out.model_dump(), sessions_revoked=revoked)


# ------------------------------------------------------------------------------------------ live feed
# Close codes: 1003 a binary frame (the feed speaks text), 1008 repeated junk, 1009 an oversized message,
# 4429 too many connections from one address, 4404 no such run.
_JUNK_BEFORE_CLOSE = 10


@router.websocket("/runs/{name}/live")
async def live(websocket: WebSocket, name: str) -> None:
    res: Resources = websocket.state.resources
    hub = res.hub
    limits = res.settings.limits
    address = client_address(websocket)
    await websocket.accept()
    try:
        res.limiter.check("live", address, per_minute=limits.live_per_minute)
    except RateLimited as exc:
        await websocket.send_json({"type": "error", "error": exc.code, "detail": exc.detail})
        await websocket.close(code=4429)
        return
    if not hub.admit(address, limit=limits.live_connections_per_address):
        await websocket.send_json(
            {
                "type": "error",
                "error": "too_many_connections",
                "detail": f"at most {limits.live_connections_per_address} live feeds per address",
            }
        )
        await websocket.close(code=4429)
        return
    res.metrics.live_sockets.inc()
    try:
        await _serve_live(websocket, name, res)
    except WebSocketDisconnect:  # the client went away (or broke the protocol) before we were done
        pass
    finally:
        res.metrics.live_sockets.dec()
        hub.release(address)


async def _serve_live(websocket: WebSocket, name: str, res: Resources) -> None:
    hub = res.hub
    if not await hub.subscribe(name, websocket):
        await websocket.send_json(
            {"type": "error", "error": "run_not_found", "detail": f"no run named {name!r}"}
        )
        await websocket.close(code=4404)
        return
    junk = 0
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                await websocket.close(code=1003, reason="the live feed takes text messages only")
                return
            if len(text) > res.settings.limits.live_message_bytes:
                await websocket.close(code=1009, reason="message too big")
                return
            if text == "ping":
                await websocket.send_json({"type": "pong", "server_time": res.clock()})
                continue
            junk += 1
            if junk >= _JUNK_BEFORE_CLOSE:
                await websocket.close(code=1008, reason="the live feed only answers 'ping'")
                return
            await websocket.send_json(
                {
                    "type": "error",
                    "error": "unknown_message",
                    "detail": f"send 'ping'; got {json.dumps(text[:40])}",
                }
            )
    except WebSocketDisconnect:
        return
    finally:
        hub.unsubscribe(name, websocket)

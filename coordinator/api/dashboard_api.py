"""The dashboard's API beyond the core contract: sign-in, run history, peers, volunteers' pages, invite
codes, the task catalogue for the create-run form, and public checkpoint downloads.

* ``POST /api/v1/auth/login`` ``{"token": ...}``, ``POST /api/v1/auth/logout``, ``GET /api/v1/auth/session``:
  the organizer token traded for a session cookie (``coordinator.accounts.logins``).
* ``GET /api/v1/runs/{name}/series``: the run's time series (``coordinator.monitoring.series``), public.
* ``GET /api/v1/runs/{name}/peers``, ``GET /api/v1/volunteers/{name}``, ``POST .../unban``: organizers.
* ``GET|POST /api/v1/runs/{name}/invites``, ``POST .../invites/{id}/revoke``: organizers.
* ``POST /api/v1/runs/{name}/checkpoints/{epoch}/publish|unpublish`` (organizers) and
  ``GET .../checkpoints/{epoch}/download`` (anyone, for published checkpoints: a zip of the exported
  checkpoint that ``workers.export.load_model`` loads), ``GET /api/v1/runs/{name}/releases``.
* ``GET /api/v1/tasks``: installed tasks with their presets and config fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import typing
import zipfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from sqlalchemy import select
from starlette.background import BackgroundTask

from coordinator import runs
from coordinator.accounts import invites, logins, volunteers
from coordinator.api.deps import OrganizerCredential, PublicRead, Res, client_address, login_cookie
from coordinator.api.routes import errors
from coordinator.checkpoints import CheckpointError, CheckpointInfo, CheckpointStore, checkpoint_directory
from coordinator.errors import CoordinatorError, Forbidden, NotFound
from coordinator.models import CheckpointRelease, PeerSession, Run
from coordinator.monitoring import peers, series
from volunteer_app.protocol import OptimizerSettings

router = APIRouter(prefix="/api/v1", responses=errors(400, 413, 422, 429))
ORGANIZER = errors(401, 403, 404, 409)
PUBLIC = errors(404)
Epoch = Annotated[int, PathParam(ge=0, le=2**31 - 1, description="the checkpoint's epoch")]

LOGIN_BURST = 5
DOWNLOAD_BURST = 3


# ------------------------------------------------------------------------------------------ sign-in
class LoginRequest(BaseModel):
    model_config = {"extra": "forbid"}

    token: str = Field(min_length=1, max_length=512, description="the organizer token (DATA_DIR/admin-token)")


class SessionOut(BaseModel):
    signed_in: bool
    csrf_token: str | None = Field(
        default=None, description="send it as X-CSRF-Token with every write made with the session cookie"
    )
    expires_at: float | None = None


def _refuse_other_sites(request: Request) -> None:
    """A sign-in form posted by another site's page (login CSRF) is refused like a write."""
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    if site is not None and site.lower() not in ("same-origin", "none"):
        raise Forbidden("refused a sign-in from another site", code="cross_site_request")
    if origin is not None and not logins.same_origin(
        origin, scheme=request.url.scheme, host=request.headers.get("host", "")
    ):
        raise Forbidden("refused a sign-in from another origin", code="cross_site_request")


def _set_cookie(response: Response, request: Request, secret: str, *, max_age: float) -> None:
    secure = request.url.scheme == "https"
    response.set_cookie(
        logins.cookie_name(secure),
        secret,
        max_age=int(max_age),
        path="/",
        httponly=True,
        secure=secure,
        samesite="strict",
    )


def _clear_cookies(response: Response) -> None:
    for name in (logins.COOKIE, logins.SECURE_COOKIE):
        response.delete_cookie(
            name, path="/", httponly=True, samesite="strict", secure=name.startswith("__Host-")
        )


@router.post("/auth/login", tags=["dashboard"], responses=errors(401, 403))
def login(body: LoginRequest, request: Request, response: Response, res: Res) -> SessionOut:
    """Sign this browser in with the organizer token: sets the session cookie (HttpOnly, SameSite=Strict,
    Secure over HTTPS) and answers the CSRF token its writes must carry. A volunteer credential is refused."""
    res.limiter.check(
        "login", client_address(request), per_minute=res.settings.limits.login_per_minute, burst=LOGIN_BURST
    )
    _refuse_other_sites(request)
    now = res.clock()
    try:
        with res.store.write() as db:
            opened = logins.sign_in(
                db,
                token=body.token,
                settings=res.settings,
                now=now,
                address=client_address(request),
                user_agent=request.headers.get("user-agent", ""),
            )
    except CoordinatorError:
        res.metrics.logins.labels(outcome="refused").inc()
        raise
    res.metrics.logins.labels(outcome="signed_in").inc()
    _set_cookie(response, request, opened.secret, max_age=res.settings.dashboard.session_ttl)
    response.headers["Cache-Control"] = "no-store"
    return SessionOut(signed_in=True, csrf_token=opened.csrf_token, expires_at=opened.expires_at)


@router.post("/auth/logout", tags=["dashboard"], responses=errors(403))
def logout(request: Request, response: Response, res: Res) -> SessionOut:
    """End this browser's sign-in (with its CSRF token) and drop the cookie. Idempotent."""
    secret = login_cookie(request)
    _clear_cookies(response)
    if secret is None:
        return SessionOut(signed_in=False)
    now = res.clock()
    with res.store.read() as db:
        try:
            logins.check(db, secret=secret, settings=res.settings, now=now)
        except CoordinatorError:
            return SessionOut(signed_in=False)  # nothing to end: a forged or ended sign-in
    logins.check_browser_write(
        secret=secret,
        method="POST",
        presented_csrf=request.headers.get(logins.CSRF_HEADER),
        origin=request.headers.get("origin"),
        fetch_site=request.headers.get("sec-fetch-site"),
        scheme=request.url.scheme,
        host=request.headers.get("host", ""),
    )
    with res.store.write() as db:
        logins.sign_out(db, secret=secret, now=now)
    return SessionOut(signed_in=False)


@router.get("/auth/session", tags=["dashboard"], dependencies=[PublicRead])
def session(request: Request, response: Response, res: Res) -> SessionOut:
    """Whether this browser is signed in, and the CSRF token for its writes (readable by this origin's
    pages only: the API answers no cross-origin reads)."""
    response.headers["Cache-Control"] = "no-store"
    secret = login_cookie(request)
    if secret is None:
        return SessionOut(signed_in=False)
    try:
        with res.store.read() as db:
            state = logins.check(db, secret=secret, settings=res.settings, now=res.clock())
    except CoordinatorError:
        _clear_cookies(response)
        return SessionOut(signed_in=False)
    return SessionOut(signed_in=True, csrf_token=logins.csrf_token(secret), expires_at=state.expires_at)


# ------------------------------------------------------------------------------------------ tasks
class TaskField(BaseModel):
    name: str
    type: str
    default: Any = None


class TaskOut(BaseModel):
    name: str
    summary: str
    metric: str
    default_preset: str | None
    presets: dict[str, dict[str, Any]]
    fields: list[TaskField]


class TaskCatalog(BaseModel):
    tasks: list[TaskOut]
    optimizer_defaults: dict[str, Any] = Field(
        description="what a run gets for each optimizer setting left out"
    )


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    return text or str(hint).replace("typing.", "").replace("NoneType", "None")


@router.get("/tasks", tags=["dashboard"], dependencies=[PublicRead])
def task_catalog(res: Res) -> TaskCatalog:
    """The installed tasks a run may use, each with its presets and config fields (for the create-run form)."""
    from workers.tasks import available_tasks, load_task

    out = []
    for name in available_tasks():
        try:
            spec = load_task(name)
        except Exception:  # a broken entry point must not hide the others
            continue
        hints = typing.get_type_hints(spec.config_cls)
        listed = []
        for item in dataclasses.fields(spec.config_cls):
            default = item.default if item.default is not dataclasses.MISSING else None
            listed.append(TaskField(name=item.name, type=_type_name(hints.get(item.name)), default=default))
        out.append(
            TaskOut(
                name=spec.name,
                summary=spec.summary,
                metric=spec.metric,
                default_preset=spec.default_preset,
                presets={k: dict(v) for k, v in spec.presets.items()},
                fields=listed,
            )
        )
    return TaskCatalog(tasks=out, optimizer_defaults=OptimizerSettings().model_dump(mode="json"))


# ------------------------------------------------------------------------------------------ history
@router.get("/runs/{name}/series", tags=["public"], responses=PUBLIC, dependencies=[PublicRead])
def run_series(
    name: str,
    res: Res,
    since: Annotated[
        float | None, Query(ge=0, le=1e11, description="only points after this Unix time (for catching up)")
    ] = None,
) -> series.SeriesOut:
    """The run's history (loss, held-out metric, samples/s, peers online, averaging rounds, bytes), oldest
    first; older stretches are coarser. The live feed sends each new point as it is taken."""
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
        return series.series_out(
            db, run=run, settings=res.settings, metric_name=series.task_metric_name(run.task), since=since
        )


# ------------------------------------------------------------------------------------------ peers, volunteers
@router.get("/runs/{name}/peers", tags=["organizers"], responses=ORGANIZER)
def run_peers(
    name: str,
    _: OrganizerCredential,
    res: Res,
    include_ended: Annotated[bool, Query(description="also sessions that left or were stopped")] = False,
) -> list[peers.PeerOut]:
    """The run's peers: volunteer, key, hardware, assignment, throughput, lease, token expiry, last
    heartbeat and what to look at (``flags``)."""
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
        return peers.run_peers(
            db, run=run, settings=res.settings, now=res.clock(), include_ended=include_ended
        )


@router.get("/volunteers/{name}", tags=["organizers"], responses=ORGANIZER)
def volunteer_page(name: str, _: OrganizerCredential, res: Res) -> peers.VolunteerDetail:
    """A volunteer's history across runs, its recent sessions (with hardware) and flags."""
    with res.store.read() as db:
        volunteer = volunteers.get_volunteer(db, name=name)
        return peers.volunteer_detail(db, volunteer=volunteer, settings=res.settings, now=res.clock())


def volunteer_runs(res: Res, volunteer_id: str) -> list[str]:
    """Names of the runs a volunteer took part in (their leaderboards change with a ban)."""
    with res.store.read() as db:
        return list(
            db.scalars(
                select(Run.name)
                .join(PeerSession, PeerSession.run_id == Run.id)
                .where(PeerSession.volunteer_id == volunteer_id)
                .distinct()
            )
        )


@router.post("/volunteers/{name}/unban", tags=["organizers"], responses=ORGANIZER)
def unban_volunteer(name: str, _: OrganizerCredential, res: Res) -> peers.VolunteerSummary:
    """Lift a ban: the volunteer's credentials and peer keys work again (its stopped sessions stay stopped)."""
    with res.store.write() as db:
        volunteer = volunteers.unban(db, name=name)
        out = peers.VolunteerSummary(**volunteers.volunteer_out(volunteer).model_dump())
        volunteer_id = volunteer.id
    for run_name in volunteer_runs(res, volunteer_id):
        res.hub.mark_dirty(run_name)
    return out


# ------------------------------------------------------------------------------------------ invites
@router.get("/runs/{name}/invites", tags=["organizers"], responses=ORGANIZER)
def list_invites(name: str, _: OrganizerCredential, res: Res) -> list[invites.InviteOut]:
    """The run's invite codes (their first characters only: a code is shown once, when it is made)."""
    with res.store.read() as db:
        return invites.list_invites(db, run=runs.get_run(db, name=name))


@router.post(
    "/runs/{name}/invites", status_code=status.HTTP_201_CREATED, tags=["organizers"], responses=ORGANIZER
)
def create_invite(
    name: str, body: invites.InviteCreate, _: OrganizerCredential, res: Res
) -> invites.InviteCreated:
    """A new invite code for the run (shown once in the answer)."""
    with res.store.write() as db:
        return invites.create_invite(db, run=runs.get_run(db, name=name), request=body, now=res.clock())


@router.post("/runs/{name}/invites/{invite_id}/revoke", tags=["organizers"], responses=ORGANIZER)
def revoke_invite(name: str, invite_id: str, _: OrganizerCredential, res: Res) -> invites.InviteOut:
    """Stop a code from admitting anyone new; volunteers it admitted stay members."""
    with res.store.write() as db:
        return invites.revoke_invite(
            db, run=runs.get_run(db, name=name), invite_id=invite_id, now=res.clock()
        )


# ------------------------------------------------------------------------------------------ releases
class ReleaseOut(BaseModel):
    epoch: int
    public: bool
    published_at: float | None = None
    download: str | None = Field(default=None, description="where anyone can download it (a zip)")


def _release_out(run: str, epoch: int, published_at: float | None) -> ReleaseOut:
    if published_at is None:
        return ReleaseOut(epoch=epoch, public=False)
    return ReleaseOut(
        epoch=epoch,
        public=True,
        published_at=published_at,
        download=f"/api/v1/runs/{run}/checkpoints/{epoch}/download",
    )


def _checkpoint(res: Res, run: Run, epoch: int) -> CheckpointInfo:
    try:
        return CheckpointStore(checkpoint_directory(res.settings.data_dir, run.name)).find(epoch)
    except CheckpointError as exc:
        raise NotFound(exc.detail, code="checkpoint_not_found") from exc


@router.get("/runs/{name}/releases", tags=["gallery"], responses=PUBLIC, dependencies=[PublicRead])
def list_releases(name: str, res: Res) -> list[ReleaseOut]:
    """The run's checkpoints the organizers made public, newest first, with their download links."""
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
        rows = db.scalars(
            select(CheckpointRelease)
            .where(CheckpointRelease.run_id == run.id)
            .order_by(CheckpointRelease.epoch.desc())
        )
        return [_release_out(run.name, r.epoch, r.published_at) for r in rows]


@router.post("/runs/{name}/checkpoints/{epoch}/publish", tags=["organizers"], responses=ORGANIZER)
def publish_checkpoint(name: str, epoch: Epoch, _: OrganizerCredential, res: Res) -> ReleaseOut:
    """Let anyone download this checkpoint from the gallery."""
    with res.store.write() as db:
        run = runs.get_run(db, name=name)
        CheckpointStore.set_published(_checkpoint(res, run, epoch), True)  # kept while published
        release = db.get(CheckpointRelease, (run.id, epoch))
        if release is None:
            release = CheckpointRelease(run_id=run.id, epoch=epoch, published_at=res.clock())
            db.add(release)
        return _release_out(run.name, epoch, release.published_at)


@router.post("/runs/{name}/checkpoints/{epoch}/unpublish", tags=["organizers"], responses=ORGANIZER)
def unpublish_checkpoint(name: str, epoch: Epoch, _: OrganizerCredential, res: Res) -> ReleaseOut:
    """Take a checkpoint's download link down again (idempotent)."""
    with res.store.write() as db:
        run = runs.get_run(db, name=name)
        release = db.get(CheckpointRelease, (run.id, epoch))
        if release is not None:
            db.delete(release)
        with contextlib.suppress(NotFound):
            CheckpointStore.set_published(_checkpoint(res, run, epoch), False)  # pruned like the others again
        return _release_out(run.name, epoch, None)


def _zip_export(info: CheckpointInfo, run: str) -> tuple[Path, Path]:
    """The checkpoint exported (``volunteer-coordinator checkpoints export``'s layout) into a zip file.
    Returns the zip and the temporary directory to delete after sending it."""
    from coordinator.checkpoint_cli import export_checkpoint

    scratch = Path(tempfile.mkdtemp(prefix="vc-download-"))
    try:
        folder = scratch / f"{run}-epoch-{info.epoch:08d}"
        export_checkpoint(info, folder)
        archive = scratch / f"{folder.name}.zip"
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as bundle:
            for path in sorted(folder.iterdir()):
                bundle.write(path, f"{folder.name}/{path.name}")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return archive, scratch


@router.get(
    "/runs/{name}/checkpoints/{epoch}/download",
    tags=["gallery"],
    response_class=FileResponse,
    responses={
        200: {"content": {"application/zip": {}}, "description": "the exported checkpoint, zipped"},
        **PUBLIC,
    },
)
async def download_checkpoint(name: str, epoch: Epoch, request: Request, res: Res) -> Response:
    """A published checkpoint, exported and zipped: unzip it and load it with
    ``from workers.export import load_model; model, runtime = load_model("RUN-epoch-NNNNNNNN")``."""
    res.limiter.check(
        "download",
        client_address(request),
        per_minute=res.settings.limits.download_per_minute,
        burst=DOWNLOAD_BURST,
    )

    def prepare() -> tuple[Path, Path]:
        with res.store.read() as db:
            run = runs.get_run(db, name=name)
            if db.get(CheckpointRelease, (run.id, epoch)) is None:
                raise NotFound(
                    f"the checkpoint of epoch {epoch} of run {run.name!r} is not published for download",
                    code="not_published",
                )
        info = _checkpoint(res, run, epoch)
        try:
            archive, scratch = _zip_export(info, run.name)
        except CheckpointError as exc:
            raise NotFound(exc.detail, code="checkpoint_not_found") from exc
        return archive, scratch

    archive, scratch = await asyncio.to_thread(prepare)
    return FileResponse(
        archive,
        media_type="application/zip",
        filename=archive.name,
        background=BackgroundTask(shutil.rmtree, scratch, True),
    )


def metrics_response(res: Any) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(res.metrics.registry), media_type=CONTENT_TYPE_LATEST)

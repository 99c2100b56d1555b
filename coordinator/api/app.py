"""``create_app(settings)``: the coordinator's ASGI app. Resources live in the lifespan state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import IntegrityError
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator import runs, sessions
from coordinator.api.dashboard_api import metrics_response
from coordinator.api.dashboard_api import router as dashboard_router
from coordinator.api.deps import PublicRead, Resources, get_resources
from coordinator.api.files import router as files_router
from coordinator.api.gallery import router as gallery_router
from coordinator.api.routes import router
from coordinator.bootstrap import open_data_dir
from coordinator.credit import ledger
from coordinator.errors import CoordinatorError, NotFound
from coordinator.monitoring import series
from coordinator.monitoring.live import LiveHub
from coordinator.monitoring.metrics import CountingRateLimiter, Metrics
from coordinator.settings import CoordinatorSettings
from volunteer_app import __version__
from volunteer_app.protocol import ErrorBody

logger = logging.getLogger("coordinator")
DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"


def _error(
    status: int,
    code: str,
    detail: str,
    fields: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"error": code, "detail": detail}
    if fields:
        body["fields"] = fields
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 before any handler parses them."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = _error(413, "request_too_large", f"request body is larger than {self.max_bytes} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        await too_large(scope, receive, send)
                        return
                except ValueError:
                    await _error(400, "bad_request", "invalid Content-Length header")(scope, receive, send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$")
# Swagger UI (the /api/v1/docs page) loads its script and style from a CDN and starts with an inline script.
_DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' https://cdn.jsdelivr.net; img-src 'self' data: https://fastapi.tiangolo.com; "
    "frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)


def content_security_policy(host: str | None) -> str:
    """The dashboard's policy: its own scripts, styles and API only (the live feed's websocket on this
    host), pictures from itself (``blob:`` for the drawings "try it" fetches), no framing by any site
    (clickjacking), no plugins, no <base> tricks, no workers, forms posting only to itself."""
    connect = "'self'"
    if host and _HOST.match(host):
        connect += f" ws://{host} wss://{host}"
    return (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        f"connect-src {connect}; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; "
        "object-src 'none'; worker-src 'none'; manifest-src 'self'"
    )


class SecurityHeadersMiddleware:
    """Headers on every HTTP answer: Content-Security-Policy with frame-ancestors 'none', X-Frame-Options,
    nosniff and no referrer. The docs page gets a looser script policy (Swagger UI), framing still denied."""

    def __init__(self, app: ASGIApp, *, docs_path: str):
        self.app = app
        self.docs_path = docs_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = None
        for name, value in scope.get("headers", []):
            if name == b"host":
                host = value.decode("latin-1")
                break
        policy = _DOCS_CSP if scope.get("path") == self.docs_path else content_security_policy(host)

        secure = scope.get("scheme") == "https"

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = policy
                headers["X-Frame-Options"] = "DENY"
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Referrer-Policy"] = "no-referrer"
                headers["Cross-Origin-Opener-Policy"] = "same-origin"
                headers["Permissions-Policy"] = "camera=(), microphone=(), geolocation=(), payment=(), usb=()"
                if secure:
                    headers["Strict-Transport-Security"] = "max-age=31536000"
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _field_errors(exc: RequestValidationError) -> dict[str, str]:
    fields: dict[str, str] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            fields["body"] = f"not valid JSON ({error.get('ctx', {}).get('error', 'syntax error')})"
            continue
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        fields[".".join(loc) or "body"] = error.get("msg", "invalid")
    return fields


def create_app(
    settings: CoordinatorSettings,
    *,
    clock: Callable[[], float] | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    """Build the coordinator app. Nothing is opened until the lifespan starts (``serve`` or a TestClient).

    :param clock: Unix time for leases, deadlines and credit (default ``time.time``); tests move their own.
    :param rng: where spot checks are drawn from (default: the operating system's unpredictable source).
    """
    now = clock or time.time

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        import anyio.to_thread

        # Every database call runs in this pool. SQLite takes one writer at a time, so a small pool keeps
        # threads from fighting over the GIL while they wait (measured: tests/perf/bench_heartbeats.py).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        opened = await asyncio.to_thread(open_data_dir, settings)
        store, authority = opened.store, opened.authority

        def snapshot(run_name: str) -> dict[str, Any] | None:
            with store.read() as db:
                try:
                    run = runs.get_run(db, name=run_name)
                except NotFound:
                    return None
                board = ledger.leaderboard(db, settings=settings, run=run, now=now())
                point = series.latest_point(db, run_id=run.id)
                return {
                    "run": runs.run_out(db, run=run, settings=settings).model_dump(mode="json"),
                    "leaderboard": [e.model_dump(mode="json") for e in board.entries],
                    # the newest point of the run's series: the dashboard's charts extend with it
                    "point": series.point_row(point) if point is not None else None,
                }

        hub = LiveHub(snapshot=snapshot, interval=settings.live_interval)
        metrics.watch_store(store=store, settings=settings, clock=now)
        resources = Resources(
            settings=settings,
            store=store,
            authority=authority,
            limiter=CountingRateLimiter(burst=settings.limits.burst, metrics=metrics),
            hub=hub,
            clock=now,
            rng=rng,
            metrics=metrics,
        )
        app.state.resources = resources  # for code outside requests (tests, the CLI's serve banner)

        async def sweeper() -> None:
            while True:
                await asyncio.sleep(min(10.0, settings.work.session_timeout / 3))
                try:

                    def _sweep() -> sessions.SweepResult:
                        with store.write() as db:
                            return sessions.sweep(db, settings=settings, now=now())

                    swept = await asyncio.to_thread(_sweep)
                    if swept:
                        logger.info(
                            "sweep: %d sessions lost, %d leases expired, %d claims verified, %d shards "
                            "re-queued unverified, %d spot checks expired",
                            swept.lost,
                            swept.expired,
                            swept.verified,
                            swept.requeued,
                            swept.checks_expired,
                        )
                except Exception:
                    logger.exception("session sweep failed")

        recorder = series.SeriesRecorder(settings=settings, clock=now)

        async def record_series() -> None:
            while True:
                await asyncio.sleep(settings.series.interval)
                try:
                    recorded = await asyncio.to_thread(recorder.tick, store, touched=hub.take_touched())
                    for run_name in recorded:
                        hub.mark_dirty(run_name, touched=False)
                except Exception:
                    logger.exception("recording the runs' time series failed")

        tasks = [
            asyncio.create_task(hub.run_forever()),
            asyncio.create_task(sweeper()),
            asyncio.create_task(record_series()),
        ]
        swarm_manager = None
        if settings.swarm.enabled:
            from coordinator.swarm.manager import SwarmManager

            swarm_manager = SwarmManager(settings=settings, store=store)
            tasks.append(asyncio.create_task(swarm_manager.run_forever()))
        try:
            yield {"resources": resources}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if swarm_manager is not None:
                await asyncio.to_thread(swarm_manager.stop_all)
            store.close()

    metrics = Metrics()
    app = FastAPI(
        title="volunteer-coordinator",
        version=__version__,
        description="Admits volunteers to collaborative training runs, hands out work and keeps the ledger.",
        openapi_url="/api/v1/openapi.json",
        docs_url="/api/v1/docs",
        redoc_url=None,
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(SecurityHeadersMiddleware, docs_path="/api/v1/docs")

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(_request: Request, exc: CoordinatorError) -> JSONResponse:
        if exc.status in (401, 403):
            metrics.refused(exc.code)
        return _error(exc.status, exc.code, exc.detail, exc.fields, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = _field_errors(exc)
        listed = "; ".join(f"{k}: {v}" for k, v in fields.items())
        return _error(422, "invalid_request", f"request is invalid: {listed}", fields)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = str(exc.detail)
        if exc.status_code in codes:
            detail = f"{detail.lower()}: {request.method} {request.url.path}"
        return _error(
            exc.status_code,
            codes.get(exc.status_code, "http_error"),
            detail,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(IntegrityError)
    async def _conflicting_write(_request: Request, exc: IntegrityError) -> JSONResponse:
        # Two requests raced for one unique thing (a name, a peer key): the second loses, nothing is lost.
        logger.info("conflicting concurrent write refused: %s", exc.orig)
        return _error(409, "conflict", "another request changed the same thing at the same time; try again")

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return _error(500, "internal_error", "the coordinator hit an unexpected error; it has been logged")

    app.include_router(router)
    app.include_router(gallery_router)
    app.include_router(files_router)
    app.include_router(dashboard_router)

    @app.get("/metrics", include_in_schema=False, dependencies=[PublicRead])
    def _metrics(res: Annotated[Resources, Depends(get_resources)]) -> Any:
        """Prometheus text format: peers online, samples/s, heartbeats, leases, refusals, per run."""
        return metrics_response(res)

    @app.get("/", include_in_schema=False)
    def _root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @app.get("/dashboard/", include_in_schema=False)
    def _dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_DIR / "index.html")

    app.mount("/dashboard/static", StaticFiles(directory=DASHBOARD_DIR), name="dashboard-static")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


_ALWAYS = {
    "400": "Malformed request (e.g. an invalid Content-Length header).",
    "413": "Request body larger than the coordinator accepts.",
    "422": "Request body or parameters are invalid; `fields` names each problem.",
    "429": "Rate-limited; the Retry-After header says when to try again.",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with every error answer as the coordinator really sends it: ``ErrorBody``
    (``{"error", "detail", "fields"?}``) instead of FastAPI's default validation-error shape, on every
    route, including routers defined elsewhere."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status, description in _ALWAYS.items():
                responses.setdefault(status, {"description": description})
            if "{" in path:  # whatever a path names may not exist
                responses.setdefault("404", {"description": "No such thing as the path names."})
            for status, answer in responses.items():
                if status.startswith(("4", "5")):
                    answer["content"] = error
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    app.openapi_schema = document
    return document

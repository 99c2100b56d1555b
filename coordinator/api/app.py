"""``create_app(settings)``: the coordinator's ASGI app. Resources live in the lifespan state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator import ledger, runs, sessions
from coordinator.api.deps import Resources
from coordinator.api.routes import router
from coordinator.bootstrap import open_data_dir
from coordinator.errors import CoordinatorError, NotFound
from coordinator.limits import RateLimiter
from coordinator.live import LiveHub
from coordinator.settings import CoordinatorSettings
from volunteer_app import __version__

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


def _field_errors(exc: RequestValidationError) -> dict[str, str]:
    fields: dict[str, str] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            fields["body"] = f"not valid JSON ({error.get('ctx', {}).get('error', 'syntax error')})"
            continue
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        fields[".".join(loc) or "body"] = error.get("msg", "invalid")
    return fields


def create_app(settings: CoordinatorSettings) -> FastAPI:
    """Build the coordinator app. Nothing is opened until the lifespan starts (``serve`` or a TestClient)."""

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
                board = ledger.leaderboard(db, settings=settings, run=run)
                return {
                    "run": runs.run_out(db, run=run, settings=settings).model_dump(mode="json"),
                    "leaderboard": [e.model_dump(mode="json") for e in board.entries],
                }

        hub = LiveHub(snapshot=snapshot, interval=settings.live_interval)
        resources = Resources(
            settings=settings,
            store=store,
            authority=authority,
            limiter=RateLimiter(burst=settings.limits.burst),
            hub=hub,
        )
        app.state.resources = resources  # for code outside requests (tests, the CLI's serve banner)

        async def sweeper() -> None:
            while True:
                await asyncio.sleep(min(10.0, settings.work.session_timeout / 3))
                try:

                    def _sweep() -> tuple[int, int]:
                        with store.write() as db:
                            return sessions.sweep(db, settings=settings)

                    lost, expired = await asyncio.to_thread(_sweep)
                    if lost or expired:
                        logger.info("sweep: %d sessions lost, %d leases expired", lost, expired)
                except Exception:
                    logger.exception("session sweep failed")

        tasks = [asyncio.create_task(hub.run_forever()), asyncio.create_task(sweeper())]
        swarm_manager = None
        if settings.swarm.enabled:
            from coordinator.swarm_manager import SwarmManager

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

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(_request: Request, exc: CoordinatorError) -> JSONResponse:
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

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return _error(500, "internal_error", "the coordinator hit an unexpected error; it has been logged")

    app.include_router(router)

    @app.get("/", include_in_schema=False)
    def _root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @app.get("/dashboard/", include_in_schema=False)
    def _dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_DIR / "index.html")

    app.mount("/dashboard/static", StaticFiles(directory=DASHBOARD_DIR), name="dashboard-static")
    return app

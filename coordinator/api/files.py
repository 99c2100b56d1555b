"""``GET /api/v1/runs/{name}/files/{sha256}``: a file the run's peers need, for the agents to fetch.

Only the files the run's config names (by their SHA-256, ``coordinator.files``) are served, to registered
volunteers (members only, for an invite-only run); range requests resume a broken
download, the ETag is the digest. Downloads are limited per address.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import FileResponse

from coordinator import runs
from coordinator.api.deps import Res, VolunteerCredential, client_address
from coordinator.api.routes import errors
from coordinator.errors import Forbidden, NotFound
from coordinator.files import run_files
from coordinator.models import RunMember
from volunteer_app.protocol import SHA256_PATTERN

router = APIRouter(prefix="/api/v1", responses=errors(400, 401, 403, 404, 422, 429))

DOWNLOADS_PER_MINUTE = 30.0
DOWNLOADS_BURST = 10


def _download_limit(request: Request, res: Res) -> None:
    res.limiter.check(
        "download", client_address(request), per_minute=DOWNLOADS_PER_MINUTE, burst=DOWNLOADS_BURST
    )


Sha256 = Annotated[str, Path(pattern=SHA256_PATTERN, description="the file's SHA-256, as the run lists it")]


@router.get(
    "/runs/{name}/files/{sha256}",
    tags=["volunteers"],
    dependencies=[Depends(_download_limit)],
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "the file"}},
)
def run_file(name: str, sha256: Sha256, caller: VolunteerCredential, res: Res) -> FileResponse:
    """One of the run's files (``RunOut.files``): the whole file, or the range asked for."""
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
        if run.visibility == "invite" and db.get(RunMember, (run.id, caller.volunteer_id)) is None:
            raise Forbidden(
                f"run {run.name!r} is invite-only; join it with its invite code first",
                code="invite_required",
            )
        listed = {
            f.sha256 for f in run_files(run.task, run.task_config, store=runs.run_file_store(res.settings))
        }
    if sha256 not in listed:
        raise NotFound(f"run {name!r} has no file {sha256[:16]}…", code="file_not_found")
    return FileResponse(
        runs.run_file_store(res.settings).path_of(sha256),
        media_type="application/octet-stream",
        headers={"ETag": f'"{sha256}"', "Cache-Control": "private, max-age=86400, immutable"},
    )

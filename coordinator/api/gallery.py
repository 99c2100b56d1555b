"""The gallery: what a run's model can do, for the dashboard and for anyone curious.

* ``GET /api/v1/runs/{name}/checkpoints``: the run's intact checkpoints, newest first, each with its epoch,
  samples, the task's metrics when it was saved and its answers to the fixed showcase prompts.
* ``GET /api/v1/runs/{name}/checkpoints/{epoch}/samples.png``: that checkpoint's drawings of the showcase
  prompts as one PNG grid.
* ``POST /api/v1/runs/{name}/generate`` ``{"prompt": "a big red circle in the center"}``: draws the caption
  with the latest checkpoint and answers ``image/png`` (``X-Checkpoint-Epoch`` and, where the task can
  judge it, ``X-Prompt-Correct`` headers) or, for text tasks, JSON ``{"text": ...}``. A caption the task
  cannot read is a 422 ``{"error": "unreadable_prompt", "detail": why}``. Rate-limited per client
  address (429); bounded in time (504 after ``GENERATE_TIMEOUT`` seconds).

This process never imports torch: checkpoints are read as files (their checksums verified), and
``generate`` is forwarded to the run's swarm peer process over the loopback socket it publishes
(``coordinator.swarm.generate.GenerateServer``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from coordinator import runs
from coordinator.api.deps import Res, client_address
from coordinator.checkpoints import (
    CheckpointError,
    CheckpointStore,
    checkpoint_directory,
    generate_endpoint_file,
)
from coordinator.errors import CoordinatorError, Invalid, NotFound
from volunteer_app.pictures import Picture, png_bytes
from volunteer_app.worker_protocol import MAX_PROMPT_CHARS, EvalSample

router = APIRouter(prefix="/api/v1", tags=["gallery"])

GENERATE_PER_MINUTE = 20.0
"""Generate requests a client address may make per minute (after the limiter's burst)."""
GENERATE_TIMEOUT = 30.0
"""Seconds a generate request may take, connection to the swarm peer included."""
GENERATE_PNG_SCALE = 8
"""Magnification of the generated picture (a 32-pixel drawing becomes 256 pixels, sharp edges)."""


class Unavailable(CoordinatorError):
    status = 503
    code = "unavailable"


class TimedOut(CoordinatorError):
    status = 504
    code = "generate_timeout"


class PromptOut(BaseModel):
    prompt: str
    correct: bool | None = None
    error: str | None = None
    text: str | None = None


class CheckpointOut(BaseModel):
    epoch: int
    samples: int | None = Field(
        default=None, description="samples the swarm had trained (epoch x target batch)"
    )
    saved_at: float | None = None
    metric: str | None = Field(default=None, description="the task's headline metric")
    metrics: dict[str, float]
    prompts: list[PromptOut] = Field(description="the showcase prompts and how the checkpoint answered them")
    samples_png: str | None = Field(default=None, description="URL of the drawings of the showcase prompts")
    bytes: int


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)


class TextAnswer(BaseModel):
    prompt: str
    text: str
    epoch: int


def _store(res: Res, name: str) -> CheckpointStore:
    with res.store.read() as db:
        run = runs.get_run(db, name=name)
    return CheckpointStore(checkpoint_directory(res.settings.data_dir, run.name))


@router.get("/runs/{name}/checkpoints")
def list_checkpoints(name: str, res: Res) -> list[CheckpointOut]:
    """The run's intact checkpoints, newest first (damaged ones are left out)."""
    store = _store(res, name)
    out = []
    for info in store.valid():
        summary = info.summary()
        out.append(
            CheckpointOut(
                epoch=info.epoch,
                samples=summary["samples"],
                saved_at=summary["saved_at"],
                metric=summary["metric"],
                metrics=summary["metrics"],
                prompts=[PromptOut.model_validate(p) for p in summary["prompts"] if isinstance(p, dict)],
                samples_png=f"/api/v1/runs/{name}/checkpoints/{info.epoch}/samples.png"
                if summary["has_samples_png"]
                else None,
                bytes=summary["bytes"],
            )
        )
    return out


@router.get("/runs/{name}/checkpoints/{epoch}/samples.png", response_class=FileResponse)
def checkpoint_samples(name: str, epoch: int, res: Res) -> FileResponse:
    """The checkpoint's drawings of the showcase prompts (4 per row)."""
    store = _store(res, name)
    try:
        info = store.find(epoch)
    except CheckpointError as exc:
        raise NotFound(exc.detail, code="checkpoint_not_found") from exc
    if info.samples_png is None:
        raise NotFound(
            f"the checkpoint of epoch {epoch} has no drawings (its task draws none)", code="no_samples"
        )
    return FileResponse(info.samples_png, media_type="image/png")


async def _ask_swarm_peer(res: Res, run: str, prompt: str) -> dict[str, Any]:
    endpoint = generate_endpoint_file(res.settings.data_dir, run)
    try:
        published = json.loads(endpoint.read_text())
        port, secret = int(published["port"]), str(published["secret"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(
            f"run {run!r} has no swarm peer answering generate requests right now; try again shortly",
            code="swarm_peer_unavailable",
            headers={"Retry-After": "10"},
        ) from exc
    request = json.dumps({"secret": secret, "prompts": [prompt]}).encode() + b"\n"

    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()

    try:
        line = await asyncio.wait_for(exchange(), timeout=GENERATE_TIMEOUT)
    except asyncio.TimeoutError as exc:
        raise TimedOut(f"drawing took longer than {GENERATE_TIMEOUT:.0f} s; try again later") from exc
    except OSError as exc:
        raise Unavailable(
            f"run {run!r}'s swarm peer is not answering ({exc.strerror or exc}); try again shortly",
            code="swarm_peer_unavailable",
            headers={"Retry-After": "10"},
        ) from exc
    try:
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise Unavailable(
            "the swarm peer gave no answer; try again shortly", code="swarm_peer_unavailable"
        ) from exc
    return answer


@router.post(
    "/runs/{name}/generate",
    response_class=Response,
    responses={
        200: {"content": {"image/png": {}, "application/json": {}}, "description": "the drawing (or text)"},
        422: {"description": "a caption the task cannot read"},
        429: {"description": "rate-limited"},
        503: {"description": "no checkpoint or no swarm peer yet"},
        504: {"description": "took too long"},
    },
)
async def generate(name: str, body: GenerateRequest, request: Request, res: Res) -> Response:
    """Draw a caption with the run's latest checkpoint (in the run's swarm peer process)."""
    res.limiter.check("generate", client_address(request), per_minute=GENERATE_PER_MINUTE)

    def lookup() -> str:
        with res.store.read() as db:
            return runs.get_run(db, name=name).name

    run = await asyncio.to_thread(lookup)
    answer = await _ask_swarm_peer(res, run, body.prompt)
    if not answer.get("ok"):
        code, detail = str(answer.get("error", "generate_failed")), str(answer.get("detail", ""))
        if code == "no_checkpoint":
            raise Unavailable(detail, code=code, headers={"Retry-After": "60"})
        raise Unavailable(f"the swarm peer could not draw: {detail}", code=code)
    samples = answer.get("samples") or []
    try:
        sample = EvalSample.model_validate(samples[0])
    except (IndexError, ValueError) as exc:
        raise Unavailable("the swarm peer gave a malformed answer", code="swarm_peer_unavailable") from exc
    if sample.error is not None:
        raise Invalid(sample.error, code="unreadable_prompt", fields={"prompt": sample.error})
    epoch = int(answer.get("epoch", 0))
    if sample.image is not None:
        picture = Picture(sample.image.width, sample.image.height, sample.image.rgb())
        headers = {"X-Checkpoint-Epoch": str(epoch), "Cache-Control": "no-store"}
        if sample.correct is not None:
            headers["X-Prompt-Correct"] = "true" if sample.correct else "false"
        return Response(png_bytes(picture, scale=GENERATE_PNG_SCALE), media_type="image/png", headers=headers)
    return JSONResponse(TextAnswer(prompt=sample.prompt, text=sample.text or "", epoch=epoch).model_dump())

"""The pipe between the agent supervisor and its training worker process.

The supervisor starts ``python -m workers.worker`` and writes one :class:`WorkerStart` JSON line to
its stdin, then :class:`WorkerCommand` lines (pause, resume, stop, a new token, a new lease, evaluate,
limits). The worker writes :class:`WorkerEvent` JSON lines to stdout; its logs go to stderr. Both sides
validate every line with these models, so a garbled line is reported instead of crashing either side.
Every message ignores fields it does not know, and every field added since the first version has a
default, so an older agent and a newer worker (or the reverse) still understand each other.

Commands the worker applies between two micro-batches (none stalls training for more than a moment):

``{"type": "evaluate", "request_id": "r1", "prompts": ["a red circle at the top left"],
"max_samples": 64, "metrics": true}``
    Draw ``prompts`` with the current model (``null``: the task's fixed showcase prompts, about 8; at
    most :data:`MAX_EVAL_PROMPTS`) and, when ``metrics`` is true, compute the task's held-out metrics on at
    most ``max_samples`` samples. Answered by one :class:`EvalEvent` with the same ``request_id``.
    A prompt the task cannot read (an unknown word, a caption that names no shape) is answered in
    its :class:`EvalSample`'s ``error``, never by a crash.
``{"type": "limits", "threads": 1}``
    Use this many CPU threads from the next micro-batch on (``torch.set_num_threads``). The worker's
    next :class:`ProgressEvent` carries ``threads``, the value in force: that is the acknowledgement.

Events:

:class:`EvalEvent` ``{"type": "eval", "epoch": 12, "request_id": "r1", "metrics": {"loss": 0.41,
"prompt_accuracy": 0.62, ...}, "samples": [EvalSample, ...]}``; ``metrics`` is empty when they were
not asked for, ``request_id`` is null for the evaluation the worker runs on its own before it stops.

:class:`EvalSample` ``{"prompt": "...", "kind": "image" | "text", "text": null | "generated text",
"image": null | EvalImage, "correct": null | true | false, "error": null | "why the prompt cannot be
drawn"}``; ``correct`` is the task's own program check (shapes-dalle judges the picture against the
caption), null where a task has none.

:class:`EvalImage` ``{"width": 32, "height": 32, "pixels": "<base64 of width*height*3 bytes: RGB,
row by row, top row first>"}`` at the task's native resolution
(:func:`EvalImage.rgb_rows` decodes it; ``volunteer_app.pictures`` renders it as PNG or half-blocks).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from volunteer_app.protocol import JoinResponse, LeaseOut, TrainingFigures
from volunteer_app.states import WorkerStateName  # the worker's states are spelled there

EXIT_RUN_REFUSED = 5
"""The exit status of a worker (or speed test) that refuses the run: its task is not installed here, its
config or files are refused, or its model does not fit this machine's limits. The agent does not restart
such a worker; it leaves the run and says why (the worker's last fatal error event)."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WorkerStart(_Message):
    """Everything the worker needs, sent once."""

    join: JoinResponse
    peer_key_path: str = Field(description="the hivemind RSA key the peer token is bound to")
    listen_host: str = Field(default="0.0.0.0", description="address the worker's DHT listens on")
    listen_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="TCP port the worker's DHT listens on (the one dialled back at join)",
    )
    announce_host: str | None = Field(
        default=None, description="public address to announce (port forwarding)"
    )
    max_memory_bytes: int | None = Field(
        default=None, description="memory cap; the micro-batch shrinks to fit"
    )
    memory_limit_bytes: int | None = Field(
        default=None,
        description="the memory this worker may use at most: a model that needs more is refused, and the "
        "operating system caps the process there (None: no cap, for older agents)",
    )
    cache_dir: str | None = Field(
        default=None, description="the agent's file cache: every file the worker opens for the run is in it"
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="SHA-256 -> path in cache_dir of each file the run needs, fetched and checked by the agent",
    )
    report_interval: float = Field(default=1.0, gt=0, description="seconds between progress events")
    evaluate_on_stop: bool = Field(default=False, description="run the task's evaluation before exiting")
    evaluate_max_samples: int | None = None
    log_level: str = "WARNING"


class PauseCommand(_Message):
    type: Literal["pause"] = "pause"


class ResumeCommand(_Message):
    type: Literal["resume"] = "resume"


class StopCommand(_Message):
    type: Literal["stop"] = "stop"
    evaluate: bool | None = None


class TokenCommand(_Message):
    type: Literal["token"] = "token"
    peer_token: str


class LeaseCommand(_Message):
    type: Literal["lease"] = "lease"
    lease: LeaseOut


MAX_EVAL_PROMPTS = 16
"""The most prompts one evaluate command may ask for (drawing them pauses training briefly)."""
MAX_PROMPT_CHARS = 300
MAX_IMAGE_SIDE = 256


class EvaluateCommand(_Message):
    """Evaluate the current model and draw prompts; answered by an :class:`EvalEvent`."""

    type: Literal["evaluate"] = "evaluate"
    max_samples: int | None = Field(default=None, ge=1, description="cap on held-out samples for metrics")
    request_id: str | None = Field(default=None, max_length=100, description="echoed in the EvalEvent")
    prompts: list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]] | None = Field(
        default=None,
        max_length=MAX_EVAL_PROMPTS,
        description="captions to draw; null for the task's fixed showcase prompts",
    )
    metrics: bool = Field(default=True, description="also compute the held-out metrics")


class DropLeaseCommand(_Message):
    """Forget a lease that the agent gave back to the coordinator (the volunteer paused past its deadline)."""

    type: Literal["drop_lease"] = "drop_lease"
    lease_id: str = Field(max_length=100)


class LimitsCommand(_Message):
    """Resource limits the worker applies live, between micro-batches."""

    type: Literal["limits"] = "limits"
    threads: int = Field(ge=1, le=4096, description="CPU threads for training (torch.set_num_threads)")


WorkerCommand = Annotated[
    PauseCommand
    | ResumeCommand
    | StopCommand
    | TokenCommand
    | LeaseCommand
    | DropLeaseCommand
    | EvaluateCommand
    | LimitsCommand,
    Field(discriminator="type"),
]
COMMANDS: TypeAdapter[WorkerCommand] = TypeAdapter(WorkerCommand)


class StateEvent(_Message):
    type: Literal["state"] = "state"
    state: WorkerStateName
    detail: str | None = None


class ReadyEvent(_Message):
    """The worker joined the swarm: its multiaddrs, its model size and its effective settings."""

    type: Literal["ready"] = "ready"
    peer_id: str
    maddrs: list[str]
    parameters: int
    device: str
    threads: int
    micro_batch_size: int
    accumulation_steps: int
    client_mode: bool
    loaded_state_epoch: int | None = None


class ProgressEvent(_Message, TrainingFigures):
    """The worker's training figures (:class:`~volunteer_app.protocol.TrainingFigures`, this worker process's
    own: the agent adds the session's earlier workers) and where it stands in its lease."""

    type: Literal["progress"] = "progress"
    state: WorkerStateName
    loss: float | None = Field(
        default=None,
        description="the raw running loss, NaN included (TrainingFigures.of reports that as none)",
    )
    samples_accumulated: int = Field(description="samples this peer accumulated toward the current epoch")
    failed_rounds: int
    lease_id: str | None
    lease_samples_done: int
    lease_samples: int
    compute_seconds: float
    threads: int | None = Field(default=None, description="CPU threads in force (acknowledges LimitsCommand)")


class LeaseDoneEvent(_Message):
    type: Literal["lease_done"] = "lease_done"
    lease_id: str
    samples: int
    compute_seconds: float
    loss: float | None


class NeedLeaseEvent(_Message):
    type: Literal["need_lease"] = "need_lease"
    queued: int


class AveragedEvent(_Message):
    type: Literal["averaged"] = "averaged"
    epoch: int
    group_bytes: int
    ok: bool


class EvalImage(_Message):
    """A small RGB picture: ``pixels`` is base64 of ``width * height * 3`` bytes, row by row from the top."""

    width: int = Field(ge=1, le=MAX_IMAGE_SIDE)
    height: int = Field(ge=1, le=MAX_IMAGE_SIDE)
    pixels: str

    @model_validator(mode="after")
    def _check_size(self) -> EvalImage:
        try:
            raw = base64.b64decode(self.pixels, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"pixels is not base64: {exc}") from exc
        if len(raw) != self.width * self.height * 3:
            raise ValueError(
                f"pixels holds {len(raw)} bytes, a {self.width}x{self.height} RGB image needs "
                f"{self.width * self.height * 3}"
            )
        return self

    @classmethod
    def from_rgb(cls, width: int, height: int, data: bytes) -> EvalImage:
        """Wrap raw RGB bytes (``width * height * 3``, rows top to bottom)."""
        return cls(width=width, height=height, pixels=base64.b64encode(data).decode("ascii"))

    def rgb(self) -> bytes:
        """The raw RGB bytes."""
        return base64.b64decode(self.pixels)

    def rgb_rows(self) -> list[list[tuple[int, int, int]]]:
        """The pixels as rows of ``(r, g, b)`` tuples, top row first."""
        raw = self.rgb()
        stride = self.width * 3
        return [
            [
                (raw[y * stride + 3 * x], raw[y * stride + 3 * x + 1], raw[y * stride + 3 * x + 2])
                for x in range(self.width)
            ]
            for y in range(self.height)
        ]


class EvalSample(_Message):
    """What the model made of one prompt."""

    prompt: str
    kind: Literal["image", "text"]
    text: str | None = Field(default=None, description="generated text (text tasks)")
    image: EvalImage | None = Field(default=None, description="the drawing (image tasks)")
    correct: bool | None = Field(default=None, description="the task's program check; null when it has none")
    error: str | None = Field(default=None, description="why the prompt could not be drawn")


class EvalEvent(_Message):
    type: Literal["eval"] = "eval"
    metrics: dict[str, float]
    epoch: int
    request_id: str | None = None
    samples: list[EvalSample] = Field(default_factory=list)
    peers_averaged: int = Field(
        default=1,
        ge=1,
        description="how many peers' parameters the evaluated model is the mean of (1: its own)",
    )


class ErrorEvent(_Message):
    type: Literal["error"] = "error"
    message: str
    fatal: bool = False


class StoppedEvent(_Message):
    type: Literal["stopped"] = "stopped"
    samples_total: int
    lease_id: str | None
    lease_samples_done: int
    compute_seconds: float


WorkerEvent = Annotated[
    StateEvent
    | ReadyEvent
    | ProgressEvent
    | LeaseDoneEvent
    | NeedLeaseEvent
    | AveragedEvent
    | EvalEvent
    | ErrorEvent
    | StoppedEvent,
    Field(discriminator="type"),
]
EVENTS: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


def encode(message: BaseModel) -> str:
    return message.model_dump_json() + "\n"

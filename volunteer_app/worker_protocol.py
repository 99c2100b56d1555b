"""The pipe between the agent supervisor and its training worker process.

The supervisor starts ``python -m workers.worker`` and writes one :class:`WorkerStart` JSON line to
its stdin, then :class:`WorkerCommand` lines (pause, resume, stop, a new token, a new lease). The
worker writes :class:`WorkerEvent` JSON lines to stdout; its logs go to stderr. Both sides validate
every line with these models, so a garbled line is reported instead of crashing either side.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from volunteer_app.protocol import JoinResponse, LeaseOut


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WorkerStart(_Message):
    """Everything the worker needs, sent once."""

    join: JoinResponse
    peer_key_path: str = Field(description="the hivemind RSA key the peer token is bound to")
    listen_host: str = Field(default="0.0.0.0", description="address the worker's DHT listens on")
    announce_host: str | None = Field(
        default=None, description="public address to announce (port forwarding)"
    )
    max_memory_bytes: int | None = Field(
        default=None, description="memory cap; the micro-batch shrinks to fit"
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


class EvaluateCommand(_Message):
    type: Literal["evaluate"] = "evaluate"
    max_samples: int | None = None


WorkerCommand = Annotated[
    PauseCommand | ResumeCommand | StopCommand | TokenCommand | LeaseCommand | EvaluateCommand,
    Field(discriminator="type"),
]
COMMANDS: TypeAdapter[WorkerCommand] = TypeAdapter(WorkerCommand)

WorkerStateName = Literal["starting", "syncing", "training", "paused", "waiting", "stopping", "stopped"]


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


class ProgressEvent(_Message):
    type: Literal["progress"] = "progress"
    state: WorkerStateName
    samples_total: int
    samples_per_second: float
    loss: float | None
    local_epoch: int
    global_epoch: int
    swarm_size: int
    samples_accumulated: int = Field(description="samples this peer accumulated toward the current epoch")
    averaging_rounds: int
    failed_rounds: int
    bytes_sent: int
    bytes_received: int
    lease_id: str | None
    lease_samples_done: int
    lease_samples: int
    compute_seconds: float


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


class EvalEvent(_Message):
    type: Literal["eval"] = "eval"
    metrics: dict[str, float]
    epoch: int


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

"""The wire protocol between agents and the coordinator (``/api/v1``), as pydantic models.

Request and response shapes are separate models. Requests forbid unknown fields so that a typo in a
client is a clear 422 instead of a silently ignored value; responses allow new fields so that older
agents keep working against a newer coordinator.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

API_PREFIX = "/api/v1"

Name = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
    ),
]
"""Run and volunteer names: letters, digits, ``_ . -``, starting with a letter or digit, at most 40."""

Compression = Literal["none", "fp16", "8bit"]
RunState = Literal["active", "paused", "finished"]
Visibility = Literal["open", "invite"]
WorkerState = Literal["starting", "syncing", "training", "paused", "waiting", "stopping"]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(Response):
    """Every error answer: ``{"error": code, "detail": text}``, plus ``fields`` for validation errors."""

    error: str
    detail: str
    fields: dict[str, str] | None = None


# ----------------------------------------------------------------------------------------- profile
class GpuInfo(Request):
    name: str = Field(max_length=200)
    memory_bytes: int = Field(ge=0)
    driver: str | None = Field(default=None, max_length=100)
    cuda_capability: str | None = Field(default=None, max_length=20)


class TaskBenchmark(Request):
    """Samples per second of a task's training step measured on this machine (the profile's micro-benchmark)."""

    task: str = Field(max_length=200)
    preset: str | None = Field(default=None, max_length=40)
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = Field(ge=1, le=4096)
    micro_batch_size: int = Field(ge=1, le=65536)
    samples_per_second: float = Field(ge=0.0, le=1e7)


class HardwareProfile(Request):
    """What ``volunteer-app profile`` reports and ``join`` sends."""

    cpu_model: str = Field(default="unknown", max_length=200)
    cpu_cores: int = Field(ge=1, le=4096, description="physical cores")
    cpu_threads: int = Field(ge=1, le=8192, description="logical CPUs")
    ram_bytes: int = Field(ge=0)
    os: str = Field(default="unknown", max_length=200)
    python: str = Field(default="unknown", max_length=40)
    torch: str | None = Field(default=None, max_length=40)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    accepts_connections: bool | None = Field(
        default=None, description="whether other peers can dial this machine; None when unknown"
    )
    benchmark: TaskBenchmark | None = None

    def devices(self) -> list[str]:
        """Short device names for the leaderboard: the GPUs, else the CPU."""
        if self.gpus:
            return [g.name for g in self.gpus]
        return [f"{self.cpu_model} ({self.cpu_cores} cores)"]


# ----------------------------------------------------------------------------------------- volunteers
class RegisterRequest(Request):
    name: Name
    invite_code: str | None = Field(default=None, max_length=200)


class RegisterResponse(Response):
    volunteer_id: str
    name: str
    credential: str = Field(description="shown once; the agent stores it in its config dir with mode 0600")


class VolunteerOut(Response):
    volunteer_id: str
    name: str
    created_at: float
    banned: bool
    last_seen: float | None = None


# ----------------------------------------------------------------------------------------- runs
class OptimizerSettings(Request):
    """How the swarm averages; the run's organizer sets these, every peer uses the same."""

    target_batch_size: int = Field(default=4096, ge=1, le=10_000_000, description="samples per global epoch")
    matchmaking_time: float = Field(
        default=3.0, gt=0, le=600, description="seconds to gather an averaging group"
    )
    averaging_timeout: float = Field(default=30.0, gt=0, le=3600)
    grad_compression: Compression = Field(default="fp16", description="gradient compression on the wire")
    state_compression: Compression = Field(
        default="fp16", description="parameter/state averaging compression"
    )
    average_state_every: int = Field(
        default=4, ge=1, le=1000, description="average parameters every N epochs"
    )
    use_local_updates: bool = Field(
        default=False, description="apply local optimizer steps between averaging rounds (for slow links)"
    )


class RunCreate(Request):
    name: Name
    task: str = Field(min_length=1, max_length=200)
    task_config: dict[str, object] = Field(default_factory=dict)
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    visibility: Visibility = "open"
    invite_code: str | None = Field(default=None, min_length=6, max_length=200)
    data_epochs: int = Field(
        default=1, ge=1, le=100_000, description="passes over the data set before the run finishes"
    )
    description: str = Field(default="", max_length=2000)


class RunConfigOut(Response):
    """What a worker needs to train: the task, its config and the swarm's optimizer settings."""

    name: str
    task: str
    task_config: dict[str, object]
    optimizer: OptimizerSettings
    hivemind_run_id: str


class RunStats(Response):
    active_peers: int = 0
    samples_total: int = Field(default=0, description="samples trained, as the peers report them")
    samples_credited: int = Field(default=0, description="samples in the ledger (checked work)")
    samples_per_second: float = 0.0
    loss: float | None = None
    global_epoch: int = 0
    shards_done: int = 0
    shards_total: int = 0
    data_epoch: int = 0
    volunteers: int = 0


class RunOut(Response):
    name: str
    task: str
    description: str
    state: RunState
    visibility: Visibility
    created_at: float
    data_epochs: int
    task_config: dict[str, object]
    optimizer: OptimizerSettings
    stats: RunStats
    initial_peers: list[str] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------- sessions
class PeerAssignment(Response):
    """Per-peer settings the coordinator derives from the peer's profile and limits."""

    device: Literal["cpu", "cuda"]
    threads: int
    micro_batch_size: int
    accumulation_steps: int = Field(description="micro-batches per hivemind Optimizer.step call")
    client_mode: bool = Field(description="True for peers that cannot accept incoming connections")
    amp: bool
    offload_optimizer: bool
    delay_optimizer_step: bool


class LeaseOut(Response):
    lease_id: str
    shard: int
    data_epoch: int
    samples: int
    seed: int = Field(description="shuffle seed for this lease")
    issued_at: float
    deadline: float


class CoordinatorKey(Response):
    kid: str
    public_key: str


class JoinRequest(Request):
    profile: HardwareProfile
    agent_version: str = Field(max_length=40)
    peer_public_key: str = Field(
        min_length=100, max_length=4096, description="the worker's hivemind RSA public key, OpenSSH format"
    )
    invite_code: str | None = Field(default=None, max_length=200)
    max_threads: int | None = Field(default=None, ge=1, le=4096)
    device: Literal["auto", "cpu", "cuda"] = "auto"


class JoinResponse(Response):
    session_id: str
    volunteer_id: str
    peer_token: str
    token_expires_at: float
    coordinator_keys: list[CoordinatorKey]
    initial_peers: list[str]
    run: RunConfigOut
    assignment: PeerAssignment
    lease: LeaseOut | None
    heartbeat_interval: float


class HeartbeatRequest(Request):
    state: WorkerState
    samples_total: int = Field(ge=0, description="samples this session has processed since it joined")
    samples_per_second: float = Field(ge=0.0, le=1e7)
    loss: float | None = Field(default=None, ge=0.0, le=1e6)
    local_epoch: int = Field(default=0, ge=0)
    global_epoch: int = Field(default=0, ge=0)
    swarm_size: int = Field(default=0, ge=0, le=1_000_000)
    averaging_rounds: int = Field(default=0, ge=0)
    bytes_sent: int = Field(default=0, ge=0)
    bytes_received: int = Field(default=0, ge=0)


class Command(Response):
    type: Literal["pause", "resume", "stop", "new_token"]
    reason: str | None = None
    peer_token: str | None = None
    expires_at: float | None = None


class HeartbeatResponse(Response):
    commands: list[Command]
    run_state: RunState
    server_time: float
    next_heartbeat: float


class TokenRefreshRequest(Request):
    peer_token: str = Field(max_length=8192)


class TokenRefreshResponse(Response):
    peer_token: str
    expires_at: float


class LeaseCompleteRequest(Request):
    samples: int = Field(ge=0, le=100_000_000)
    compute_seconds: float = Field(ge=0.0, le=1e7)
    loss: float | None = Field(default=None, ge=0.0, le=1e6)


class LeaseCompleteResponse(Response):
    lease_id: str
    credited_samples: int
    flagged: bool
    reason: str | None = None
    already_completed: bool = False


class LeaseTakeResponse(Response):
    lease: LeaseOut | None
    retry_after: float | None = Field(default=None, description="seconds until work may be available again")
    run_state: RunState


class SessionLeaveResponse(Response):
    session_id: str
    state: str
    leases_returned: int


# ----------------------------------------------------------------------------------------- leaderboard
class LeaderboardEntry(Response):
    rank: int
    volunteer: str
    samples: int
    verified_samples: int
    compute_seconds: float
    samples_per_second: float
    last_seen: float | None
    devices: list[str]
    flagged: int = Field(description="ledger entries whose claims were capped or could not be checked")
    online: bool


class Leaderboard(Response):
    run: str | None
    entries: list[LeaderboardEntry]
    generated_at: float


class HealthOut(Response):
    status: Literal["ok"]
    version: str
    database: str
    runs_active: int

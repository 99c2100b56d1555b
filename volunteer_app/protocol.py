"""The wire protocol between agents and the coordinator (``/api/v1``), as pydantic models.

Request and response shapes are separate models. Requests forbid unknown fields so that a typo in a
client is a clear 422 instead of a silently ignored value; responses allow new fields so that older
agents keep working against a newer coordinator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from volunteer_app.safetext import clean_data
from volunteer_app.states import HeartbeatWorkerState, RunStateName

API_PREFIX = "/api/v1"

Name = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
    ),
]
"""Run and volunteer names: letters, digits, ``_ . -``, starting with a letter or digit, at most 40."""

VolunteerName = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True,
        min_length=1,
        max_length=40,
        pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9_.\-]*[A-Za-z0-9])?$",
    ),
]
"""A volunteer's name: as :data:`Name`, but ending with a letter or digit too, so that ``ada.`` cannot pose
as ``ada``. The coordinator also refuses a name that differs from a taken one only in case."""

MAX_COUNT = 2**53 - 1
"""Largest count a request may carry: exact in a JavaScript number, and far below SQL's BIGINT limit."""
MAX_EPOCH = 2**31 - 1
"""Largest epoch or round number a request may carry (a 32-bit SQL INTEGER)."""
MAX_SAMPLES_TOTAL = 10**15
"""Largest ``samples_total`` a heartbeat may report (a GPU at 30,000 samples/s needs a millennium)."""

Compression = Literal["none", "fp16", "8bit"]
RunState = RunStateName  # the wire's spelling of volunteer_app.states.RunState
Visibility = Literal["open", "invite"]


class Request(BaseModel):
    # strict: a count is an integer, not ``false`` or ``"12"`` (junk is refused with a 422, never coerced)
    model_config = ConfigDict(extra="forbid", strict=True)


class Response(BaseModel):
    """An answer of the coordinator. Its strings are cleaned of control characters and bidi overrides
    (:mod:`volunteer_app.safetext`) as it is read: a volunteer's computer shows them, and the coordinator
    is not trusted to send only printable text."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _printable(cls, data: object) -> object:
        return clean_data(data) if isinstance(data, dict) else data


class ErrorBody(Response):
    """Every error answer: ``{"error": code, "detail": text}``, plus ``fields`` for validation errors."""

    error: str
    detail: str
    fields: dict[str, str] | None = None


# ----------------------------------------------------------------------------------------- profile
class GpuInfo(Request):
    name: str = Field(max_length=200)
    memory_bytes: int = Field(ge=0, le=MAX_COUNT)
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
    ram_bytes: int = Field(ge=0, le=MAX_COUNT)
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
    name: VolunteerName
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
UpdateMode = Literal["gradients", "local", "diloco"]
"""How a swarm combines its peers' work (``workers.collab`` documents each; docs/learning-per-sample.md
compares them):
``gradients`` averages gradients and takes one step per global epoch; ``local`` lets every peer step on
its own and averages parameters every round; ``diloco`` does the same and then takes an outer Nesterov
step on the averaged parameters (DiLoCo)."""


class OptimizerSettings(Request):
    """How the swarm averages; the run's organizer sets these, every peer uses the same."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_local_updates(cls, data: object) -> object:
        # Runs stored before update_mode existed (and older clients) say only use_local_updates.
        if isinstance(data, dict) and "update_mode" not in data and data.get("use_local_updates") is True:
            return {**data, "update_mode": "local"}
        return data

    @model_validator(mode="after")
    def _mirror_local_updates(self) -> OptimizerSettings:
        # Older workers read use_local_updates only: keep it true for both local-update modes.
        object.__setattr__(self, "use_local_updates", self.update_mode != "gradients")
        return self

    @model_validator(mode="after")
    def _early_epochs_fit(self) -> OptimizerSettings:
        # Early epochs are more frequent parameter-averaging rounds than the later ones: gradient averaging
        # has no such rounds, and a run whose rounds are already that frequent has nothing to shorten.
        if not self.early_epochs:
            return self
        if self.update_mode == "gradients":
            raise ValueError("early_epochs applies to the local and diloco update modes (gradients: 0)")
        if self.early_target_batch_size >= self.target_batch_size:
            raise ValueError(
                f"early_target_batch_size ({self.early_target_batch_size}) must be below target_batch_size "
                f"({self.target_batch_size}), or early_epochs 0"
            )
        return self

    # Defaults measured with tests/perf/bench_learning.py and bench_collaboration.py: local updates learn as
    # much per sample as averaging gradients every micro-batch would (docs/learning-per-sample.md).
    update_mode: UpdateMode = Field(
        default="local",
        description="gradients: average gradients, one step per epoch; local: every peer steps, parameters "
        "averaged each round; diloco: local, then an outer Nesterov step on the averaged parameters",
    )
    target_batch_size: int = Field(
        default=2048,
        ge=1,
        le=10_000_000,
        description="samples per global epoch: a step (gradients) or an averaging round (local, diloco)",
    )
    matchmaking_time: float = Field(
        default=3.0, gt=0, le=600, description="seconds to gather an averaging group"
    )
    # Post-local SGD: more frequent rounds while the peers' models drift apart fastest, rarer ones later.
    # Off by default: it helps in simulation, not in real demos (docs/learning-per-sample.md#what-was-tried).
    early_epochs: int = Field(
        default=0,
        ge=0,
        le=10_000_000,
        description="the first N global epochs use early_target_batch_size and early_matchmaking_time "
        "(local and diloco modes; 0: every epoch uses target_batch_size)",
    )
    early_target_batch_size: int = Field(
        default=512, ge=1, le=10_000_000, description="samples per global epoch during the early epochs"
    )
    early_matchmaking_time: float = Field(
        default=0.5, gt=0, le=600, description="seconds to gather an averaging group during the early epochs"
    )
    averaging_timeout: float = Field(
        default=30.0, gt=0, le=3600, description="seconds an averaging round may take"
    )
    grad_compression: Compression = Field(default="fp16", description="gradient compression on the wire")
    # Parameters travel uncompressed: fp16 rounds every averaged value to 11 significant bits, and rounds
    # come back every few hundred samples, so a LayerNorm gain near 1 (fp16 steps of ~0.001 there) loses
    # every update smaller than that, round after round. Simulated (bench_learning.py --fp16-averaging,
    # rounds of 2 x 256): prompt accuracy 0.902 / 0.824 at 100k samples against 0.945 / 0.977 unrounded.
    state_compression: Compression = Field(
        default="none",
        description="parameter averaging and state download compression (fp16 rounds away small updates)",
    )
    average_state_every: int = Field(
        default=1, ge=1, le=1000, description="average parameters every N epochs"
    )
    use_local_updates: bool = Field(
        default=False,
        description="deprecated, follows update_mode: true when peers step locally (local, diloco); "
        "true on its own selects 'local'",
    )
    outer_lr: float = Field(
        default=0.7,
        gt=0,
        le=10,
        description="diloco: the outer learning rate on the averaged parameters' offset",
    )
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, description="diloco: the outer Nesterov momentum")

    def epoch_target_batch_size(self, epoch: int) -> int:
        """Samples the swarm trains in global epoch ``epoch``."""
        return self.early_target_batch_size if epoch < self.early_epochs else self.target_batch_size

    def epoch_matchmaking_time(self, epoch: int) -> float:
        """Seconds to gather the averaging group that ends global epoch ``epoch``."""
        return self.early_matchmaking_time if epoch < self.early_epochs else self.matchmaking_time

    def samples_at_epoch(self, epoch: float) -> float:
        """Samples the swarm has trained, as planned, when it reaches (possibly fractional) epoch ``epoch``."""
        epoch = max(0.0, epoch)
        early = min(epoch, float(self.early_epochs))
        return early * self.early_target_batch_size + (epoch - early) * self.target_batch_size


class RunCreate(Request):
    name: Name
    task: str = Field(min_length=1, max_length=200)
    task_config: dict[str, object] = Field(default_factory=dict)
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    visibility: Visibility = "open"
    invite_code: str | None = Field(
        default=None,
        min_length=12,
        max_length=200,
        description="the run's invite code if the organizer picks one (at least 12 characters: guesses are "
        "limited per address, not per attacker); omit it for a generated code of 120 random bits",
    )
    data_epochs: int = Field(
        default=1, ge=1, le=100_000, description="passes over the data set before the run finishes"
    )
    description: str = Field(default="", max_length=2000)


SHA256_PATTERN = r"^[0-9a-f]{64}$"

MAX_RUN_FILE_BYTES = 2**40
"""The largest file a run may list (1 TiB); an agent also refuses one beyond its own disk budget."""


class RunFile(Response):
    """A file every peer of a run needs (``tiny-lm``'s text), named by its content.

    The agent fetches it from ``GET /api/v1/runs/{run}/files/{sha256}`` into its own cache, stops at
    ``bytes``, checks the SHA-256 and gives the worker the cached copy; the path in the task config is the
    organizer's and is never opened on a volunteer's computer.
    """

    field: str = Field(max_length=64, description="the task config field that names the file")
    sha256: str = Field(pattern=SHA256_PATTERN)
    bytes: int = Field(ge=0, le=MAX_RUN_FILE_BYTES)


class RunConfigOut(Response):
    """What a worker needs to train: the task, its config and the swarm's optimizer settings."""

    name: str
    task: str
    task_config: dict[str, object]
    optimizer: OptimizerSettings
    hivemind_run_id: str
    files: list[RunFile] = Field(default_factory=list, max_length=64)


class RunStats(Response):
    active_peers: int = 0
    samples_total: int = Field(default=0, description="samples trained, as the peers report them")
    samples_credited: int = Field(default=0, description="samples in the ledger, verified or not")
    samples_verified: int = Field(
        default=0, description="credited samples the swarm's own records confirm (what ends a data epoch)"
    )
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
    files: list[RunFile] = Field(default_factory=list, max_length=64)


# ----------------------------------------------------------------------------------------- sessions
DIRECT, RELAYED, CLIENT = "direct", "relayed", "client"
"""How other peers reach a worker (``PeerAssignment.reachability``): the coordinator decides at join
(``coordinator/reachability.py``), the worker acts on it (``workers/collab.py:build_dht``)."""


class PeerAssignment(Response):
    """Per-peer settings the coordinator derives from the peer's profile and limits."""

    device: Literal["cpu", "cuda"]
    threads: int
    micro_batch_size: int
    accumulation_steps: int = Field(description="micro-batches per hivemind Optimizer.step call")
    client_mode: bool = Field(description="True for peers that cannot accept incoming connections")
    reachability: Literal["direct", "relayed", "client"] = Field(
        default="direct",
        description="direct: other peers dial it; relayed: they dial it through the run's swarm peer (a circuit "
        "relay); client: nobody dials it (it dials others and reduces no parts)",
    )
    reachability_reason: str = Field(default="", max_length=300, description="why, for the volunteer's app")
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
    not_before: float | None = Field(
        default=None,
        description="earliest time the lease may be reported complete (the shard cannot be trained faster); "
        "an earlier report answers 409 lease_too_early with Retry-After",
    )


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
    listen_port: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="the TCP port the worker will listen on; the coordinator dials the caller's address there "
        "and expects dialback_nonce, to tell whether other peers can dial this worker (an unprivileged port: "
        "the dial-back never touches a well-known service)",
    )
    dialback_nonce: str | None = Field(
        default=None, min_length=16, max_length=64, pattern=r"^[A-Za-z0-9_-]+$"
    )


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


class TrainingFigures(BaseModel):
    """The figures of one peer's training, typed once for every hop they make.

    The worker reports them in each ``ProgressEvent`` (``volunteer_app.worker_protocol``, flat), the agent
    keeps them in its ``ContributionState`` (``volunteer_app.control``, which extends this model) and sends
    them in each :class:`HeartbeatRequest` (which extends it too), and the coordinator stores them in the
    session's columns of the same names (``coordinator.sessions``), bounded by what it can check.
    """

    samples_total: int = Field(
        default=0,
        ge=0,
        le=MAX_SAMPLES_TOTAL,
        description="samples this session has processed since it joined",
    )
    samples_per_second: float = Field(default=0.0, ge=0.0, le=1e7)
    loss: float | None = Field(default=None, ge=0.0, le=1e6, description="the running training loss")
    local_epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)
    global_epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)
    swarm_size: int = Field(default=0, ge=0, le=1_000_000)
    averaging_rounds: int = Field(default=0, ge=0, le=MAX_EPOCH)
    bytes_sent: int = Field(default=0, ge=0, le=MAX_COUNT)
    bytes_received: int = Field(default=0, ge=0, le=MAX_COUNT)

    @classmethod
    def of(cls, source: object) -> TrainingFigures:
        """The figures of ``source`` (an event, a state: anything with these attributes); a loss that is not
        a finite number within bounds (a worker whose model went NaN) is reported as none."""
        values = {name: getattr(source, name) for name in TRAINING_FIGURES if hasattr(source, name)}
        loss = values.get("loss")
        if loss is not None and not (isinstance(loss, (int, float)) and 0.0 <= loss <= 1e6):
            values["loss"] = None  # NaN fails both comparisons
        return cls.model_validate(values)

    def figures(self) -> dict[str, Any]:
        """Just the training figures, by name (to build a subclass from, or to update columns with)."""
        return {name: getattr(self, name) for name in TRAINING_FIGURES}


TRAINING_FIGURES: tuple[str, ...] = tuple(TrainingFigures.model_fields)


class HeartbeatRequest(Request, TrainingFigures):
    state: HeartbeatWorkerState


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


UNVERIFIED_REASON_PREFIX = "unverified: "
"""How a :class:`LeaseCompleteResponse` reason starts when it only says that the swarm has not confirmed the
claim yet (the coordinator credits a lease before its swarm peer reads the progress records that confirm it,
and drops the reason once they do): the agent words it as pending, not as a flag."""


class LeaseCompleteResponse(Response):
    lease_id: str
    credited_samples: int
    flagged: bool
    reason: str | None = None
    already_completed: bool = False
    verified: bool = Field(
        default=False, description="the swarm's progress records confirm this peer trained during the lease"
    )
    pending_check: bool = Field(
        default=False, description="picked for a proof-of-training spot check: ranked once it passes"
    )


class LeaseReturnResponse(Response):
    lease_id: str
    state: str = Field(
        description="the lease's state now: returned (or expired, when its deadline had passed)"
    )
    already_returned: bool = False


class LeaseTakeResponse(Response):
    lease: LeaseOut | None
    retry_after: float | None = Field(default=None, description="seconds until work may be available again")
    waiting_for: Literal["confirmation", "shards", "run"] | None = Field(
        default=None,
        description="why there is no lease: the swarm has not yet confirmed this session's completed shards "
        "(confirmation), every shard is taken or awaits confirmation (shards), the run is not active (run)",
    )
    run_state: RunState


class SessionLeaveResponse(Response):
    session_id: str
    state: str
    leases_returned: int


# ----------------------------------------------------------------------------------------- leaderboard
class LeaderboardEntry(Response):
    rank: int
    volunteer: str
    samples: int = Field(description="samples credited, verified or not (failed spot checks removed)")
    verified_samples: int = Field(
        description="samples the swarm's records confirm, including those under check"
    )
    pending_samples: int = Field(default=0, description="verified samples waiting for a spot check")
    unverified_samples: int = Field(
        default=0, description="credited samples the swarm never confirmed: shown apart, never ranked"
    )
    compute_seconds: float
    samples_per_second: float
    last_seen: float | None
    devices: list[str]
    flagged: int = Field(description="ledger entries whose claims were capped or could not be checked")
    online: bool


class Leaderboard(Response):
    """Ranked by settled credit (``verified_samples - pending_samples``), then by name."""

    run: str | None
    entries: list[LeaderboardEntry]
    generated_at: float


class HealthOut(Response):
    status: Literal["ok"]
    version: str
    database: str
    runs_active: int

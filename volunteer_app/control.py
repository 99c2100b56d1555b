"""The agent's control protocol: what UIs (the TUI, the browser view, ``volunteer-app status`` ...) and the
local agent service say to each other, as pydantic models with a version field.

Transport (:mod:`volunteer_app.agent.server`, 127.0.0.1 only unless a flag says otherwise):

* ``WS /api/v1/ws`` -- on connect the agent sends one :class:`SnapshotMessage` with the whole
  :class:`AgentState`, then an :class:`UpdateMessage` whenever top-level fields of the state change
  (each carries the new values of the changed fields), and :class:`LogMessage` for each new log line.
  Clients send :data:`Command` objects (``{"id": "1", "command": "pause"}``); each gets a
  :class:`ResultMessage` or an :class:`ErrorMessage` with the same ``id``. A malformed message gets an
  error reply and the connection stays open. This is the Folding@home v8 client's model.
* ``GET /api/v1/state`` (the snapshot), ``POST /api/v1/commands/<command>?arg=value`` (one command;
  the arguments as query parameters, the answer a :class:`ResultMessage` or :class:`ErrorMessage`
  body), ``GET /api/v1/schema`` (the JSON schema of every message), ``GET /api/v1/health``.

Every request presents ``Authorization: Bearer <control token>`` (the token is in the user's config
dir, mode 0600, created at the agent's first start). Browsers are refused unless their ``Origin`` is the
agent's own (cross-site websocket hijacking), and so are ``Host`` headers that are not the agent's
address (DNS rebinding).

:class:`PolicySettings` are the volunteer's settings (``volunteer-app settings show|set``); they persist
in ``settings.json`` in the config dir and change live.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from volunteer_app.protocol import HardwareProfile, TrainingFigures

PROTOCOL_VERSION = 1

# ----------------------------------------------------------------------------------------- settings
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_TIME = r"(?:[01]?\d|2[0-4]):[0-5]\d"
_WINDOW = re.compile(rf"^(?P<days>[a-z,\-]+)\s+(?P<hours>all|{_TIME}-{_TIME})$")


def _minutes(text: str) -> int:
    hours, minutes = text.split(":")
    value = int(hours) * 60 + int(minutes)
    if value > 24 * 60:
        raise ValueError(f"{text} is not a time of day")
    return value


def parse_days(text: str) -> list[int]:
    """``mon-fri`` / ``sat,sun`` / ``daily`` -> weekday numbers (Monday 0)."""
    if text in ("daily", "all", "every"):
        return list(range(7))
    days: list[int] = []
    for part in text.split(","):
        if "-" in part:
            first, last = part.split("-", 1)
            if first not in DAYS or last not in DAYS:
                raise ValueError(f"unknown day in {part!r} (use {', '.join(DAYS)})")
            start, end = DAYS.index(first), DAYS.index(last)
            span = range(start, end + 1) if start <= end else [*range(start, 7), *range(0, end + 1)]
            days.extend(span)
        elif part in DAYS:
            days.append(DAYS.index(part))
        else:
            raise ValueError(f"unknown day {part!r} (use {', '.join(DAYS)}, ranges like mon-fri, or daily)")
    return sorted(set(days))


def parse_window(text: str) -> tuple[list[int], int, int]:
    """One schedule entry, ``DAYS HH:MM-HH:MM`` or ``DAYS all`` -> (weekdays, start minute, end minute).

    A window whose end is before its start runs past midnight into the next day (``mon-fri 22:00-06:00``).
    """
    match = _WINDOW.match(" ".join(text.lower().split()))
    if match is None:
        raise ValueError(
            f"{text!r} is not a schedule window; write e.g. 'mon-fri 18:00-23:30', 'sat,sun all' or "
            "'daily 22:00-06:00'"
        )
    days = parse_days(match["days"])
    if match["hours"] == "all":
        return days, 0, 24 * 60
    start, end = (_minutes(t) for t in match["hours"].split("-"))
    if start == end:
        raise ValueError(f"{text!r}: a window must not start and end at the same time")
    return days, start, end


class PolicySettings(BaseModel):
    """When and how much this machine may compute. Every field changes live over the control API;
    ``RESTART_FIELDS`` apply when the training worker next starts (the agent restarts it for you)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_threads: int | None = Field(
        default=None, ge=1, le=4096, description="Most CPU threads training may use (None: all cores)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Train on the GPU when there is one (auto), or only on the CPU or GPU."
    )
    max_memory_gb: float | None = Field(
        default=None, gt=0, le=100_000, description="Memory cap; the micro-batch shrinks to fit."
    )
    gpu_suspended: bool = Field(
        default=False,
        description="Suspend GPU work (e.g. while gaming): a worker on the GPU pauses, one on the CPU goes on.",
    )
    gpu_exclusive_apps: list[str] = Field(
        default_factory=list,
        max_length=100,
        description="Suspend GPU work while a program with one of these names runs (e.g. a game).",
    )
    pause_when_cpu_busy_percent: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="Pause while other programs use more than this % of the CPU (None: never).",
    )
    only_when_idle: bool = Field(
        default=False, description="Compute only when the computer is idle (no keyboard/mouse input)."
    )
    idle_minutes: float = Field(
        default=5.0, ge=0, le=24 * 60, description="Minutes without input before the computer counts as idle."
    )
    idle_cpu_percent: float = Field(
        default=15.0,
        gt=0,
        le=100,
        description="Where input idle time is not reported: idle means other programs use less than this %.",
    )
    pause_on_battery: bool = Field(default=True, description="Pause while running on battery.")
    battery_pause_below: float | None = Field(
        default=None, ge=0, le=100, description="Pause when the battery falls below this % (None: never)."
    )
    battery_resume_above: float | None = Field(
        default=None, ge=0, le=100, description="Resume once the battery is above this % again."
    )
    schedule: list[str] = Field(
        default_factory=list,
        max_length=50,
        description="Weekly windows when computing is allowed, e.g. 'mon-fri 18:00-08:00', 'sat,sun all' "
        "(empty: any time).",
    )
    max_cpu_temp_c: float | None = Field(
        default=None, gt=0, le=150, description="Pause above this CPU temperature in °C (None: never)."
    )
    max_gpu_temp_c: float | None = Field(
        default=None, gt=0, le=150, description="Pause GPU work above this GPU temperature in °C."
    )
    temp_resume_margin_c: float = Field(
        default=5.0, ge=0, le=50, description="Resume once this many °C below the limit."
    )
    start_paused: bool = Field(default=False, description="Start the agent paused until you resume.")
    evaluate_every_minutes: float | None = Field(
        default=10.0,
        ge=1,
        le=7 * 24 * 60,
        description="Draw the model's pictures for the model view this often while training (None: on request).",
    )
    remember_quit_choice: Literal["ask", "background", "stop"] = Field(
        default="ask", description="What quitting the terminal UI does: ask, keep contributing, or stop."
    )

    @field_validator("schedule")
    @classmethod
    def _check_schedule(cls, windows: list[str]) -> list[str]:
        cleaned = []
        for window in windows:
            parse_window(window)
            cleaned.append(" ".join(window.lower().split()))
        return cleaned

    @field_validator("gpu_exclusive_apps")
    @classmethod
    def _check_apps(cls, apps: list[str]) -> list[str]:
        cleaned = [a.strip() for a in apps if a.strip()]
        for app in cleaned:
            if len(app) > 200:
                raise ValueError("program names are at most 200 characters")
        return cleaned

    @field_validator("battery_resume_above")
    @classmethod
    def _check_battery(cls, value: float | None, info: Any) -> float | None:
        below = info.data.get("battery_pause_below")
        if value is not None and below is not None and value < below:
            raise ValueError("battery_resume_above must be at least battery_pause_below")
        return value


RESTART_FIELDS = {
    "device": "the worker restarts to move training between the CPU and the GPU",
    "max_memory_gb": "the worker restarts to fit its micro-batch into the new memory cap",
}
"""Settings the running worker cannot take live, and why applying them restarts it."""

_NONE_WORDS = {"none", "off", "null", "never", "unset", "-"}


def parse_setting(key: str, text: str) -> Any:
    """A value typed on the command line (``settings set KEY VALUE``) -> the value for ``key``.

    ``none``/``off`` clear optional numbers; lists take ``;``-separated items (``schedule 'mon-fri
    18:00-23:00; sat,sun all'``); a value in JSON is taken as JSON.
    """
    fields = PolicySettings.model_fields
    if key not in fields:
        raise ValueError(f"unknown setting {key!r}; the settings are: {', '.join(fields)}")
    text = text.strip()
    annotation = str(fields[key].annotation)
    if annotation.startswith("list"):
        if text.startswith("["):
            return json.loads(text)
        return (
            [item.strip() for item in text.split(";") if item.strip()]
            if text.lower() not in _NONE_WORDS
            else []
        )
    if text.lower() in _NONE_WORDS and "None" in annotation:
        return None
    if annotation == "bool" and text.lower() in ("on", "yes", "y", "1", "true"):
        return True
    if annotation == "bool" and text.lower() in ("off", "no", "n", "0", "false"):
        return False
    return text


def validation_problems(exc: ValidationError) -> str:
    """A pydantic error as one readable line: ``max_threads: Input should be greater than or equal to 1``."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "__root__")
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*d)?\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m(?:in)?)?"
                      r"\s*(?:(\d+(?:\.\d+)?)\s*s)?\s*$")  # fmt: skip


def parse_duration(text: str) -> float:
    """``2h``, ``90m``, ``1h30m``, ``45s``, ``1d`` or plain seconds -> seconds."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        match = DURATION.match(text)
        if not text or match is None or not any(match.groups()):
            raise ValueError(f"{text!r} is not a duration; write e.g. 30m, 2h, 1h30m or 1d") from None
        days, hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
        seconds = days * 86400 + hours * 3600 + minutes * 60 + secs
    if not math.isfinite(seconds) or seconds <= 0 or seconds > 365 * 86400:
        raise ValueError("a duration must be positive and at most a year")
    return seconds


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min"
    return f"{seconds} s"


# ----------------------------------------------------------------------------------------- state
WAITING_MESSAGES = {
    "confirmation": "waiting for the swarm to confirm this machine's finished shards before taking more work",
    "shards": "every shard of the run is being trained by someone; waiting for one to come free",
}
"""What the volunteer is told when the coordinator has no lease for it, by the answer's ``waiting_for``
(a paused or finished run is announced on its own)."""


class _State(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SensorReadings(_State):
    """What the agent last read from the machine's sensors; None where the machine does not say."""

    at: float = 0.0
    cpu_percent: float | None = Field(default=None, description="whole machine, % of all cores")
    volunteer_cpu_percent: float | None = Field(default=None, description="this agent and its worker")
    input_idle_seconds: float | None = Field(
        default=None, description="time since the last keyboard/mouse input, where the platform reports it"
    )
    on_battery: bool | None = None
    battery_percent: float | None = None
    cpu_temp_c: float | None = None
    gpu_temps_c: list[float] = Field(default_factory=list)
    gpu_readable: bool = Field(default=False, description="whether GPU sensors could be read (pynvml)")
    exclusive_apps_running: list[str] = Field(default_factory=list)

    @property
    def other_cpu_percent(self) -> float | None:
        if self.cpu_percent is None:
            return None
        return max(0.0, self.cpu_percent - (self.volunteer_cpu_percent or 0.0))


IdleDetection = Literal["off", "input", "load"]


class PolicyMemory(_State):
    """What the policy remembers between decisions (hysteresis), carried from one call to the next."""

    cpu_hot: bool = False
    gpu_hot: bool = False
    battery_low: bool = False
    idle_since: float | None = None


class PolicyDecision(_State):
    """The resource policy's verdict: compute or not (and why not), the GPU, and the limits to apply."""

    compute: bool = True
    reasons: list[str] = Field(default_factory=list, description="why this machine does not compute now")
    gpu_allowed: bool = True
    gpu_reasons: list[str] = Field(default_factory=list)
    threads: int | None = None
    idle_detection: IdleDetection = "off"
    notes: list[str] = Field(default_factory=list, description="what the policy cannot see (absent sensors)")
    memory: PolicyMemory = Field(default_factory=PolicyMemory)


class EvaluationSample(_State):
    """One thing the model made for the model view: a picture for a caption, or a line of text."""

    prompt: str
    kind: Literal["image", "text"] = "image"
    text: str | None = None
    image: dict[str, Any] | None = Field(
        default=None, description="{width, height, pixels: base64 of width*height*3 RGB bytes, top row first}"
    )
    correct: bool | None = None
    error: str | None = None


class Evaluation(_State):
    """The shared model's latest evaluation on this machine (the TUI's model view)."""

    request_id: str | None = None
    at: float
    epoch: int
    metrics: dict[str, float] = Field(default_factory=dict)
    samples: list[EvaluationSample] = Field(default_factory=list)
    peers_averaged: int = Field(
        default=1,
        description="how many peers' parameters the evaluated model is the mean of (1: this peer's own)",
    )


class MetricPoint(_State):
    at: float
    epoch: int
    samples: int
    metrics: dict[str, float]


class ContributionState(_State, TrainingFigures):
    """This agent's contribution to one run (what ``join`` used to show): the training figures the worker
    reports (:class:`~volunteer_app.protocol.TrainingFigures`, for the whole session across worker restarts)
    and the agent's own bookkeeping."""

    coordinator: str
    run: str
    name: str
    state: str = Field(
        default="starting",
        description="a volunteer_app.states.WorkerState, or the agent's own step before the worker trains "
        "(registering, profiling, downloading, joining, restarting) or after (stopped, failed)",
    )
    session_id: str | None = None
    task: str | None = None
    first_loss: float | None = None
    failed_rounds: int = 0
    lease_id: str | None = None
    lease_shard: int | None = None
    lease_samples_done: int = 0
    lease_samples: int = 0
    leases_in_hand: int = 0
    leases_completed: int = 0
    samples_credited: int = 0
    samples_unleased: int = 0
    compute_seconds: float = 0.0
    coordinator_ok: bool = True
    paused_by: str | None = Field(default=None, description="who paused: volunteer, policy, organizers")
    pause_reasons: list[str] = Field(default_factory=list)
    finishing: bool = False
    parameters: int | None = None
    device: str | None = None
    threads: int | None = None
    micro_batch_size: int | None = None
    maddrs: list[str] = Field(default_factory=list)
    reachability: str | None = Field(
        default=None,
        description="how other peers reach this worker: direct, relayed (through the run's swarm peer) or "
        "client (they do not: it dials them); set at join",
    )
    reachability_reason: str | None = Field(default=None, description="why (the coordinator's dial-back)")
    isolated: str | None = Field(
        default=None,
        description="set while the worker has failed several averaging rounds in a row, none done since, with "
        "others in the swarm: its work is not reaching the shared model (why, when known)",
    )
    loaded_state_epoch: int | None = None
    eval_metrics: dict[str, float] = Field(default_factory=dict)
    last_error: str | None = None
    worker_restarts: int = 0
    started_at: float = 0.0
    first_sample_at: float | None = None
    first_round_at: float | None = None
    stop_reason: str | None = None
    restart_pending: str | None = Field(default=None, description="why the worker will restart")
    download: str | None = Field(
        default=None,
        description="the run's file being downloaded and how far, e.g. 'text_path (3.1 MB): 40%'",
    )


AgentStateName = Literal["idle", "joining", "contributing", "paused", "stopping", "stopped"]


class AgentState(_State):
    """Everything a UI shows about the agent: the first websocket message, ``GET /api/v1/state``."""

    version: int = PROTOCOL_VERSION
    agent_version: str
    pid: int
    started_at: float
    state: AgentStateName = "idle"
    config_dir: str
    coordinator: str | None = Field(default=None, description="the coordinator last used")
    run: str | None = Field(default=None, description="the run joined (or last joined)")
    name: str | None = Field(default=None, description="the volunteer name registered at the coordinator")
    settings: PolicySettings = Field(default_factory=PolicySettings)
    paused_by_user: bool = False
    snoozed_until: float | None = None
    policy: PolicyDecision = Field(default_factory=PolicyDecision)
    sensors: SensorReadings = Field(default_factory=SensorReadings)
    profile: HardwareProfile | None = None
    contribution: ContributionState | None = None
    evaluation: Evaluation | None = None
    metric_history: list[MetricPoint] = Field(default_factory=list)
    worker_log: str | None = None


class LogEntry(_State):
    at: float
    level: Literal["debug", "info", "warning", "error"] = "info"
    source: Literal["agent", "worker", "coordinator", "policy"] = "agent"
    message: str


# ----------------------------------------------------------------------------------------- messages
class SnapshotMessage(_State):
    type: Literal["snapshot"] = "snapshot"
    version: int = PROTOCOL_VERSION
    state: AgentState
    log: list[LogEntry] = Field(default_factory=list, description="the most recent log lines")


class UpdateMessage(_State):
    type: Literal["update"] = "update"
    version: int = PROTOCOL_VERSION
    changes: dict[str, Any] = Field(description="new values of the AgentState fields that changed")


class LogMessage(_State):
    type: Literal["log"] = "log"
    version: int = PROTOCOL_VERSION
    entry: LogEntry


class ResultMessage(_State):
    type: Literal["result"] = "result"
    version: int = PROTOCOL_VERSION
    id: str | None = None
    message: str = Field(description="one line for people (what the shell commands print)")
    data: Any = None


class ErrorMessage(_State):
    type: Literal["error"] = "error"
    version: int = PROTOCOL_VERSION
    id: str | None = None
    error: str
    detail: str


ServerMessage = Annotated[
    SnapshotMessage | UpdateMessage | LogMessage | ResultMessage | ErrorMessage, Field(discriminator="type")
]
SERVER_MESSAGES: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


class _Command(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, max_length=100, description="echoed in the reply")


class JoinCommand(_Command):
    """Join a run (registering at the coordinator first if this machine has no credential there)."""

    command: Literal["join"] = "join"
    coordinator: str = Field(min_length=1, max_length=500)
    run: str = Field(min_length=1, max_length=40)
    name: str | None = Field(default=None, max_length=40)
    invite_code: str | None = Field(default=None, max_length=200)
    duration: float | None = Field(default=None, gt=0, description="leave after this many seconds")
    samples: int | None = Field(default=None, gt=0, description="leave after this many samples")
    evaluate_on_leave: bool = False


class LeaveCommand(_Command):
    """Leave the run: finish the current step, return the leases, leave the swarm."""

    command: Literal["leave"] = "leave"


class PauseAgentCommand(_Command):
    command: Literal["pause"] = "pause"


class ResumeAgentCommand(_Command):
    """Resume after a pause, a snooze or a finish."""

    command: Literal["resume"] = "resume"


class FinishCommand(_Command):
    """Complete the current lease, report it, then pause (Folding@home's "finish")."""

    command: Literal["finish"] = "finish"


class SnoozeCommand(_Command):
    """Pause for a while, then resume by itself."""

    command: Literal["snooze"] = "snooze"
    seconds: float = Field(gt=0, le=365 * 86400)


class SettingsCommand(_Command):
    """Change settings (only the keys given); the reply says which need a worker restart."""

    command: Literal["settings"] = "settings"
    values: dict[str, Any] = Field(default_factory=dict)


class ProfileCommand(_Command):
    """Profile the hardware again and re-measure the speed on the run's task."""

    command: Literal["profile"] = "profile"
    speed_test: bool = True


class EvaluateCommand(_Command):
    """Evaluate the current shared model: its metric and drawings of ``prompts`` (default: fixed ones)."""

    command: Literal["evaluate"] = "evaluate"
    prompts: list[str] | None = Field(default=None, max_length=16)


class RunsCommand(_Command):
    """The runs a coordinator offers (the first-run screen's list)."""

    command: Literal["runs"] = "runs"
    coordinator: str = Field(min_length=1, max_length=500)


class StopAgentCommand(_Command):
    """Leave the run, then end the agent service."""

    command: Literal["stop"] = "stop"


class PingCommand(_Command):
    command: Literal["ping"] = "ping"


Command = Annotated[
    JoinCommand
    | LeaveCommand
    | PauseAgentCommand
    | ResumeAgentCommand
    | FinishCommand
    | SnoozeCommand
    | SettingsCommand
    | ProfileCommand
    | EvaluateCommand
    | RunsCommand
    | StopAgentCommand
    | PingCommand,
    Field(discriminator="command"),
]
COMMANDS: TypeAdapter[Command] = TypeAdapter(Command)


def json_schema() -> dict[str, Any]:
    """The JSON schema of every message both ways (``GET /api/v1/schema``)."""
    return {
        "version": PROTOCOL_VERSION,
        "commands": COMMANDS.json_schema(),
        "server_messages": SERVER_MESSAGES.json_schema(),
        "settings": PolicySettings.model_json_schema(),
    }

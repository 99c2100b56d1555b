"""The agent supervisor: the seam between the volunteer's UI and the training worker.

An :class:`Agent` registers with the coordinator (once; the credential is kept in the config dir),
profiles the machine, joins the run, starts the worker process (``python -m workers.worker``) and then
keeps everything going until it is told to stop:

* it heartbeats the worker's progress and forwards the coordinator's commands (pause, resume, stop,
  new peer token) to the worker;
* it keeps the worker stocked with work leases and reports finished ones; reports go through an
  outbox file first, so a coordinator that is down for a while, or an agent that crashes, loses none;
* it survives a coordinator that is unreachable (backoff, the worker keeps training) and a worker that
  crashes (restarted with backoff, its leases handed to the new worker);
* it stops cleanly: the worker finishes its step, leaves the swarm, and the session's unfinished
  leases go back to the queue.

UIs (the CLI's live display, ``--json`` lines, the demo, the TUI) watch :class:`AgentStatus` and the
messages passed to ``on_message``. Nothing here imports torch or hivemind.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import hashlib
import json
import logging
import os
import platform
import random
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from volunteer_app import __version__
from volunteer_app.client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnreachable,
    CredentialStore,
    StoredCredential,
    normalize_url,
)
from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.profile import profile_machine
from volunteer_app.protocol import (
    HardwareProfile,
    HeartbeatRequest,
    JoinRequest,
    JoinResponse,
    LeaseCompleteRequest,
    LeaseOut,
    RegisterRequest,
    RunOut,
    TaskBenchmark,
)
from volunteer_app.tokens import write_private_file
from volunteer_app.worker_protocol import (
    EVENTS,
    AveragedEvent,
    ErrorEvent,
    EvalEvent,
    LeaseCommand,
    LeaseDoneEvent,
    NeedLeaseEvent,
    PauseCommand,
    ProgressEvent,
    ReadyEvent,
    ResumeCommand,
    StateEvent,
    StopCommand,
    StoppedEvent,
    TokenCommand,
    WorkerStart,
    encode,
)

logger = logging.getLogger(__name__)

MAX_LEASES = 2
OFFLINE_LEASE_PREFIX = "offline-"
CLOCK_SKEW_WARNING = 20.0


class AgentError(Exception):
    """The agent cannot go on (banned, the run does not exist, a bad credential store...)."""


@dataclass
class AgentStatus:
    """What a UI shows about one agent. Updated in place by the :class:`Agent`."""

    name: str
    run: str
    coordinator: str
    state: str = "starting"
    session_id: str | None = None
    samples_total: int = 0
    samples_per_second: float = 0.0
    loss: float | None = None
    first_loss: float | None = None
    local_epoch: int = 0
    global_epoch: int = 0
    swarm_size: int = 0
    averaging_rounds: int = 0
    failed_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    lease_samples_done: int = 0
    lease_samples: int = 0
    leases_completed: int = 0
    samples_credited: int = 0
    samples_unleased: int = 0
    compute_seconds: float = 0.0
    coordinator_ok: bool = True
    paused_by: str | None = None
    parameters: int | None = None
    device: str | None = None
    threads: int | None = None
    micro_batch_size: int | None = None
    maddrs: list[str] = field(default_factory=list)
    loaded_state_epoch: int | None = None
    profile: HardwareProfile | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    last_error: str | None = None
    worker_restarts: int = 0
    started_at: float = field(default_factory=time.time)
    first_sample_at: float | None = None
    first_round_at: float | None = None
    stop_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "profile"}
        data["profile"] = self.profile.model_dump(mode="json") if self.profile is not None else None
        return data


async def wait_for_exit(process: asyncio.subprocess.Process, poll: float = 0.2) -> int:
    """The exit status of ``process`` as soon as it has exited.

    ``Process.wait()`` (before Python 3.12) also waits until every pipe is closed, and hivemind helpers
    that a killed worker leaves behind keep its stdout open; the return code is set as soon as the
    child is reaped, so poll that instead.
    """
    while process.returncode is None:
        await asyncio.sleep(poll)
    return process.returncode


def kill_process_group(pgid: int) -> None:
    """Kill what is left of a worker's process group (hivemind helpers orphaned by a crash)."""
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def default_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "volunteer"
    raw = f"{user}-{platform.node().split('.')[0]}"
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", raw).strip("-._")[:40]
    return name or "volunteer"


def backoff(attempt: int, *, base: float = 1.0, cap: float = 60.0) -> float:
    """Exponential backoff with jitter: ~1, 2, 4 ... up to ``cap`` seconds."""
    return min(cap, base * 2 ** min(attempt, 10)) * (0.75 + random.random() * 0.5)


class Outbox:
    """Lease reports waiting to reach the coordinator, kept in a file so that none is lost."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            broken = self.path.with_suffix(".broken")
            self.path.replace(broken)
            logger.warning("the report outbox was damaged; it was kept as %s", broken)
            return []
        return data if isinstance(data, list) else []

    def save(self, items: list[dict[str, Any]]) -> None:
        if not items:
            self.path.unlink(missing_ok=True)
            return
        write_private_file(self.path, json.dumps(items).encode())


class Agent:
    """Contributes this machine to one run until stopped.

    :param settings: the agent's settings (config dir, limits, device, listen address...).
    :param coordinator: the coordinator's URL.
    :param run: the run's name.
    :param name: the volunteer's public name when registering (default: ``user-host``).
    :param duration: stop by itself after this many seconds of training (None: until stopped).
    :param max_samples: stop by itself once the worker has trained this many samples.
    :param evaluate_on_stop: have the worker evaluate the model before it exits (the demo's summary).
    :param on_message: called with one-line messages worth showing (joined, credited, reconnecting...).
    """

    def __init__(
        self,
        *,
        settings: Any,
        coordinator: str,
        run: str,
        name: str | None = None,
        duration: float | None = None,
        max_samples: int | None = None,
        evaluate_on_stop: bool = False,
        evaluate_max_samples: int | None = None,
        on_message: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self.coordinator = normalize_url(coordinator)
        self.run_name = run
        self.name = name or settings.name or default_name()
        self.duration = duration
        self.max_samples = max_samples
        self.evaluate_on_stop = evaluate_on_stop
        self.evaluate_max_samples = evaluate_max_samples
        self.on_message = on_message or (lambda _message: None)
        # how long to wait for the run's swarm address after joining (below the coordinator's session timeout)
        self.swarm_wait = 60.0
        self.status = AgentStatus(name=self.name, run=run, coordinator=self.coordinator)
        self._stop = asyncio.Event()
        self._client: CoordinatorClient | None = None
        self._join: JoinResponse | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._outstanding: dict[str, LeaseOut] = {}
        self._leases_wanted = asyncio.Event()
        self._progress: ProgressEvent | None = None
        self._paused_by_coordinator = False
        self._paused_by_user = False
        self._worker_exit: asyncio.Future[int] | None = None
        self._outbox = Outbox(settings.config_dir / "outbox.json")
        self._rejoin = False
        self._training_started: float | None = None
        self._samples_base = 0
        self._offline_lease_pending = False
        self._compute_base = 0.0

    # ------------------------------------------------------------------ public
    def request_stop(self, reason: str = "stopped by the volunteer") -> None:
        if not self._stop.is_set():
            self.status.stop_reason = self.status.stop_reason or reason
            self._stop.set()

    async def pause(self) -> None:
        """Pause on the volunteer's request (the UI's pause button)."""
        self._paused_by_user = True
        self.status.paused_by = "volunteer"
        await self._send(PauseCommand())

    async def resume(self) -> None:
        self._paused_by_user = False
        if not self._paused_by_coordinator:
            self.status.paused_by = None
            await self._send(ResumeCommand())

    async def run(self) -> AgentStatus:
        """Register, profile, join and train until stopped; returns the final status."""
        self.settings.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            credential = await self._register()
            self._client = CoordinatorClient(self.coordinator, credential=credential.credential)
            run = await self._retry("reach the coordinator", lambda: self._client_().get_run(self.run_name))
            await self._check_clock()
            profile = await self._profile(run)
            self.status.profile = profile
            await self._flush_outbox()
            while not self._stop.is_set():
                self._rejoin = False
                self._join = await self._join_run(profile)
                if self._join is None:
                    break
                await self._await_swarm_address()
                await self._supervise()
                if not self._rejoin:
                    break
                self.on_message("the coordinator ended this session; joining again")
        except AgentError as exc:
            if not self._stop.is_set():  # a stop while still connecting is not a failure
                self.status.state = "failed"
                self.status.last_error = str(exc)
                raise
        finally:
            await self._shutdown()
        self.status.state = "stopped"
        return self.status

    # ------------------------------------------------------------------ setup
    def _client_(self) -> CoordinatorClient:
        assert self._client is not None
        return self._client

    async def _retry(self, what: str, call: Callable[[], Any]) -> Any:
        attempt = 0
        while True:
            try:
                result = await call()
                if not self.status.coordinator_ok:
                    self.on_message("the coordinator is reachable again")
                self.status.coordinator_ok = True
                return result
            except CoordinatorUnreachable as exc:
                self.status.coordinator_ok = False
                delay = backoff(attempt)
                self.status.last_error = str(exc)
                self.on_message(f"cannot {what} ({exc}); retrying in {delay:.0f} s")
                attempt += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                if self._stop.is_set():
                    raise AgentError(f"stopped while trying to {what}") from exc
            except CoordinatorRefused as exc:
                if exc.status == 404 and exc.code == "run_not_found":
                    raise AgentError(f"the coordinator has no run named {self.run_name!r}") from exc
                raise

    async def _register(self) -> StoredCredential:
        store = CredentialStore(self.settings.credentials_path)
        try:
            stored = store.get(self.coordinator)
        except Exception as exc:
            raise AgentError(str(exc)) from exc
        if stored is not None:
            self.name = self.status.name = stored.name
            return stored
        self.status.state = "registering"
        client = CoordinatorClient(self.coordinator)
        try:
            request = RegisterRequest(name=self.name, invite_code=self.settings.invite_code)
            try:
                answer = await self._retry("register", lambda: client.register(request))
            except CoordinatorRefused as exc:
                if exc.code == "name_taken":
                    raise AgentError(
                        f"the name {self.name!r} is taken on this coordinator; choose another with --name"
                    ) from exc
                raise AgentError(f"registration refused: {exc.detail}") from exc
        except ValidationError as exc:
            raise AgentError(
                f"invalid volunteer name {self.name!r}: use letters, digits, '_', '.', '-' (at most 40)"
            ) from exc
        finally:
            await client.aclose()
        stored = StoredCredential(self.coordinator, answer.volunteer_id, answer.name, answer.credential)
        store.put(stored)
        self.on_message(f"registered as {answer.name}; the credential is in {self.settings.credentials_path}")
        return stored

    async def _check_clock(self) -> None:
        with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused):
            skew = await self._client_().server_time() - time.time()
            if abs(skew) > CLOCK_SKEW_WARNING:
                self.on_message(
                    f"this computer's clock is {skew:+.0f} s off the coordinator's; peers refuse requests more than "
                    "60 s off, so please synchronize the clock (NTP)"
                )

    async def _profile(self, run: RunOut) -> HardwareProfile:
        self.status.state = "profiling"
        base = profile_machine(accepts_connections=self.settings.accepts_connections)
        benchmark = None
        if self.settings.benchmark_seconds > 0:
            benchmark = await benchmark_task(
                run=run, profile=base, settings=self.settings, on_message=self.on_message
            )
        return base.model_copy(update={"benchmark": benchmark})

    async def _join_run(self, profile: HardwareProfile) -> JoinResponse | None:
        self.status.state = "joining"
        key_path = self.key_path()
        public_key = public_key_openssh(ensure_rsa_key(key_path))
        request = JoinRequest(
            profile=profile,
            agent_version=__version__,
            peer_public_key=public_key,
            invite_code=self.settings.invite_code,
            max_threads=self.settings.max_threads,
            device=self.settings.device,
        )
        attempt = 0
        while not self._stop.is_set():
            try:
                answer: JoinResponse = await self._retry(
                    "join", lambda: self._client_().join(self.run_name, request)
                )
            except CoordinatorRefused as exc:
                if exc.code in ("run_paused", "rate_limited"):
                    delay = 60.0 if exc.code == "run_paused" else backoff(attempt, base=5.0)
                    attempt += 1
                    self.status.state = "waiting"
                    self.on_message(f"{exc.detail}; trying again in {delay:.0f} s")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), timeout=delay)
                    continue
                if exc.code == "run_finished":
                    self.status.stop_reason = exc.detail
                    self.on_message(exc.detail)
                    return None
                if exc.code == "invalid_credential" and attempt == 0:
                    # the coordinator no longer knows this credential (its store was reset): register again
                    attempt += 1
                    CredentialStore(self.settings.credentials_path).forget(self.coordinator)
                    self.on_message(
                        "the coordinator does not know this machine's credential; registering again"
                    )
                    stored = await self._register()
                    self._client_().credential = stored.credential
                    continue
                raise AgentError(f"the coordinator refused to let this machine join: {exc.detail}") from exc
            self.status.session_id = answer.session_id
            self._outstanding = {}
            if answer.lease is not None:
                self._outstanding[answer.lease.lease_id] = answer.lease
            a = answer.assignment
            self.on_message(
                f"joined run {self.run_name} as {self.name} (session {answer.session_id[:8]}): {a.device}, "
                f"{a.threads} thread(s), micro-batch {a.micro_batch_size}{', client mode' if a.client_mode else ''}"
            )
            return answer
        return None

    async def _await_swarm_address(self) -> None:
        """Make sure the worker knows where the run's swarm is before it starts.

        The coordinator's swarm peer publishes its address a few seconds after ``serve`` (re)starts; a
        worker started without it would train alone in a swarm of its own, never averaging with anyone.
        So wait for the address (bounded: a coordinator without swarm peers still lets us train).
        """
        assert self._join is not None
        if self._join.initial_peers:
            return
        self.status.state = "waiting"
        self.on_message("the run's swarm peer is starting; waiting for its address")
        deadline = time.monotonic() + self.swarm_wait
        while not self._stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)
            if not self._stop.is_set() and await self._refresh_swarm_address():
                self.on_message("found the run's swarm")
                return
        if not self._stop.is_set():
            self.on_message(
                f"the coordinator gave no swarm address in {self.swarm_wait:.0f} s; training without a swarm "
                "until the next rejoin"
            )

    async def _refresh_swarm_address(self) -> bool:
        """Take the swarm's current address into the join answer (the coordinator's swarm peer may have
        moved, e.g. after a ``serve`` restart); keep the old one when the coordinator cannot say.
        Returns whether the worker now has an address to bootstrap from."""
        if self._join is None or self._client is None:
            return False
        try:
            run = await asyncio.wait_for(self._client.get_run(self.run_name), timeout=15)
        except (CoordinatorUnreachable, CoordinatorRefused, asyncio.TimeoutError):
            return bool(self._join.initial_peers)
        if run.initial_peers and run.initial_peers != self._join.initial_peers:
            self._join = self._join.model_copy(update={"initial_peers": run.initial_peers})
        return bool(self._join.initial_peers)

    def key_path(self) -> Path:
        host = re.sub(r"[^A-Za-z0-9.\-]", "_", self.coordinator.split("://", 1)[1])
        return self.settings.keys_dir / f"{host}-{self.run_name}.rsa"

    # ------------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        tasks = [
            asyncio.create_task(self._heartbeats(), name="heartbeats"),
            asyncio.create_task(self._lease_keeper(), name="leases"),
        ]
        if self.duration is not None:
            tasks.append(asyncio.create_task(self._stop_after_duration(), name="duration"))
        restarts: list[float] = []
        try:
            while not self._stop.is_set() and not self._rejoin:
                code = await self._run_worker()
                if self._stop.is_set() or self._rejoin:
                    break
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < 3600] + [now]
                self.status.worker_restarts += 1
                if len(restarts) > self.settings.worker_restarts:
                    raise AgentError(
                        f"the training worker keeps failing (exit status {code}); see {self.worker_log()} and "
                        f"the last error: {self.status.last_error}"
                    )
                delay = backoff(len(restarts) - 1)
                self.on_message(
                    f"the training worker exited with status {code}; restarting it in {delay:.0f} s"
                )
                self.status.state = "restarting"
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                await self._refresh_swarm_address()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_after_duration(self) -> None:
        assert self.duration is not None
        while self._training_started is None:
            await asyncio.sleep(0.2)
        remaining = self.duration - (time.monotonic() - self._training_started)
        await asyncio.sleep(max(0.0, remaining))
        self.request_stop(f"ran for the requested {self.duration:.0f} s")

    def worker_log(self) -> Path:
        return self.settings.logs_dir / f"worker-{self.run_name}.log"

    async def _run_worker(self) -> int:
        """Start the worker with the current join answer and leases; return its exit status."""
        assert self._join is not None
        self.status.state = "starting"
        leases = list(self._outstanding.values())
        join = self._join.model_copy(update={"lease": leases[0] if leases else None})
        start = WorkerStart(
            join=join,
            peer_key_path=str(self.key_path()),
            listen_host=self.settings.listen_host,
            announce_host=self.settings.announce_host,
            max_memory_bytes=int(self.settings.max_memory_gb * 2**30)
            if self.settings.max_memory_gb
            else None,
            evaluate_on_stop=self.evaluate_on_stop,
            evaluate_max_samples=self.evaluate_max_samples,
            log_level=self.settings.log_level,
        )
        log_path = self.worker_log()
        log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if log_path.exists() and log_path.stat().st_size > 10 * 2**20:
            log_path.replace(log_path.with_suffix(".log.1"))
        env = dict(os.environ)
        env.setdefault("HIVEMIND_LOGLEVEL", self.settings.log_level.upper())
        with open(log_path, "ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=env, start_new_session=True, limit=2**20,
            )  # fmt: skip
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(encode(start).encode())
        for lease in leases[1:]:
            process.stdin.write(encode(LeaseCommand(lease=lease)).encode())
        if self._paused_by_user or self._paused_by_coordinator:
            process.stdin.write(encode(PauseCommand()).encode())
        await process.stdin.drain()
        stop_task = asyncio.create_task(self._stop_worker_when_asked(process))
        reader = asyncio.create_task(self._read_events(process.stdout))
        try:
            code = await wait_for_exit(process)
            # the worker's forked helpers may still hold the pipe open: drain what is there, then move on
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), timeout=2.0)
        finally:
            for task in (stop_task, reader):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            kill_process_group(process.pid)
        self._process = None
        # a restarted worker counts from zero again; keep the session's totals growing
        self._samples_base = self.status.samples_total
        self._compute_base = self.status.compute_seconds
        self._progress = None
        return code

    async def _read_events(self, stream: asyncio.StreamReader) -> None:
        while True:
            line = await stream.readline()
            if not line:
                return
            await self._handle_event(line)

    async def _stop_worker_when_asked(self, process: asyncio.subprocess.Process) -> None:
        while not self._stop.is_set() and not self._rejoin:
            await asyncio.sleep(0.2)
        self.status.state = "stopping"
        await self._send(StopCommand(evaluate=self.evaluate_on_stop))
        grace = 180.0 if self.evaluate_on_stop else 60.0
        try:
            await asyncio.wait_for(wait_for_exit(process), timeout=grace)
        except asyncio.TimeoutError:
            self.on_message("the worker did not stop in time; terminating it")
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(wait_for_exit(process), timeout=15)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()

    async def _send(self, command: Any) -> None:
        process = self._process
        if process is None or process.stdin is None or process.returncode is not None:
            return
        try:
            process.stdin.write(encode(command).encode())
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass

    async def _handle_event(self, line: bytes) -> None:
        try:
            event = EVENTS.validate_json(line)
        except ValidationError:
            logger.warning("ignoring a malformed worker event: %r", line[:200])
            return
        s = self.status
        if isinstance(event, StateEvent):
            s.state = event.state
            if event.detail:
                self.on_message(event.detail)
        elif isinstance(event, ReadyEvent):
            s.parameters, s.device, s.threads = event.parameters, event.device, event.threads
            s.micro_batch_size = event.micro_batch_size
            s.maddrs, s.loaded_state_epoch = event.maddrs, event.loaded_state_epoch
            if self._training_started is None:
                self._training_started = time.monotonic()
            loaded = (
                f", loaded the swarm's state at epoch {event.loaded_state_epoch}"
                if event.loaded_state_epoch
                else ""
            )
            self.on_message(
                f"worker ready: {event.parameters / 1e6:.2f}M parameters on {event.device}{loaded}"
            )
        elif isinstance(event, ProgressEvent):
            self._progress = event
            if event.samples_total > 0 and s.first_sample_at is None:
                s.first_sample_at = time.time()
            if event.loss is not None and s.first_loss is None:
                s.first_loss = event.loss
            s.samples_total = self._samples_base + event.samples_total
            if self.max_samples is not None and s.samples_total >= self.max_samples:
                self.request_stop(f"trained the requested {self.max_samples} samples")
            s.samples_per_second, s.loss = event.samples_per_second, event.loss
            s.local_epoch, s.global_epoch, s.swarm_size = (
                event.local_epoch,
                event.global_epoch,
                event.swarm_size,
            )
            s.averaging_rounds, s.failed_rounds = event.averaging_rounds, event.failed_rounds
            s.bytes_sent, s.bytes_received = event.bytes_sent, event.bytes_received
            s.lease_samples_done, s.lease_samples = event.lease_samples_done, event.lease_samples
            s.compute_seconds = self._compute_base + event.compute_seconds
        elif isinstance(event, AveragedEvent):
            if event.ok and event.group_bytes > 0 and s.first_round_at is None:
                s.first_round_at = time.time()
        elif isinstance(event, LeaseDoneEvent):
            if event.lease_id.startswith(OFFLINE_LEASE_PREFIX):
                self._offline_lease_pending = False
                s.samples_unleased += event.samples
            else:
                self._outstanding.pop(event.lease_id, None)
                await self._report_lease(event)
            self._leases_wanted.set()
        elif isinstance(event, NeedLeaseEvent):
            self._leases_wanted.set()
        elif isinstance(event, EvalEvent):
            s.eval_metrics = event.metrics
            shown = ", ".join(f"{k} {v:.3f}" for k, v in event.metrics.items())
            self.on_message(f"evaluation at epoch {event.epoch}: {shown}")
        elif isinstance(event, ErrorEvent):
            s.last_error = event.message
            self.on_message(("fatal: " if event.fatal else "") + event.message)
        elif isinstance(event, StoppedEvent):
            s.samples_total = self._samples_base + event.samples_total

    # ------------------------------------------------------------------ coordinator traffic
    async def _heartbeats(self) -> None:
        assert self._join is not None
        attempt = 0
        interval = self._join.heartbeat_interval
        while not self._stop.is_set():
            progress = self._progress
            state = self.status.state
            worker_state = (
                state if state in ("syncing", "training", "paused", "waiting", "stopping") else "starting"
            )
            report = HeartbeatRequest(
                state=worker_state,  # type: ignore[arg-type]
                samples_total=self.status.samples_total,
                samples_per_second=progress.samples_per_second if progress else 0.0,
                loss=progress.loss if progress and progress.loss is not None and progress.loss >= 0 else None,
                local_epoch=progress.local_epoch if progress else 0,
                global_epoch=progress.global_epoch if progress else 0,
                swarm_size=progress.swarm_size if progress else 0,
                averaging_rounds=progress.averaging_rounds if progress else 0,
                bytes_sent=progress.bytes_sent if progress else 0,
                bytes_received=progress.bytes_received if progress else 0,
            )
            try:
                answer = await self._client_().heartbeat(self._join.session_id, report)
                attempt = 0
                if not self.status.coordinator_ok:
                    self.on_message("the coordinator is reachable again")
                self.status.coordinator_ok = True
                interval = answer.next_heartbeat
                await self._apply_commands(answer.commands)
                await self._flush_outbox()
            except CoordinatorUnreachable as exc:
                self.status.coordinator_ok = False
                interval = backoff(attempt, base=2.0)
                attempt += 1
                self.status.last_error = str(exc)
                if attempt in (1, 5) or attempt % 20 == 0:
                    self.on_message(f"{exc}; training goes on, reports are kept and sent later")
            except CoordinatorRefused as exc:
                await self._refused(exc)
                if self._stop.is_set() or self._rejoin:
                    return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=interval)

    async def _refused(self, exc: CoordinatorRefused) -> None:
        if exc.status == 429:
            return
        if exc.code in ("session_ended", "session_not_found"):
            self._rejoin = True
            return
        self.status.stop_reason = exc.detail
        self.on_message(f"the coordinator stopped this agent: {exc.detail}")
        self.request_stop(exc.detail)

    async def _apply_commands(self, commands: list[Any]) -> None:
        assert self._join is not None
        for command in commands:
            if command.type == "pause":
                self._paused_by_coordinator = True
                self.status.paused_by = "organizers"
                self.on_message(command.reason or "paused by the organizers")
                await self._send(PauseCommand())
            elif command.type == "resume":
                self._paused_by_coordinator = False
                self.on_message(command.reason or "resumed by the organizers")
                if not self._paused_by_user:
                    self.status.paused_by = None
                    await self._send(ResumeCommand())
            elif command.type == "stop":
                self.on_message(command.reason or "the run has finished")
                self.request_stop(command.reason or "the run has finished")
            elif command.type == "new_token" and command.peer_token:
                self._join = self._join.model_copy(update={"peer_token": command.peer_token})
                await self._send(TokenCommand(peer_token=command.peer_token))

    async def _lease_keeper(self) -> None:
        """Keep the worker stocked with up to two leases (the current one and the next)."""
        assert self._join is not None
        self._leases_wanted.set()
        while not self._stop.is_set():
            await self._leases_wanted.wait()
            self._leases_wanted.clear()
            while len(self._outstanding) < MAX_LEASES and not self._stop.is_set():
                try:
                    answer = await self._client_().take_lease(self._join.session_id)
                except CoordinatorUnreachable:
                    if not self._outstanding and not self._offline_lease_pending:
                        await self._send_offline_lease()
                    await asyncio.sleep(backoff(1, base=2.0))
                    self._leases_wanted.set()
                    break
                except CoordinatorRefused as exc:
                    if exc.code == "too_many_leases":
                        break
                    await self._refused(exc)
                    return
                if answer.lease is None:
                    if answer.run_state == "finished":
                        self.request_stop("the run has finished")
                        return
                    await asyncio.sleep(answer.retry_after or 30.0)
                    self._leases_wanted.set()
                    break
                self._outstanding[answer.lease.lease_id] = answer.lease
                await self._send(LeaseCommand(lease=answer.lease))

    async def _send_offline_lease(self) -> None:
        """The coordinator is unreachable and the worker ran out of leased work: give it an unleased shard
        (chosen by the worker) so that the swarm keeps this peer's compute. Unleased work is not credited."""
        lease = LeaseOut(
            lease_id=f"{OFFLINE_LEASE_PREFIX}{uuid.uuid4().hex[:12]}",
            shard=-1,
            data_epoch=0,
            samples=0,
            seed=random.randrange(2**31),
            issued_at=time.time(),
            deadline=time.time() + 3600,
        )
        self._offline_lease_pending = True
        if self.status.samples_unleased == 0:
            self.on_message(
                "the coordinator is unreachable: training on unleased data (not credited) until it is back"
            )
        await self._send(LeaseCommand(lease=lease))

    async def _report_lease(self, event: LeaseDoneEvent) -> None:
        assert self._join is not None
        items = self._outbox.load()
        items.append(
            {
                "coordinator": self.coordinator,
                "session_id": self._join.session_id,
                "lease_id": event.lease_id,
                "samples": event.samples,
                "compute_seconds": event.compute_seconds,
                "loss": event.loss if event.loss is not None and event.loss >= 0 else None,
            }
        )
        self._outbox.save(items)
        await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        items = self._outbox.load()
        if not items or self._client is None:
            return
        kept = []
        for item in items:
            if item.get("coordinator") != self.coordinator:
                kept.append(item)
                continue
            try:
                answer = await self._client.complete_lease(
                    item["session_id"],
                    item["lease_id"],
                    LeaseCompleteRequest(
                        samples=item["samples"],
                        compute_seconds=item["compute_seconds"],
                        loss=item.get("loss"),
                    ),
                )
            except CoordinatorUnreachable:
                kept.append(item)
                continue
            except CoordinatorRefused as exc:
                self.on_message(f"lease {item['lease_id'][:8]} was not credited: {exc.detail}")
                continue
            if not answer.already_completed:
                self.status.leases_completed += 1
                self.status.samples_credited += answer.credited_samples
                note = f" (flagged: {answer.reason})" if answer.flagged and answer.reason else ""
                self.on_message(
                    f"lease {answer.lease_id[:8]} credited: {answer.credited_samples} samples{note}"
                )
        self._outbox.save(kept)

    async def _shutdown(self) -> None:
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
        if self._client is not None:
            with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused):
                await asyncio.wait_for(self._flush_outbox(), timeout=15)
            if self._join is not None:
                with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused, asyncio.TimeoutError):
                    await asyncio.wait_for(self._client.leave(self._join.session_id), timeout=10)
            await self._client.aclose()


async def benchmark_task(
    *, run: RunOut, profile: HardwareProfile, settings: Any, on_message: Callable[[str], None]
) -> TaskBenchmark | None:
    """Measure the run's training step on this machine in a worker subprocess (cached per machine/config)."""
    use_gpu = bool(profile.gpus) and settings.device in ("auto", "cuda")
    device = "cuda" if use_gpu else "cpu"
    threads = (
        profile.cpu_cores if settings.max_threads is None else min(profile.cpu_cores, settings.max_threads)
    )
    threads = 2 if use_gpu else max(1, threads)
    micro = 64 if use_gpu else 16
    key_source = json.dumps(
        [
            run.task,
            run.task_config,
            device,
            threads,
            micro,
            profile.cpu_model,
            profile.torch,
            [g.name for g in profile.gpus],
        ],
        sort_keys=True,
        default=str,
    )
    key = hashlib.sha256(key_source.encode()).hexdigest()[:24]
    cache_path = settings.config_dir / "benchmarks.json"
    cache: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        cache = json.loads(cache_path.read_text())
    if isinstance(cache, dict) and key in cache:
        with contextlib.suppress(ValidationError):
            return TaskBenchmark.model_validate(cache[key])
    on_message(f"measuring this machine on {run.task} for {settings.benchmark_seconds:.0f} s...")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.bench", "--task", run.task, "--config", json.dumps(run.task_config),
        "--threads", str(threads), "--device", device, "--micro-batch", str(micro),
        "--seconds", str(settings.benchmark_seconds),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=settings.benchmark_seconds + 120)
    except asyncio.TimeoutError:
        process.kill()
        on_message("the benchmark took too long; joining without it")
        return None
    if process.returncode != 0:
        on_message(
            f"the benchmark failed ({err.decode(errors='replace').strip()[-200:]}); joining without it"
        )
        return None
    try:
        result = TaskBenchmark.model_validate_json(out.decode().strip().splitlines()[-1])
    except (ValidationError, IndexError):
        on_message("the benchmark printed nothing usable; joining without it")
        return None
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = result.model_dump(mode="json")
    with contextlib.suppress(OSError):
        write_private_file(cache_path, json.dumps(cache, indent=2).encode())
    on_message(f"this machine trains {run.task} at {result.samples_per_second:.0f} samples/s")
    return result

"""The agent service: one long-lived process per user that owns this machine's contribution.

Like the Folding@home v8 client or BOINC's client, the agent outlives its UIs: the terminal UI, the
browser view and the shell commands attach to it over the control API (:mod:`volunteer_app.agent.server`),
steer it and detach, while training goes on. It composes:

* the :class:`~volunteer_app.agent.contribution.Contribution` to the run joined (at most one at a time);
* the resource policy (:func:`~volunteer_app.agent.policy.decide`) fed by the
  :class:`~volunteer_app.agent.sensors.Sensors` every ``policy_interval`` seconds and after every
  command, applied to the worker (pause with the reasons, or resume);
* the volunteer's settings (``settings.json``) and what it must remember across restarts (the run it
  contributes to, a pause, a snooze: ``agent-memory.json``), both in the config dir;
* the one-agent-per-user lock and the state file that tells UIs where the agent listens.

Its whole state is one :class:`~volunteer_app.control.AgentState`; the server sends it on connect and
then the fields that changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from volunteer_app import __version__
from volunteer_app.agent.clock import Clock, SystemClock
from volunteer_app.agent.contribution import AgentError, Contribution
from volunteer_app.agent.policy import decide
from volunteer_app.agent.sensors import Sensors
from volunteer_app.agentfiles import (
    AgentAlreadyRunning,
    AgentLock,
    load_policy,
    read_location,
    save_policy,
)
from volunteer_app.client import CoordinatorClient, CoordinatorRefused, CoordinatorUnreachable, normalize_url
from volunteer_app.control import (
    RESTART_FIELDS,
    AgentState,
    Command,
    ContributionState,
    EvaluateCommand,
    FinishCommand,
    JoinCommand,
    LeaveCommand,
    LogEntry,
    MetricPoint,
    PauseAgentCommand,
    PingCommand,
    PolicyDecision,
    PolicyMemory,
    PolicySettings,
    ProfileCommand,
    ResultMessage,
    ResumeAgentCommand,
    RunsCommand,
    SensorReadings,
    SettingsCommand,
    SnoozeCommand,
    StopAgentCommand,
    format_duration,
    validation_problems,
)
from volunteer_app.control_client import ControlError
from volunteer_app.profile import profile_machine
from volunteer_app.safetext import clean
from volunteer_app.settings import AgentSettings
from volunteer_app.tokens import write_private_file

logger = logging.getLogger(__name__)

LOG_LINES = 500
MAX_LOG_CHARS = 2000
METRIC_HISTORY = 500


class CommandError(ControlError):
    """A command the agent cannot carry out; the reply is ``{"type": "error", "error": code, ...}``. It is a
    :class:`~volunteer_app.control_client.ControlError`, what a client of the agent sees, so an in-process
    client (``LocalConnection``) gets the same error as a remote one."""


class AgentMemory(BaseModel):
    """What the agent remembers across restarts (``agent-memory.json``)."""

    coordinator: str | None = None
    run: str | None = None
    name: str | None = None
    joined: bool = False
    paused_by_user: bool = False
    snoozed_until: float | None = None


# ----------------------------------------------------------------------------------------- hub
class Subscriber:
    """One attached UI: the changes and log lines it has not been sent yet (coalesced, bounded)."""

    def __init__(self) -> None:
        self.changes: dict[str, Any] = {}
        self.log: deque[LogEntry] = deque(maxlen=200)
        self.ready = asyncio.Event()

    def take(self) -> tuple[dict[str, Any], list[LogEntry]]:
        changes, self.changes = self.changes, {}
        log = list(self.log)
        self.log.clear()
        self.ready.clear()
        return changes, log


@dataclass
class Published:
    snapshot: dict[str, Any]


class StateHub:
    """Keeps the last published state field by field and hands each subscriber what changed since."""

    def __init__(self, state: AgentState):
        self.state = state
        self._published: dict[str, Any] = state.model_dump(mode="json")
        self.subscribers: set[Subscriber] = set()
        self.log: deque[LogEntry] = deque(maxlen=LOG_LINES)

    def snapshot(self) -> dict[str, Any]:
        return self._published

    def publish(self) -> dict[str, Any]:
        """Diff the state against what was last published; queue the changed fields for every subscriber."""
        current = self.state.model_dump(mode="json")
        changes = {k: v for k, v in current.items() if self._published.get(k) != v}
        if changes:
            self._published = current
            for subscriber in self.subscribers:
                subscriber.changes.update(changes)
                subscriber.ready.set()
        return changes

    def add_log(self, entry: LogEntry) -> None:
        self.log.append(entry)
        for subscriber in self.subscribers:
            subscriber.log.append(entry)
            subscriber.ready.set()

    def subscribe(self) -> Subscriber:
        subscriber = Subscriber()
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)


# ----------------------------------------------------------------------------------------- service
class AgentService:
    """The agent: owns the contribution, applies the policy, answers commands.

    :param settings: program settings (config dir, network, ports).
    :param clock: time for the policy, snoozes and everything below.
    :param sensors: the machine's sensors (a real :class:`Sensors` by default).
    :param policy_interval: seconds between sensor readings.
    """

    def __init__(
        self,
        *,
        settings: AgentSettings,
        clock: Clock | None = None,
        sensors: Any = None,
        policy_interval: float = 5.0,
        publish_interval: float = 0.5,
    ):
        self.settings = settings
        self.clock = clock or SystemClock()
        self.policy_interval = policy_interval
        self.publish_interval = publish_interval
        self._sensors = sensors
        self.stop_event = asyncio.Event()
        self.contribution: Contribution | None = None
        self._contribution_task: asyncio.Task[Any] | None = None
        self._memory_policy = PolicyMemory()
        self._readings = SensorReadings()
        self._lock = AgentLock(settings.agent_lock_path)
        self._command_lock = asyncio.Lock()
        self._commands: set[asyncio.Future[ResultMessage]] = set()
        self._last_auto_eval = 0.0
        self._stopping = False
        # False for `join --foreground`: the run joined is not rejoined when an agent next starts
        self.remember_run = True
        settings.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        policy, problem = load_policy(settings)
        self.memory = self._load_memory()
        self.state = AgentState(
            agent_version=__version__,
            pid=os.getpid(),
            started_at=self.clock.time(),
            config_dir=str(settings.config_dir),
            settings=policy,
            coordinator=self.memory.coordinator,
            run=self.memory.run,
            name=self.memory.name,
            paused_by_user=self.memory.paused_by_user or policy.start_paused,
            snoozed_until=self.memory.snoozed_until,
        )
        self.hub = StateHub(self.state)
        if problem:
            self.log(problem, level="warning")

    # ------------------------------------------------------------------ memory
    def _load_memory(self) -> AgentMemory:
        path = self.settings.memory_path
        with contextlib.suppress(OSError, ValueError, ValidationError):
            return AgentMemory.model_validate_json(path.read_text())
        return AgentMemory()

    def _save_memory(self) -> None:
        self.memory.paused_by_user = self.state.paused_by_user
        self.memory.snoozed_until = self.state.snoozed_until
        with contextlib.suppress(OSError):
            write_private_file(self.settings.memory_path, self.memory.model_dump_json(indent=2).encode())

    # ------------------------------------------------------------------ log
    def log(self, message: str, *, level: str = "info", source: str = "agent") -> None:
        """Log a line for the volunteer's UIs; it often quotes a coordinator, so it is made plain text first."""
        message = clean(message)[:MAX_LOG_CHARS]
        entry = LogEntry(at=self.clock.time(), level=level, source=source, message=message)  # type: ignore[arg-type]
        getattr(logger, level if level != "warning" else "warning")(message)
        self.hub.add_log(entry)

    def _contribution_message(self, text: str) -> None:
        lowered = text.lower()
        level = "error" if lowered.startswith("fatal") else (
            "warning" if any(w in lowered for w in ("cannot", "failed", "refused", "not credited", "damaged")) else "info"
        )  # fmt: skip
        self.log(text, level=level, source="worker" if lowered.startswith(("worker", "fatal")) else "agent")

    # ------------------------------------------------------------------ lifecycle
    def acquire(self) -> None:
        """Take the one-agent-per-user lock, or raise :class:`AgentAlreadyRunning`."""
        if not self._lock.acquire():
            raise AgentAlreadyRunning(read_location(self.settings))

    def write_location(self, *, url: str, host: str, port: int) -> None:
        location = {
            "pid": os.getpid(),
            "url": url,
            "host": host,
            "port": port,
            "version": __version__,
            "started_at": self.state.started_at,
            "config_dir": str(self.settings.config_dir),
        }
        write_private_file(self.settings.agent_state_path, json.dumps(location, indent=2).encode())

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.settings.agent_state_path.unlink(missing_ok=True)
        self._lock.release()

    def request_stop(self) -> None:
        self.stop_event.set()

    async def run(self) -> None:
        """Apply the policy and publish state until stopped; then leave the run cleanly.

        The caller holds the lock (:meth:`acquire`) and serves the control API.
        """
        if self._sensors is None:
            self._sensors = Sensors(
                own_pids=lambda: self.contribution.worker_pids if self.contribution else []
            )
        self.log(f"agent {__version__} started (pid {os.getpid()}); config in {self.settings.config_dir}")
        if self.memory.joined and self.memory.coordinator and self.memory.run:
            self.log(f"rejoining run {self.memory.run} at {self.memory.coordinator}")
            with contextlib.suppress(CommandError):
                await self._join(
                    JoinCommand(
                        coordinator=self.memory.coordinator, run=self.memory.run, name=self.memory.name
                    ),
                    wait=False,
                )
        tasks = [
            asyncio.create_task(self._policy_loop(), name="policy"),
            asyncio.create_task(self._publish_loop(), name="publish"),
        ]
        try:
            await self.stop_event.wait()
        finally:
            await self._leave(reason="the agent is stopping", forget=False)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if hasattr(self._sensors, "close"):
                self._sensors.close()
            self.state.state = "stopped"
            self.hub.publish()

    async def _publish_loop(self) -> None:
        while True:
            await self.clock.sleep(self.publish_interval)
            self._sync_contribution()
            self.hub.publish()

    def _sync_contribution(self) -> None:
        contribution = self.contribution
        if contribution is None:
            self.state.state = "idle"
            return
        status = contribution.status
        self.state.contribution = status.model_copy()
        if contribution.profile is not None:
            self.state.profile = contribution.profile
        if status.state in ("stopped", "failed"):
            self.state.state = "idle"
        elif status.state in ("stopping",):
            self.state.state = "stopping"
        elif status.state in ("registering", "profiling", "joining") or not contribution.joined:
            self.state.state = "joining"
        elif status.pause_reasons:
            self.state.state = "paused"
        else:
            self.state.state = "contributing"

    # ------------------------------------------------------------------ policy
    async def _policy_loop(self) -> None:
        while True:
            try:
                exclusive = self.state.settings.gpu_exclusive_apps
                self._readings = await asyncio.to_thread(self._sensors.read, exclusive_apps=exclusive)
            except Exception as exc:  # a sensor library failing must not stop the agent
                logger.warning("reading the sensors failed: %s", exc)
            await self.apply_policy()
            await self._maybe_evaluate()
            await self.clock.sleep(self.policy_interval)

    async def apply_policy(self) -> PolicyDecision:
        """Decide with the latest readings and apply the decision to the contribution."""
        state = self.state
        if state.snoozed_until is not None and self.clock.time() >= state.snoozed_until:
            state.snoozed_until = None
            self.log("the snooze is over; resuming")
            self._save_memory()
        contribution = self.contribution
        decision = decide(
            settings=state.settings,
            readings=self._readings,
            now=self.clock.now(),
            memory=self._memory_policy,
            paused_by_user=state.paused_by_user,
            snoozed_until=state.snoozed_until,
            worker_on_gpu=contribution.on_gpu if contribution is not None else False,
        )
        self._memory_policy = decision.memory
        previous = state.policy
        state.policy, state.sensors = decision, self._readings
        if previous.reasons != decision.reasons:
            if decision.reasons:
                self.log(f"pausing: {'; '.join(decision.reasons)}", source="policy")
            elif previous.reasons:
                self.log("computing again", source="policy")
        if contribution is not None:
            by = "volunteer" if state.paused_by_user or state.snoozed_until else "policy"
            await contribution.set_pause(decision.reasons, by=by if decision.reasons else None)
        self._sync_contribution()
        return decision

    async def _maybe_evaluate(self) -> None:
        minutes = self.state.settings.evaluate_every_minutes
        contribution = self.contribution
        if minutes is None or contribution is None or contribution.status.state != "training":
            return
        now = self.clock.monotonic()
        if self._last_auto_eval == 0.0:
            self._last_auto_eval = now - minutes * 60 + 60  # the first drawing a minute into training
        if now - self._last_auto_eval < minutes * 60:
            return
        self._last_auto_eval = now
        task = asyncio.create_task(self._evaluate(EvaluateCommand()))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    # ------------------------------------------------------------------ commands
    async def handle(self, command: Command) -> ResultMessage:
        """Carry out one command; raises :class:`CommandError` for what cannot be done."""
        handlers: dict[type, Callable[[Any], Any]] = {
            JoinCommand: self._join,
            LeaveCommand: self._leave_command,
            PauseAgentCommand: self._pause,
            ResumeAgentCommand: self._resume,
            FinishCommand: self._finish,
            SnoozeCommand: self._snooze,
            SettingsCommand: self._settings,
            ProfileCommand: self._profile,
            EvaluateCommand: self._evaluate,
            RunsCommand: self._runs,
            StopAgentCommand: self._stop,
            PingCommand: self._ping,
        }
        try:
            result: ResultMessage = await handlers[type(command)](command)
        finally:
            self._sync_contribution()
            self.hub.publish()
        result.id = command.id
        return result

    async def run_command(self, command: Command) -> ResultMessage:
        """:meth:`handle`, carried out to its end even if whoever asked goes away.

        A UI that closes its connection (or a shell command whose HTTP request times out) must not cancel
        a command halfway: ``stop`` cancelled while it waited for the worker to leave the swarm would leave
        the agent running, with no one told. So the command runs as the agent's own task; the caller only
        waits for it."""
        task = asyncio.ensure_future(self.handle(command))
        self._commands.add(task)
        task.add_done_callback(self._commands.discard)
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return await asyncio.shield(task)

    async def handle_text(self, data: dict[str, Any]) -> ResultMessage:
        """:meth:`handle` for a command still in its JSON form (validated here)."""
        from volunteer_app.control import COMMANDS

        try:
            command = COMMANDS.validate_python(data)
        except ValidationError as exc:
            raise CommandError("invalid_message", validation_problems(exc)) from exc
        return await self.handle(command)

    async def _ping(self, _command: PingCommand) -> ResultMessage:
        return ResultMessage(message=f"agent {__version__} is running (pid {os.getpid()})")

    async def _join(self, command: JoinCommand, *, wait: bool = True) -> ResultMessage:
        try:
            coordinator = normalize_url(command.coordinator)
        except ValueError as exc:
            raise CommandError("invalid_coordinator", str(exc)) from exc
        current = self.contribution
        if current is not None and not current.stop_event.is_set():
            if current.coordinator == coordinator and current.run_name == command.run:
                return ResultMessage(
                    message=f"already contributing to run {command.run}", data=self._join_data()
                )
            raise CommandError(
                "already_joined",
                f"this agent contributes to run {current.run_name} at {current.coordinator}; leave it first "
                "(`volunteer-app leave`)",
            )
        contribution = Contribution(
            settings=self.settings,
            coordinator=coordinator,
            run=command.run,
            name=command.name,
            invite_code=command.invite_code,
            policy=self.state.settings,
            duration=command.duration,
            max_samples=command.samples,
            evaluate_on_stop=command.evaluate_on_leave,
            on_message=self._contribution_message,
            clock=self.clock,
        )
        contribution.on_finished_lease = self._finished_lease
        self.contribution = contribution
        self._last_auto_eval = 0.0
        self.state.coordinator, self.state.run = coordinator, command.run
        self.state.evaluation, self.state.metric_history = None, []
        self._sync_contribution()
        self.hub.publish()
        await self.apply_policy()
        with contextlib.suppress(OSError):
            await contribution.prestart_worker()
        connect = asyncio.create_task(contribution.connect(), name="connect")
        if wait:
            done, _ = await asyncio.wait({connect}, timeout=120)
            if connect in done and connect.exception() is not None:
                error = connect.exception()
                self.contribution = None
                await contribution.close()
                code = error.code if isinstance(error, AgentError) else "join_failed"
                raise CommandError(code, str(error))
        self._contribution_task = asyncio.create_task(
            self._contribute(contribution, connect), name="contribution"
        )
        self.state.name = contribution.name
        self.memory = AgentMemory(
            coordinator=coordinator,
            run=command.run,
            name=contribution.name,
            joined=self.remember_run,
            paused_by_user=self.state.paused_by_user,
            snoozed_until=self.state.snoozed_until,
        )
        self._save_memory()
        if contribution.joined:
            return ResultMessage(
                message=f"joined run {command.run} as {contribution.name}", data=self._join_data()
            )
        return ResultMessage(
            message=f"joining run {command.run} (still connecting; see `volunteer-app status`)"
        )

    def _join_data(self) -> dict[str, Any]:
        contribution = self.contribution
        assert contribution is not None
        return {
            "session_id": contribution.status.session_id,
            "run": contribution.run_name,
            "name": contribution.name,
        }

    async def _contribute(self, contribution: Contribution, connect: asyncio.Task[None]) -> None:
        """Run the contribution to its end; afterwards the agent stays, idle."""
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await connect
            if connect.cancelled() or connect.exception() is not None:
                error = None if connect.cancelled() else connect.exception()
                contribution.status.state = "failed"
                contribution.status.last_error = str(error) if error else "cancelled"
                self.log(f"could not join: {error}", level="error")
                await contribution.close()
            else:
                self.state.name = contribution.name
                await contribution.run()
        except AgentError as exc:
            self.log(str(exc), level="error")
        except Exception as exc:  # a bug must not take the agent down; it is logged for a report
            logger.exception("the contribution failed")
            contribution.status.state = "failed"
            contribution.status.last_error = f"{type(exc).__name__}: {exc}"
            self.log(f"the contribution failed: {type(exc).__name__}: {exc}", level="error")
        finally:
            status = contribution.status
            if status.state not in ("failed",):
                status.state = "stopped"
            reason = status.stop_reason or status.last_error or "stopped"
            self.log(f"left run {contribution.run_name}: {reason}")
            if self.contribution is contribution and not self._stopping and not self.stop_event.is_set():
                self.memory.joined = False
                self._save_memory()
            self._sync_contribution()
            self.hub.publish()

    async def _leave(self, *, reason: str, forget: bool = True) -> bool:
        contribution, task = self.contribution, self._contribution_task
        if contribution is None or (contribution.stop_event.is_set() and (task is None or task.done())):
            return False
        contribution.request_stop(reason)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=240)
        if forget:
            self.memory.joined = False
            self._save_memory()
        return True

    async def _leave_command(self, _command: LeaveCommand) -> ResultMessage:
        contribution = self.contribution
        if not await self._leave(reason="left by the volunteer"):
            raise CommandError("not_joined", "this agent is not contributing to any run")
        assert contribution is not None
        s = contribution.status
        return ResultMessage(
            message=f"left run {contribution.run_name}: trained {s.samples_total} samples, credited "
            f"{s.samples_credited} in {s.leases_completed} leases",
            data=s.model_dump(mode="json"),
        )

    async def _pause(self, _command: PauseAgentCommand) -> ResultMessage:
        self.state.paused_by_user = True
        self._save_memory()
        await self.apply_policy()
        return ResultMessage(message="paused; `volunteer-app resume` continues")

    async def _resume(self, _command: ResumeAgentCommand) -> ResultMessage:
        self.state.paused_by_user = False
        self.state.snoozed_until = None
        if self.contribution is not None and self.contribution.status.finishing:
            await self.contribution.set_finishing(False)
        self._save_memory()
        decision = await self.apply_policy()
        if decision.reasons:
            return ResultMessage(message=f"resumed, but still paused: {'; '.join(decision.reasons)}")
        return ResultMessage(
            message="resumed" if self.contribution is not None else "resumed (no run joined)"
        )

    async def _finish(self, _command: FinishCommand) -> ResultMessage:
        contribution = self.contribution
        if contribution is None or contribution.stop_event.is_set():
            raise CommandError("not_joined", "this agent is not contributing to any run")
        await contribution.set_finishing(True)
        if not contribution.status.finishing:
            return ResultMessage(message="paused (no lease was in progress)")
        lease = contribution.status.lease_id
        return ResultMessage(
            message=f"finishing lease {lease[:8] if lease else ''}; pausing after it is reported"
        )

    def _finished_lease(self) -> None:
        self.state.paused_by_user = True
        self._save_memory()
        self.log("finished the lease and reported it; paused (resume to continue)")
        task = asyncio.ensure_future(self.apply_policy())
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _snooze(self, command: SnoozeCommand) -> ResultMessage:
        self.state.snoozed_until = self.clock.time() + command.seconds
        self._save_memory()
        await self.apply_policy()
        return ResultMessage(message=f"snoozed for {format_duration(command.seconds)}; resumes by itself")

    async def _settings(self, command: SettingsCommand) -> ResultMessage:
        current = self.state.settings
        unknown = sorted(set(command.values) - set(PolicySettings.model_fields))
        if unknown:
            raise CommandError(
                "unknown_setting",
                f"unknown setting {', '.join(unknown)}; the settings are: {', '.join(PolicySettings.model_fields)}",
            )
        try:
            updated = PolicySettings.model_validate({**current.model_dump(), **command.values})
        except ValidationError as exc:
            raise CommandError("invalid_setting", validation_problems(exc)) from exc
        changed = {k for k in command.values if getattr(current, k) != getattr(updated, k)}
        self.state.settings = updated
        save_policy(self.settings, updated)
        notes = []
        if self.contribution is not None and changed:
            note = await self.contribution.apply_policy(updated)
            if note:
                notes.append(note)
        await self.apply_policy()
        shown = ", ".join(f"{k} = {_show(getattr(updated, k))}" for k in command.values) or "nothing changed"
        restart = sorted(k for k in changed if k in RESTART_FIELDS)
        if restart and self.contribution is None:
            notes.append("applies when training next starts")
        return ResultMessage(
            message=shown + (f" ({'; '.join(notes)})" if notes else ""),
            data={
                "settings": updated.model_dump(mode="json"),
                "changed": sorted(changed),
                "restart": restart,
            },
        )

    async def _profile(self, command: ProfileCommand) -> ResultMessage:
        contribution = self.contribution
        if contribution is not None and contribution.run_info is not None and command.speed_test:
            try:
                profile = await contribution.refresh_profile()
            except AgentError as exc:
                raise CommandError(exc.code, str(exc)) from exc
        else:
            profile = await asyncio.to_thread(
                profile_machine, accepts_connections=self.settings.accepts_connections
            )
            if self.state.profile is not None and self.state.profile.benchmark is not None:
                profile = profile.model_copy(update={"benchmark": self.state.profile.benchmark})
        self.state.profile = profile
        speed = (
            f"; {profile.benchmark.samples_per_second:.0f} samples/s on {profile.benchmark.task}"
            if profile.benchmark
            else ""
        )
        return ResultMessage(
            message=f"{profile.cpu_model}, {profile.cpu_cores} cores, {profile.ram_bytes / 2**30:.1f} GiB"
            f"{', ' + ', '.join(g.name for g in profile.gpus) if profile.gpus else ', no GPU'}{speed}",
            data=profile.model_dump(mode="json"),
        )

    async def _evaluate(self, command: EvaluateCommand) -> ResultMessage:
        contribution = self.contribution
        if contribution is None or contribution.stop_event.is_set():
            raise CommandError("not_joined", "this agent is not contributing to any run")
        try:
            evaluation = await contribution.evaluate(command.prompts)
        except AgentError as exc:
            raise CommandError(exc.code, str(exc)) from exc
        if command.prompts is None:
            self.state.evaluation = evaluation
            self.state.metric_history = [
                *self.state.metric_history[-(METRIC_HISTORY - 1) :],
                MetricPoint(
                    at=evaluation.at,
                    epoch=evaluation.epoch,
                    samples=contribution.status.samples_total,
                    metrics=evaluation.metrics,
                ),
            ]
        shown = ", ".join(f"{k} {v:.3f}" for k, v in evaluation.metrics.items()) or "no metric"
        return ResultMessage(
            message=f"epoch {evaluation.epoch}: {shown}", data=evaluation.model_dump(mode="json")
        )

    async def _runs(self, command: RunsCommand) -> ResultMessage:
        try:
            client = CoordinatorClient(command.coordinator, timeout=10)
        except ValueError as exc:
            raise CommandError("invalid_coordinator", str(exc)) from exc
        try:
            runs = await client.list_runs()
        except CoordinatorUnreachable as exc:
            raise CommandError("coordinator_unreachable", str(exc)) from exc
        except CoordinatorRefused as exc:
            raise CommandError(exc.code, exc.detail) from exc
        finally:
            await client.aclose()
        active = [r for r in runs if r.state != "finished"]
        return ResultMessage(
            message=f"{len(active)} run(s) open at {client.base_url}: {', '.join(r.name for r in active) or 'none'}",
            data=[r.model_dump(mode="json") for r in runs],
        )

    async def _stop(self, _command: StopAgentCommand) -> ResultMessage:
        contribution = self.contribution
        self._stopping = True
        left = await self._leave(reason="the agent was stopped", forget=False)
        self.state.state = "stopping"
        asyncio.get_running_loop().call_later(0.2, self.stop_event.set)
        if left and contribution is not None:
            return ResultMessage(
                message=f"the agent stops after leaving run {contribution.run_name} (it rejoins when started "
                "again; `volunteer-app leave` leaves for good)"
            )
        return ResultMessage(message="the agent stops")


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value) or "(empty)"
    return str(value)


def contribution_summary(state: ContributionState) -> dict[str, Any]:
    """What ``join --json`` prints at the end (the contribution's state)."""
    return state.model_dump(mode="json")

"""``VolunteerApp``: the volunteer's window onto the local agent (terminal, or a browser via textual-serve).

The app is a client of the agent service and never its host: it attaches over the control API
(:class:`~tui.link.AgentLink`), shows the agent's state on seven screens (one Textual mode each), sends
commands, and detaches again; the agent and its worker go on training whatever happens here. If the
agent goes away the app says so, offers to start it, and reattaches when it is back.

Data flow: the link and the coordinator's leaderboard feed run as async workers and post
:mod:`tui.messages` to the app; the app keeps the state and fans it out to the screens with three
signals (agent state, log lines, leaderboard); a screen redraws only while it is shown. Commands run in
workers; :meth:`VolunteerApp.on_worker_state_changed` is the one place where a failed command becomes a
notification that says what to do next.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.signal import Signal
from textual.worker import Worker, WorkerState

from tui.formatting import is_contributing, refusal
from tui.history import ContributionHistory
from tui.link import AgentLink, LeaderboardFeed
from tui.literal import clean
from tui.messages import (
    AgentAttached,
    AgentChanged,
    AgentLogged,
    AgentLost,
    LeaderboardChanged,
    LeaderboardStatus,
)
from tui.screens.base import ALL
from tui.screens.contribute import ContributeScreen
from tui.screens.dialogs import ConfirmDialog, QuitChoice, QuitDialog, SnoozeDialog
from tui.screens.first_run import FirstRunScreen
from tui.screens.leaderboard import LeaderboardScreen
from tui.screens.log import LogScreen
from tui.screens.machine import MachineScreen
from tui.screens.model import ModelScreen
from tui.screens.settings import SettingsScreen
from tui.widgets.chrome import SCREENS
from volunteer_app.control import (
    AgentState,
    FinishCommand,
    LeaveCommand,
    LogEntry,
    PauseAgentCommand,
    ResultMessage,
    ResumeAgentCommand,
    SettingsCommand,
    SnoozeCommand,
    StopAgentCommand,
    format_duration,
)
from volunteer_app.control_client import AgentAddress, ControlError, locate_agent
from volunteer_app.protocol import LeaderboardEntry, RunOut
from volunteer_app.settings import AgentSettings

logger = logging.getLogger(__name__)

LOG_LINES = 2000
NOTIFICATION_LIMIT = 1000
"""Characters of a notification; the rest is on the Log screen."""
SNOOZE_CHOICES = (1800.0, 3600.0, 2 * 3600.0, 8 * 3600.0)


class VolunteerApp(App[str | None]):
    """The volunteer's app. Build it with keyword arguments (the CLI and the tests call the same constructor).

    :param settings: the agent settings (config dir: where to find the agent, its token and logs).
    :param locate: where the agent listens; default :func:`locate_agent` on ``settings``.
    :param start_agent: starts the agent in the background and returns its address (blocking; run in a
        thread). None: the app can only tell the volunteer how to start it.
    :param coordinator: a coordinator URL preselected on the first-run screen (``--coordinator``).
    :param notice: a message shown once at start (e.g. that the agent was started in the background).
    :param clock: wall-clock time, for "seen 3 min ago" and the like.
    :param route_coordinator: where this app reaches a coordinator the agent names by URL (the same URL
        unless a proxy or a test says otherwise); used for the leaderboard only.
    """

    TITLE = "volunteer-app"
    CSS_PATH = "app.tcss"
    MODES: ClassVar[dict[str, Any]] = {
        "contribute": ContributeScreen,
        "model": ModelScreen,
        "leaderboard": LeaderboardScreen,
        "machine": MachineScreen,
        "settings": SettingsScreen,
        "log": LogScreen,
        "join": FirstRunScreen,
    }
    DEFAULT_MODE = "contribute"
    BINDINGS: ClassVar[list[BindingType]] = [
        *(Binding(key, f"show('{mode}')", title, show=False) for key, mode, title in SCREENS),
        Binding("p", "pause", "Pause", show=False),
        Binding("r", "resume", "Resume", show=False),
        Binding("f", "finish", "Finish", show=False),
        Binding("z", "snooze", "Snooze", show=False),
        Binding("l", "leave", "Leave", show=False),
        Binding("a", "start_agent", "Start agent"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        *,
        settings: AgentSettings | None = None,
        locate: Callable[[], AgentAddress] | None = None,
        start_agent: Callable[[], AgentAddress] | None = None,
        coordinator: str | None = None,
        notice: str | None = None,
        clock: Callable[[], float] = time.time,
        route_coordinator: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings if settings is not None else AgentSettings()
        self.start_agent_fn = start_agent
        self.preset_coordinator = coordinator
        self.notice = notice
        self.clock = clock
        self.route_coordinator = route_coordinator or (lambda url: url)
        self.link = AgentLink(locate=locate or (lambda: locate_agent(self.settings)), post=self.post_message)
        self.state: AgentState | None = None
        self.attached = False
        self.ever_attached = False
        self.log_entries: deque[LogEntry] = deque(maxlen=LOG_LINES)
        self.history = ContributionHistory()
        self.board_run: RunOut | None = None
        self.board_entries: list[LeaderboardEntry] = []
        self.board_live = False
        self.board_problem: str | None = None
        self._feed_target: tuple[str, str] | None = None
        self._feed_worker: Worker[None] | None = None
        self._last_contribution_state: str | None = None
        self._last_coordinator_ok = True
        self._drawing_failed: set[str] = set()
        self.agent_signal: Signal[frozenset[str]] = Signal(self, "agent")
        self.log_signal: Signal[list[LogEntry]] = Signal(self, "log")
        self.board_signal: Signal[None] = Signal(self, "leaderboard")

    # ------------------------------------------------------------------ notifications
    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """A notification, always shown as literal text (``markup`` is ignored).

        Notifications quote the agent and the coordinator (a refusal's detail, a run's name, a command's
        answer). Textual would read ``[@click=app.snooze(86400)]`` in them as a link that runs an action,
        and its widgets' ``notify`` passes ``markup=True`` unless told otherwise; so every notification of
        this app is text, whoever asks, with control characters replaced (:mod:`tui.literal`)."""
        if len(message) > NOTIFICATION_LIMIT:  # an agent's answer may quote a whole page of a coordinator's
            message = message[: NOTIFICATION_LIMIT - 1] + "…"
        super().notify(clean(message), title=clean(title), severity=severity, timeout=timeout, markup=False)

    def action_help_quit(self) -> None:
        """Ctrl+C: say which key quits (Textual's own hint uses markup, which :meth:`notify` shows as is)."""
        for key, active in self.active_bindings.items():
            if active.binding.action in ("quit", "app.quit"):
                self.notify(f"Press {key} to quit the app", title="Do you want to quit?")
                return

    # ------------------------------------------------------------------ start
    def on_mount(self) -> None:
        self.run_worker(self.link.run(), name="agent-link", group="agent-link", exit_on_error=False)

    def _show_notice(self) -> None:
        """The start-up notice, once the first screen is up (the agent answered, or did not)."""
        if self.notice:
            self.notify(self.notice, title="volunteer-app", timeout=15)
            self.notice = None

    def show_mode(self, mode: str) -> None:
        if mode != self.current_mode:
            self.switch_mode(mode)

    def action_show(self, mode: str) -> None:
        self.show_mode(mode)

    # ------------------------------------------------------------------ the agent
    @on(AgentAttached)
    def _attached(self, message: AgentAttached) -> None:
        connection = self.link.connection
        if connection is None or connection.state is None:
            return
        first = not self.ever_attached
        was_lost = self.ever_attached and not self.attached
        self.state, self.attached, self.ever_attached = connection.state, True, True
        self.log_entries.clear()
        self.log_entries.extend(connection.log)
        self.history.record(self.state.contribution)
        self._remember_contribution()
        self.refresh_bindings()
        if was_lost:
            self.notify("Reattached to the agent.", title="Agent back", timeout=6)
        if first and not is_contributing(self.state):
            self.show_mode("join")
        self.call_after_refresh(self._show_notice)
        self._follow_leaderboard()
        self.agent_signal.publish(ALL)

    @on(AgentChanged)
    def _changed(self, message: AgentChanged) -> None:
        connection = self.link.connection
        if connection is None or connection.state is None:
            return
        self.state = connection.state
        if "contribution" in message.fields:
            self.history.record(self.state.contribution)
            self._announce_contribution()
        if message.fields & {"contribution", "coordinator", "run", "name"}:
            self._follow_leaderboard()
        self.agent_signal.publish(message.fields)

    @on(AgentLogged)
    def _logged(self, message: AgentLogged) -> None:
        self.log_entries.extend(message.entries)
        self.log_signal.publish(message.entries)

    @on(AgentLost)
    def _lost(self, message: AgentLost) -> None:
        self.call_after_refresh(self._show_notice)
        self.attached = False
        self.refresh_bindings()
        self.agent_signal.publish(frozenset({"attached"}))
        start = (
            "Press a to start it"
            if self.start_agent_fn
            else "Start it with `volunteer-app agent --background`"
        )
        what = f"Lost the agent ({message.reason})." if message.was_attached else "No agent is running."
        self.notify(
            f"{what} This computer is not contributing now. {start}; this window reattaches by itself.",
            title="Agent not running",
            severity="error",
            timeout=20,
        )

    def _remember_contribution(self) -> None:
        c = self.state.contribution if self.state is not None else None
        self._last_contribution_state = c.state if c is not None else None
        self._last_coordinator_ok = c.coordinator_ok if c is not None else True

    def _announce_contribution(self) -> None:
        """Notify what a volunteer must know about changes of the contribution, with what to do next."""
        c = self.state.contribution if self.state is not None else None
        if c is None:
            return
        before, ok_before = self._last_contribution_state, self._last_coordinator_ok
        self._remember_contribution()
        if c.state == "failed" and before != "failed":
            self.notify(
                f"The contribution to run {c.run} failed: {c.last_error or 'see the log'}. Press j to join again; the "
                "Log screen (6) has the details and c there saves a bug report.",
                title="Contribution failed",
                severity="error",
                timeout=30,
            )
        elif c.state == "stopped" and before not in (None, "stopped", "failed"):
            self.notify(
                f"Left run {c.run}: {c.stop_reason or 'stopped'}. Press j to join a run again.",
                title="Not contributing",
            )
        elif c.state == "training" and before in (
            "starting",
            "registering",
            "profiling",
            "joining",
            "syncing",
        ):
            self.notify(f"Training run {c.run} now. Thank you!", title="Contributing", timeout=6)
        if not c.coordinator_ok and ok_before:
            self.notify(
                "The coordinator does not answer. Training goes on and the reports wait in the outbox until it is "
                "back; nothing to do.",
                title="Coordinator unreachable",
                severity="warning",
                timeout=15,
            )
        elif c.coordinator_ok and not ok_before:
            self.notify(
                "The coordinator answers again; the waiting reports are sent.", title="Coordinator back"
            )

    @contextlib.contextmanager
    def drawing(self, what: str) -> Iterator[None]:
        """Around a screen's redraw: a bug there becomes a notification (once per screen), not a crash of
        the window; the agent and its worker are not affected either way."""
        try:
            yield
        except Exception as exc:
            logger.exception("drawing %s failed", what)
            if what not in self._drawing_failed:
                self._drawing_failed.add(what)
                self.notify(
                    f"This screen could not show everything ({type(exc).__name__}: {exc}). Training goes on; please "
                    "report it (Log screen, 6, c saves a bug report).",
                    title="Display problem",
                    severity="error",
                    timeout=20,
                )

    # ------------------------------------------------------------------ the leaderboard feed
    def coordinator_url(self) -> str | None:
        state = self.state
        if state is None:
            return None
        if state.contribution is not None:
            return state.contribution.coordinator
        return state.coordinator

    def feed_target(self) -> tuple[str, str] | None:
        state = self.state
        if state is None:
            return None
        c = state.contribution
        if c is not None:
            return c.coordinator, c.run
        if state.coordinator and state.run:
            return state.coordinator, state.run
        return None

    def _follow_leaderboard(self) -> None:
        target = self.feed_target()
        if target == self._feed_target:
            return
        self._feed_target = target
        if self._feed_worker is not None:
            self._feed_worker.cancel()
            self._feed_worker = None
        self.board_run, self.board_entries, self.board_live, self.board_problem = None, [], False, None
        if target is not None:
            feed = LeaderboardFeed(
                coordinator=target[0],
                run=target[1],
                post=self.post_message,
                address=self.route_coordinator(target[0]),
            )
            self._feed_worker = self.run_worker(
                feed.follow(), name="leaderboard-feed", group="leaderboard", exit_on_error=False
            )
        self.board_signal.publish(None)

    @on(LeaderboardChanged)
    def _board(self, message: LeaderboardChanged) -> None:
        target = self._feed_target
        if target is None or message.coordinator != target[0].rstrip("/"):
            return
        self.board_run, self.board_entries = message.run, message.entries
        self.board_signal.publish(None)
        self.agent_signal.publish(frozenset({"leaderboard"}))

    @on(LeaderboardStatus)
    def _board_status(self, message: LeaderboardStatus) -> None:
        self.board_live, self.board_problem = message.live, message.problem
        self.board_signal.publish(None)

    def my_rank(self) -> tuple[int, int] | None:
        """This volunteer's rank in the run and the number of volunteers ranked, from the live feed."""
        name = self.state.name if self.state is not None else None
        if name is None:
            return None
        for entry in self.board_entries:
            if entry.volunteer.lower() == name.lower():
                return entry.rank, len(self.board_entries)
        return None

    # ------------------------------------------------------------------ commands
    def send(
        self,
        command: Any,
        *,
        done: Callable[[ResultMessage], None] | None = None,
        quiet: bool = False,
        timeout: float = 300.0,
        title: str | None = None,
    ) -> Worker[ResultMessage]:
        """Send a command in a worker; its answer becomes a notification (errors: see
        :meth:`on_worker_state_changed`)."""

        async def call() -> ResultMessage:
            result: ResultMessage = await self.link.call(command, timeout=timeout)
            if not quiet:
                self.notify(result.message, title=title or command.command.capitalize())
            if done is not None:
                done(result)
            return result

        return self.run_worker(call(), group="commands", exit_on_error=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The one place where a failed command or background job becomes a notification."""
        if event.state != WorkerState.ERROR:
            return
        error = event.worker.error
        if isinstance(error, ControlError):
            self.notify(
                refusal(error.detail, error.code),
                title="The agent refused",
                severity="error",
                timeout=15,
            )
        else:
            self.notify(
                f"Something went wrong in this window: {type(error).__name__}: {error}. The agent goes on; press c on "
                "the Log screen (6) to save a bug report.",
                title="Unexpected error",
                severity="error",
                timeout=20,
            )

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Dim what cannot apply now (the keys stay listed)."""
        state = self.state
        c = state.contribution if state is not None else None
        if action == "start_agent":
            return not self.attached  # listed only while the agent is away
        if action in ("pause", "resume", "finish", "snooze", "leave") and not self.attached:
            return False  # hidden while the agent is away: "start agent" takes their place
        if action == "pause" and state is not None and state.paused_by_user:
            return None
        if action == "resume" and state is not None and not (state.paused_by_user or state.snoozed_until):
            return None if c is None or not c.finishing else True
        if action in ("finish", "leave") and not is_contributing(state):
            return None
        return True

    def action_pause(self) -> None:
        self.send(PauseAgentCommand(), title="Paused")

    def action_resume(self) -> None:
        self.send(ResumeAgentCommand(), title="Resumed")

    def action_finish(self) -> None:
        self.send(FinishCommand(), title="Finishing")

    def action_snooze(self, seconds: float | None = None) -> None:
        if seconds is not None:
            self.send(SnoozeCommand(seconds=seconds), title="Snoozed")
            return

        def chosen(answer: float | None) -> None:
            if answer is not None:
                self.send(SnoozeCommand(seconds=answer), title="Snoozed")

        self.push_screen(SnoozeDialog(), chosen)

    def action_leave(self) -> None:
        c = self.state.contribution if self.state is not None else None
        run = c.run if c is not None else "the run"

        def answered(yes: bool | None) -> None:
            if yes:
                self.notify(
                    f"Leaving run {run}: finishing the current step, returning the leases…", title="Leaving"
                )
                self.send(LeaveCommand(), title="Left", timeout=600)

        self.push_screen(
            ConfirmDialog(
                f"Leave run {run}?",
                "The current step is finished, the leases go back to the coordinator and this computer leaves the "
                "swarm. Your credit stays. To stop for a while only, use pause (p) or snooze (z).",
                yes="Leave",
            ),
            answered,
        )

    def action_start_agent(self) -> None:
        if self.attached:
            self.notify("The agent is running.", title="Agent")
            return
        if self.start_agent_fn is None:
            self.notify(
                "Start it in a shell: volunteer-app agent --background", title="Agent", severity="warning"
            )
            return
        self.notify("Starting the agent in the background…", title="Agent")
        self._start_agent()

    @work(thread=True, exclusive=True, group="start-agent", exit_on_error=False)
    def _start_agent(self) -> None:
        assert self.start_agent_fn is not None
        try:
            address = self.start_agent_fn()
        except Exception as exc:  # the CLI's helper says why (the agent log's last lines) in one line
            self.call_from_thread(
                self.notify,
                f"Could not start the agent: {exc}. Run `volunteer-app agent` in a shell to see why, and press c "
                "on the Log screen (6) to save a bug report.",
                title="Agent",
                severity="error",
                timeout=30,
            )
            return
        self.call_from_thread(self.link.retry_now)
        self.call_from_thread(
            self.notify, f"Started the agent in the background (pid {address.pid}).", title="Agent", timeout=8
        )

    # ------------------------------------------------------------------ quitting
    async def action_quit(self) -> None:
        """Ask once whether to keep contributing in the background or stop (unless remembered)."""
        state = self.state
        if not self.attached or state is None:
            self.exit(None)
            return
        choice = state.settings.remember_quit_choice
        if choice != "ask":
            self._quit(choice, remember=False)
            return
        contributing = is_contributing(state)

        def answered(answer: QuitChoice | None) -> None:
            if answer is not None:
                self._quit(answer[0], remember=answer[1])

        self.push_screen(
            QuitDialog(contributing=contributing, run=state.contribution.run if state.contribution else None),
            answered,
        )

    @work(exclusive=True, group="quit", exit_on_error=False)
    async def _quit(self, choice: str, *, remember: bool) -> None:
        if remember:
            await self.link.call(SettingsCommand(values={"remember_quit_choice": choice}), timeout=30)
        if choice == "stop":
            self.notify(
                "Stopping: finishing the current step and leaving the swarm…", title="Stopping", timeout=60
            )
            result = await self.link.call(StopAgentCommand(), timeout=600)
            self.exit(result.message)
            return
        state = self.state
        if is_contributing(state):
            self.exit(
                "the agent keeps contributing in the background: `volunteer-app` shows it again, `volunteer-app stop` "
                "stops it"
            )
        else:
            self.exit("the agent keeps running in the background (`volunteer-app stop` ends it)")

    # ------------------------------------------------------------------ command palette
    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for _key, mode, title in SCREENS:
            yield SystemCommand(
                f"Show {title}", f"Switch to the {title} screen", lambda m=mode: self.show_mode(m)
            )
        if self.attached:
            yield SystemCommand("Pause", "Pause training (accumulated work is kept)", self.action_pause)
            yield SystemCommand("Resume", "Resume after a pause, a snooze or a finish", self.action_resume)
            yield SystemCommand(
                "Finish", "Complete the current lease, report it, then pause", self.action_finish
            )
            for seconds in SNOOZE_CHOICES:
                yield SystemCommand(
                    f"Snooze {format_duration(seconds)}",
                    "Pause now and resume by itself later",
                    lambda s=seconds: self.action_snooze(s),
                )
            yield SystemCommand("Leave the run", "Return the leases and leave the swarm", self.action_leave)
        else:
            yield SystemCommand(
                "Start the agent", "Start the agent service in the background", self.action_start_agent
            )

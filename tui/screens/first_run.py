"""First run (and any later join): the coordinator, the volunteer's name, the run, an invite code when the
run needs one. Every refusal is shown next to the field it is about, with what to do next."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ValidationError
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Input, Select, Static

from tui.formatting import is_contributing, refusal
from tui.literal import literal_line, one_line
from tui.screens.base import AgentScreen
from tui.widgets.chrome import Words
from volunteer_app.control import JoinCommand, RunsCommand
from volunteer_app.control_client import ControlError
from volunteer_app.protocol import RunOut

# Which field an error code from the agent is about (the rest are shown under the Join button).
FIELD_OF_ERROR = {
    "invalid_coordinator": "coordinator",
    "coordinator_unreachable": "coordinator",
    "bad_answer": "coordinator",
    "clock_skew": "coordinator",
    "name_taken": "name",
    "invalid_name": "name",
    "run_not_found": "run",
    "run_finished": "run",
    "run_paused": "run",
    "invite_required": "invite",
    "invalid_invite_code": "invite",
}


DESCRIPTION_LIMIT = 600
"""Characters of a run's description shown under the run list (the coordinator decides its length)."""


def describe_run(run: RunOut) -> Text:
    """One line of the run list. The coordinator names runs and tasks: shown as text, never markup."""
    s = run.stats
    invite = ", invite-only" if run.visibility == "invite" else ""
    return Text(
        one_line(f"{run.name}: {run.task}{invite}, {s.active_peers} online, {s.samples_total:,} samples")
    )


class FirstRunScreen(AgentScreen):
    MODE = "join"
    BINDINGS: ClassVar[list[BindingType]] = []

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[str, RunOut] = {}
        self.looked_up: str | None = None

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="join-form"):
            yield Words(id="join-intro")
            yield Static("Coordinator (the organizers' address)", classes="field-label")
            with Horizontal(classes="field-line"):
                yield Input(placeholder="https://train.example.org", id="coordinator", compact=True)
                yield Button("Find runs", id="lookup", compact=True)
            yield Static(classes="field-problem -empty", id="coordinator-problem")
            yield Static("Your name on the leaderboard", classes="field-label")
            yield Input(placeholder="empty: your user and host name", id="name", max_length=40, compact=True)
            yield Static(classes="field-problem -empty", id="name-problem")
            yield Static("Run", classes="field-label")
            yield Select[str]([], prompt="find the coordinator's runs first", id="run", compact=True)
            yield Static(classes="field-problem -empty", id="run-problem")
            yield Static("Invite code (this run is invite-only)", classes="field-label invite")
            yield Input(
                placeholder="from the organizers", id="invite", classes="invite", password=True, compact=True
            )
            yield Static(classes="field-problem invite -empty", id="invite-problem")
            with Horizontal(classes="field-line"):
                yield Button("Join", id="join", variant="primary")
                yield Static(id="join-problem", classes="field-problem -empty")

    def on_mount(self) -> None:
        app = self.vapp
        state = app.state
        coordinator = (
            app.preset_coordinator or (state.coordinator if state else None) or app.settings.coordinator
        )
        self.query_one("#coordinator", Input).value = one_line(coordinator or "")
        self.query_one("#name", Input).value = one_line(
            (state.name if state else None) or app.settings.name or ""
        )
        self.set_invite_visible(False)
        super().on_mount()
        if coordinator:
            self.lookup(coordinator)

    def show_agent(self, fields: frozenset[str]) -> None:
        state = self.state
        intro = self.query_one("#join-intro", Words)
        if state is not None and is_contributing(state) and state.contribution is not None:
            c = state.contribution
            intro.say(
                Text.assemble(
                    ("You contribute to run ", ""),
                    (c.run, "bold"),
                    f" at {c.coordinator} now. To join another run, leave this one first (l on the Contribute "
                    "screen, 1).",
                )
            )
        else:
            intro.say(
                Text.assemble(
                    ("Join a training run. ", "bold"),
                    "This computer then trains the run's shared model with the other volunteers' computers, "
                    "within the limits of the Settings screen (5), and keeps doing so in the background.",
                )
            )
        if (
            not self.vapp.preset_coordinator
            and state is not None
            and state.coordinator
            and not self.looked_up
        ):
            field = self.query_one("#coordinator", Input)
            if not field.value:
                field.value = one_line(state.coordinator)
                self.lookup(state.coordinator)

    # ------------------------------------------------------------------ problems in place
    def problem(self, field: str, text: str | None) -> None:
        """Show what is wrong with ``field`` under it (None clears it). The text quotes the coordinator
        (refusals, descriptions), so it is shown as text on one line, never as markup."""
        line = self.query_one(f"#{field}-problem", Static)
        line.update(literal_line(text or "", limit=DESCRIPTION_LIMIT))
        line.set_class(text is not None, "-problem")
        line.set_class(not text, "-empty")
        widget_id = {"coordinator": "coordinator", "name": "name", "run": "run", "invite": "invite"}.get(
            field
        )
        if widget_id is not None:
            self.query_one(f"#{widget_id}").set_class(text is not None, "-invalid")

    def hint(self, field: str, text: str | None) -> None:
        """Say what is going on under ``field`` (not a problem)."""
        self.problem(field, None)
        line = self.query_one(f"#{field}-problem", Static)
        line.update(literal_line(text or "", limit=DESCRIPTION_LIMIT))
        line.set_class(not text, "-empty")

    def clear_problems(self) -> None:
        for field in ("coordinator", "name", "run", "invite", "join"):
            self.problem(field, None)

    def set_invite_visible(self, visible: bool) -> None:
        for widget in self.query(".invite"):
            widget.display = visible

    # ------------------------------------------------------------------ runs
    @on(Input.Submitted, "#coordinator")
    @on(Button.Pressed, "#lookup")
    def _lookup_pressed(self) -> None:
        self.lookup(self.query_one("#coordinator", Input).value.strip())

    def lookup(self, coordinator: str) -> None:
        self.problem("coordinator", None)
        if not coordinator:
            self.problem("coordinator", "Enter the coordinator's address, e.g. https://train.example.org.")
            return
        self.hint("coordinator", "Asking the coordinator for its runs…")
        self._lookup(coordinator)

    @work(exclusive=True, group="runs", exit_on_error=False)
    async def _lookup(self, coordinator: str) -> None:
        try:
            result = await self.vapp.link.call(RunsCommand(coordinator=coordinator), timeout=30)
        except ControlError as exc:
            self.problem("coordinator", refusal(exc.detail, exc.code))
            return
        runs: dict[str, RunOut] = {}
        for raw in result.data or []:
            try:
                run = RunOut.model_validate(raw)
            except ValidationError:
                continue
            if run.state != "finished":
                runs[run.name] = run
        self.runs, self.looked_up = runs, coordinator
        select = self.query_one("#run", Select)
        select.set_options([(describe_run(r), r.name) for r in runs.values()])
        self.problem("coordinator", None)
        if not runs:
            self.problem(
                "run", "This coordinator has no open run now; ask the organizers, or try again later."
            )
            return
        state = self.state
        preferred = state.run if state is not None and state.run in runs else next(iter(runs))
        select.value = preferred
        self._run_chosen_now(preferred)
        self.hint("coordinator", f"{len(runs)} open run{'s' if len(runs) != 1 else ''} at {coordinator}")

    @on(Select.Changed, "#run")
    def _run_chosen(self, event: Select.Changed) -> None:
        event.stop()
        if isinstance(event.value, str):
            self._run_chosen_now(event.value)

    def _run_chosen_now(self, name: str) -> None:
        run = self.runs.get(name)
        self.problem("run", None)
        self.set_invite_visible(run is not None and run.visibility == "invite")
        if run is not None and run.description:
            self.hint("run", run.description)

    # ------------------------------------------------------------------ join
    @on(Button.Pressed, "#join")
    @on(Input.Submitted, "#name")
    @on(Input.Submitted, "#invite")
    def _join_pressed(self) -> None:
        self.clear_problems()
        coordinator = self.query_one("#coordinator", Input).value.strip()
        run = self.query_one("#run", Select).value
        if not coordinator:
            self.problem("coordinator", "Enter the coordinator's address, e.g. https://train.example.org.")
            return
        if coordinator != self.looked_up or not isinstance(run, str):
            self.problem(
                "run", "Find the coordinator's runs first (Enter in the address field), then choose one."
            )
            self.lookup(coordinator)
            return
        name = self.query_one("#name", Input).value.strip() or None
        invite = self.query_one("#invite", Input).value.strip() or None
        try:
            command = JoinCommand(coordinator=coordinator, run=run, name=name, invite_code=invite)
        except ValidationError as exc:
            self.problem("join", str(exc.errors()[0].get("msg")))
            return
        self.query_one("#join", Button).disabled = True
        self.hint("join", "Joining: registering, measuring this computer for a few seconds, then joining…")
        self._join(command)

    @work(exclusive=True, group="join", exit_on_error=False)
    async def _join(self, command: JoinCommand) -> None:
        try:
            result = await self.vapp.link.call(command, timeout=600)
        except ControlError as exc:
            self.hint("join", None)
            field = FIELD_OF_ERROR.get(exc.code, "join")
            if field == "invite":
                self.set_invite_visible(True)
            self.problem(field, refusal(exc.detail, exc.code))
            return
        finally:
            self.query_one("#join", Button).disabled = False
        self.hint("join", None)
        self.notify(f"{result.message}. Training starts in a few seconds.", title="Joined")
        self.vapp.show_mode("contribute")

"""Small modal questions: what quitting does, how long to snooze, whether to leave the run."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Static

from tui.literal import literal
from volunteer_app.control import parse_duration

QuitChoice = tuple[str, bool]
"""("background" | "stop", remember the choice)."""


class QuitDialog(ModalScreen[QuitChoice | None]):
    """Keep contributing in the background, or stop? The answer can be remembered."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("b", "choose('background')", "Background", show=False),
        Binding("s", "choose('stop')", "Stop", show=False),
    ]

    def __init__(self, *, contributing: bool, run: str | None) -> None:
        super().__init__()
        self.contributing = contributing
        self.run = run

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-dialog", classes="dialog"):
            if self.contributing:
                yield Static(
                    literal(
                        f"Keep contributing to run {self.run} in the background after this window closes, or stop?"
                    ),
                    classes="dialog-question",
                )
                yield Static(
                    "In the background the agent goes on within your settings; `volunteer-app` opens this window "
                    "again and `volunteer-app stop` stops it.",
                    classes="dialog-help",
                )
            else:
                yield Static(
                    "Keep the agent running in the background (it starts contributing when you join a run from "
                    "here or the shell), or stop it?",
                    classes="dialog-question",
                )
            yield Checkbox("Remember my choice (Settings: remember quit choice)", id="remember")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Keep in background (b)", id="background", variant="primary")
                yield Button("Stop (s)", id="stop", variant="error")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self.action_choose(str(event.button.id))

    def action_choose(self, choice: str) -> None:
        self.dismiss((choice, self.query_one("#remember", Checkbox).value))

    def action_cancel(self) -> None:
        self.dismiss(None)


class SnoozeDialog(ModalScreen[float | None]):
    """How long to pause before resuming by itself."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="snooze-dialog", classes="dialog"):
            yield Static(
                "Snooze for how long? Training resumes by itself afterwards.", classes="dialog-question"
            )
            yield Input(value="1h", placeholder="30m, 2h, 1h30m, 1d", id="duration")
            yield Static("", id="duration-problem", classes="field-problem")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Snooze", id="snooze", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Input.Changed, "#duration")
    def _typed(self, event: Input.Changed) -> None:
        self._seconds(event.value)

    def _seconds(self, text: str) -> float | None:
        problem = self.query_one("#duration-problem", Static)
        try:
            seconds = parse_duration(text)
        except ValueError as exc:
            problem.update(literal(exc))  # it quotes what was typed
            self.query_one("#duration").set_class(True, "-invalid")
            return None
        problem.update("")
        self.query_one("#duration").set_class(False, "-invalid")
        return seconds

    @on(Input.Submitted, "#duration")
    @on(Button.Pressed, "#snooze")
    def _snooze(self) -> None:
        seconds = self._seconds(self.query_one("#duration", Input).value)
        if seconds is not None:
            self.dismiss(seconds)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question (leaving a run). The question and its help are text, never markup: they name
    the run, which its coordinator named."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "answer(False)", "Cancel"),
        Binding("y", "answer(True)", "Yes", show=False),
        Binding("n", "answer(False)", "No", show=False),
    ]

    def __init__(self, question: str, help_text: str, *, yes: str, no: str = "Cancel") -> None:
        super().__init__()
        self.question = question
        self.help_text = help_text
        self.yes = yes
        self.no = no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(literal(self.question), classes="dialog-question")
            yield Static(literal(self.help_text), classes="dialog-help")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", id="yes", variant="error")
                yield Button(f"{self.no} (n)", id="no", variant="primary")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

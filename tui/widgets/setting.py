"""One agent setting on the settings screen: its name and meaning, an editor that fits its type, the
problem with what was typed (checked while typing), and what applying it did."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from pydantic.fields import FieldInfo
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Checkbox, Input, Select, Static

from tui.formatting import setting_label, shown_value
from tui.literal import literal
from volunteer_app.control import parse_setting

Check = Callable[[str, Any], tuple[Any, str | None]]
"""(key, value) -> (the value as the agent takes it, None) or (None, the problem with it)."""


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def literal_choices(field: FieldInfo) -> list[str] | None:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


class SettingRow(Vertical):
    """An editor for one :class:`~volunteer_app.control.PolicySettings` field.

    Posts :class:`SettingRow.Commit` with the parsed value when the volunteer commits a valid change
    (Enter or leaving an input, toggling a switch, choosing an option).
    """

    class Commit(Message):
        def __init__(self, row: SettingRow, key: str, value: Any) -> None:
            super().__init__()
            self.row = row
            self.key = key
            self.value = value

    def __init__(self, key: str, field: FieldInfo, value: Any, *, check: Check, restart: str | None = None):
        super().__init__(id=f"setting-{key}", classes="setting")
        self.key = key
        self.field = field
        self.value = value
        self.check = check
        self.restart = restart
        self.choices = literal_choices(field)
        self.kind = "bool" if field.annotation is bool else "choice" if self.choices else "text"

    def compose(self) -> ComposeResult:
        with Horizontal(classes="setting-line"):
            with Vertical(classes="setting-text"):
                yield Static(setting_label(self.key), classes="setting-name")
                yield Static(self.field.description or "", classes="setting-description")
            yield self._editor()
        problem = Static("", classes="setting-problem")
        problem.display = False
        yield problem
        if self.restart:
            yield Static(f"Note: {self.restart}.", classes="setting-restart")

    def _editor(self) -> Widget:
        if self.kind == "bool":
            return Checkbox(
                _on_off(bool(self.value)), value=bool(self.value), id=f"edit-{self.key}", compact=True
            )
        if self.choices is not None:
            return Select(
                [(c, c) for c in self.choices],
                value=str(self.value),
                allow_blank=False,
                id=f"edit-{self.key}",
                compact=True,
            )
        optional = "None" in str(self.field.annotation)
        placeholder = "none" if optional else ""
        if str(self.field.annotation).startswith("list"):
            placeholder = "none; separate items with ';'"
        return Input(
            value=shown_value(self.value), placeholder=placeholder, id=f"edit-{self.key}", compact=True
        )

    @property
    def editor(self) -> Widget:
        return self.query_one(f"#edit-{self.key}")

    # ------------------------------------------------------------------ from the agent
    def set_value(self, value: Any) -> None:
        """The agent's value changed (here or elsewhere): show it unless the volunteer is editing."""
        self.value = value
        editor = self.editor
        if editor.has_focus and self.kind == "text":
            return
        with editor.prevent(Input.Changed, Checkbox.Changed, Select.Changed):
            if isinstance(editor, Checkbox):
                editor.value = bool(value)
                editor.label = _on_off(bool(value))
            elif isinstance(editor, Select):
                editor.value = str(value)
            elif isinstance(editor, Input):
                editor.value = shown_value(value)
        self.show_problem(None)

    def show_problem(self, problem: str | None) -> None:
        """The problem with the value (the agent's refusal, or what was typed): text, never markup."""
        line = self.query_one(".setting-problem", Static)
        line.update(literal(problem or ""))
        line.display = problem is not None
        self.set_class(problem is not None, "-invalid")

    def show_note(self, note: str) -> None:
        """What applying did (the agent's answer): text, never markup."""
        line = self.query_one(".setting-problem", Static)
        line.update(literal(note))
        line.display = True
        self.set_class(False, "-invalid")

    # ------------------------------------------------------------------ from the volunteer
    def parsed(self, text: str) -> tuple[Any, str | None]:
        try:
            value = parse_setting(self.key, text)
        except ValueError as exc:
            return None, str(exc)
        return self.check(self.key, value)

    @on(Input.Changed)
    def _typed(self, event: Input.Changed) -> None:
        event.stop()
        _value, problem = self.parsed(event.value)
        self.show_problem(problem)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._commit_text(event.value)

    @on(Input.Blurred)
    def _left(self, event: Input.Blurred) -> None:
        event.stop()
        self._commit_text(event.value)

    def _commit_text(self, text: str) -> None:
        if text == shown_value(self.value):
            self.show_problem(None)
            return
        value, problem = self.parsed(text)
        self.show_problem(problem)
        if problem is None:
            self.post_message(self.Commit(self, self.key, value))

    @on(Checkbox.Changed)
    def _checked(self, event: Checkbox.Changed) -> None:
        event.stop()
        event.checkbox.label = _on_off(event.value)
        if event.value != self.value:
            self.post_message(self.Commit(self, self.key, event.value))

    @on(Select.Changed)
    def _chosen(self, event: Select.Changed) -> None:
        event.stop()
        if event.value != self.value and event.value is not Select.NULL:
            value, problem = self.check(self.key, event.value)
            self.show_problem(problem)
            if problem is None:
                self.post_message(self.Commit(self, self.key, value))

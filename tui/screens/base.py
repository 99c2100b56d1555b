"""What the app's screens share: the navigation bar, the agent's banner, the footer, and following the
agent's state (the app fans it out with signals; a screen redraws only while it is shown)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Footer, Input, Select

from tui.formatting import banner
from tui.widgets.chrome import AgentBanner, NavBar
from volunteer_app.control import AgentState, LogEntry

if TYPE_CHECKING:
    from tui.app import VolunteerApp

ALL = frozenset(AgentState.model_fields) | {"attached"}
"""Every field: what a screen redraws when it is shown again or the agent is (re)attached."""


class AgentScreen(Screen[None]):
    """A main screen (one of the app's modes). Subclasses compose :meth:`compose_body` and redraw in
    :meth:`show_agent` (``fields``: the state fields that changed) and :meth:`show_log`."""

    MODE: ClassVar[str] = ""
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "unfocus", "Leave the field")]

    @property
    def vapp(self) -> VolunteerApp:
        return cast("VolunteerApp", self.app)

    @property
    def state(self) -> AgentState | None:
        return self.vapp.state

    def compose(self) -> ComposeResult:
        yield NavBar(self.MODE, id="nav")
        yield AgentBanner(id="banner")
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        app = self.vapp
        app.agent_signal.subscribe(self, self._agent_changed)
        app.log_signal.subscribe(self, self._logged)
        self._agent_changed(ALL)

    def on_screen_resume(self) -> None:
        self._agent_changed(ALL)

    @property
    def shown(self) -> bool:
        return self.is_attached and self in self.app.screen_stack

    def _agent_changed(self, fields: frozenset[str]) -> None:
        if not self.shown:
            return
        with self.vapp.drawing(type(self).__name__):
            app = self.vapp
            text, kind = banner(app.state, attached=app.attached, now=app.clock())
            self.query_one(AgentBanner).show(text, kind)
            self.show_agent(fields)

    def _logged(self, entries: list[LogEntry]) -> None:
        if self.shown:
            with self.vapp.drawing(type(self).__name__):
                self.show_log(entries)

    def show_agent(self, fields: frozenset[str]) -> None:
        """Redraw what depends on ``fields`` of the agent's state."""

    def show_log(self, entries: list[LogEntry]) -> None:
        """New log lines arrived."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "unfocus":  # listed while typing in a field, where the letter keys type
            return isinstance(self.focused, (Input, Select))
        return True

    def action_unfocus(self) -> None:
        self.set_focus(None)

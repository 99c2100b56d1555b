"""What every screen has: the navigation bar and the agent's banner (what it does, why it is paused)."""

from __future__ import annotations

from rich.text import Text
from textual.content import Content
from textual.widgets import Static

from tui.literal import cleaned, literal, literal_line

SCREENS: tuple[tuple[str, str, str], ...] = (
    ("1", "contribute", "Contribute"),
    ("2", "model", "Model"),
    ("3", "leaderboard", "Leaderboard"),
    ("4", "machine", "Machine"),
    ("5", "settings", "Settings"),
    ("6", "log", "Log"),
    ("j", "join", "Join"),
)
"""(key, mode, title) of each screen, in the order the bar shows them."""


class NavBar(Static):
    """The screens with their keys; the current one highlighted. Each name is a link (mouse, browser)."""

    def __init__(self, current: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.current = current

    def on_mount(self) -> None:
        parts: list[Content | str] = []
        for key, mode, title in SCREENS:
            label = Content.from_markup(
                f"[@click=app.show('{mode}')] [b]$key[/b] $title [/]", key=key, title=title
            )
            if mode == self.current:
                label = label.stylize("reverse")
            parts.append(label)
        self.update(Content("").join(parts))


class AgentBanner(Static):
    """One or two lines about the agent; its class (``-ok``, ``-paused``, ``-busy``, ``-idle``,
    ``-error``) colours it. The words quote the coordinator (a run's name, an error's detail), so they are
    shown as text, on one line, at most :attr:`LIMIT` characters."""

    KINDS = ("ok", "paused", "busy", "idle", "error")
    LIMIT = 300

    _shown: tuple[str, str] | None = None

    def show(self, text: str, kind: str) -> None:
        if (text, kind) == self._shown:
            return  # the same words: no redraw (it is asked for on every state update)
        self._shown = (text, kind)
        self.update(literal_line(text, limit=self.LIMIT))
        for other in self.KINDS:
            self.set_class(other == kind, f"-{other}")


class Words(Static):
    """Text that is redrawn only when its words change (screens call :meth:`say` on every update).

    What it says is text, never markup: a string is shown as its characters, a :class:`Text` with its
    styles; control characters are replaced in both (the words often quote the coordinator)."""

    _said: str | None = None

    def say(self, text: Text | str) -> None:
        plain = text.plain if isinstance(text, Text) else text
        if plain != self._said:
            self._said = plain
            self.update(cleaned(text) if isinstance(text, Text) else literal(text))

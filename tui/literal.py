"""Text from elsewhere, shown as text: no markup, no terminal escapes.

Most of what the app shows was written by someone else: a coordinator (run names and descriptions, error
details, the leaderboard's volunteer names), the agent (its log and messages, which quote the
coordinator) and the model (what it writes). Textual reads markup in plain strings: a run description
``[@click=app.snooze(86400)]Click me[/]`` given to ``Static.update`` becomes a link that snoozes the agent
for a day. And a terminal obeys escape sequences in what it is sent. So such text reaches a widget only
through these helpers: as :class:`~textual.content.Content` or :class:`~rich.text.Text` objects (never
parsed as markup), with control characters and bidi overrides replaced by :func:`volunteer_app.safetext.clean`.

Strings the app writes itself may still use markup, through ``Content.from_markup`` with ``$variables``
for anything inserted (as the navigation bar does).
"""

from __future__ import annotations

from rich.text import Text
from textual.content import Content

from volunteer_app.safetext import clean, one_line

__all__ = ["clean", "cleaned", "literal", "literal_line", "one_line", "plain"]


def literal(text: object) -> Content:
    """``text`` as content that shows exactly its characters (newlines kept, control characters replaced)."""
    return Content(clean(text))


def literal_line(text: object, *, limit: int | None = None) -> Content:
    """``text`` on one line (for a field's problem line, a banner), cut to ``limit`` characters."""
    return Content(one_line(text, limit=limit))


def plain(text: object, style: str = "") -> Text:
    """``text`` as a rich :class:`Text` in ``style`` (never markup), control characters replaced."""
    return Text(clean(text), style=style)


def cleaned(text: Text) -> Text:
    """A :class:`Text` the app assembled from others' words, with its control characters replaced (one
    for one, so its styles stay where they were)."""
    safe = clean(text.plain)
    if safe == text.plain:
        return text
    copy = text.copy()
    copy.plain = safe
    return copy

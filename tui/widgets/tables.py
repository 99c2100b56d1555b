"""Tables and lists: the leaderboard, the recent events, label/value panels."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from rich.table import Table
from rich.text import Text
from textual.widgets import DataTable, Static

from tui.formatting import age, human
from tui.literal import cleaned, one_line, plain
from volunteer_app.control import LogEntry
from volunteer_app.protocol import LeaderboardEntry

LEVEL_STYLES = {"debug": "dim", "info": "", "warning": "bold yellow", "error": "bold red"}


class LeaderboardTable(DataTable[Text | str]):
    """Rank, name, samples, compute hours, samples/s, last seen; this volunteer's row marked and selected."""

    COLUMNS = (
        ("#", "rank", 4),
        ("volunteer", "volunteer", 16),
        ("samples", "samples", 9),
        ("verified", "verified", 9),
        ("hours", "hours", 7),
        ("/s", "speed", 7),
        ("last seen", "seen", 11),
    )

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)  # type: ignore[arg-type]
        self._keys: list[str] = []
        self._cells_shown: list[tuple[Text, ...]] = []

    def on_mount(self) -> None:
        for label, key, width in self.COLUMNS:
            self.add_column(label, key=key, width=width)

    def show(self, entries: Sequence[LeaderboardEntry], *, me: str | None, now: float) -> None:
        """Show ``entries``; cells are updated in place while the rows stay the same (the live feed
        pushes every second), the table is rebuilt when they change."""
        rows: list[tuple[str, tuple[Text, ...]]] = []
        mine: int | None = None
        for index, entry in enumerate(entries):
            own = me is not None and entry.volunteer.lower() == me.lower()
            rows.append((f"{index}-{entry.volunteer}", self._cells(entry, own=own, now=now)))
            if own:
                mine = index
        keys = [key for key, _ in rows]
        if keys == self._keys:
            for (key, cells), before in zip(rows, self._cells_shown, strict=True):
                for (_label, column, _width), cell, old in zip(self.COLUMNS, cells, before, strict=True):
                    if cell != old:
                        self.update_cell(key, column, cell)
        else:
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
            if mine is not None:
                self.move_cursor(row=mine, animate=False)
        self._keys, self._cells_shown = keys, [cells for _, cells in rows]

    @staticmethod
    def _cells(entry: LeaderboardEntry, *, own: bool, now: float) -> tuple[Text, ...]:
        style = "bold" if own else ""
        # volunteers name themselves: one line of text, never markup or escapes
        name = Text(
            ("▶ " if own else "") + one_line(entry.volunteer), style=style, overflow="ellipsis", no_wrap=True
        )
        if entry.online:
            name.append(" ●", style="green")
        seen = "online" if entry.online else age(entry.last_seen, now).removesuffix(" ago")
        return (
            Text(str(entry.rank), style=style, justify="right"),
            name,
            Text(f"{entry.samples:,}", style=style, justify="right"),
            Text(f"{entry.verified_samples:,}", style=style, justify="right"),
            Text(f"{entry.compute_seconds / 3600:.2f}", style=style, justify="right"),
            Text(f"{entry.samples_per_second:.1f}", style=style, justify="right"),
            Text(seen, style=style),
        )


class EventList(Static):
    """The last log lines that fit, newest last, coloured by level."""

    def __init__(self, *, lines: int = 6, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.lines = lines
        self._entries: Sequence[LogEntry] = ()
        self._shown: tuple[float, str, int] | None = None

    def on_resize(self) -> None:
        self.show(self._entries)

    def show(self, entries: Sequence[LogEntry]) -> None:
        self._entries = entries
        fits = self.content_size.height or self.lines
        recent = list(entries)[-fits:]
        key = (recent[-1].at, recent[-1].message, fits) if recent else None
        if key == self._shown:
            return
        self._shown = key
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, entry in enumerate(recent):
            if i:
                text.append("\n")
            text.append(time.strftime("%H:%M:%S ", time.localtime(entry.at)), style="dim")
            text.append(
                one_line(entry.message), style=LEVEL_STYLES.get(entry.level, "")
            )  # quotes coordinators
        if not recent:
            text.append("No events yet.", style="dim")
        self.update(text, layout=False)  # its size comes from the layout, not from the lines


def pairs_table(rows: Iterable[tuple[str, str | Text]], *, label_width: int = 14) -> Table:
    """Label/value rows without borders (the stats panels). Values are text, never markup (a rich table
    reads markup in plain strings), with control characters replaced."""
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(style="bold", width=label_width, no_wrap=True)
    table.add_column(ratio=1, overflow="fold")
    for label, value in rows:
        table.add_row(plain(label), cleaned(value) if isinstance(value, Text) else plain(value))
    return table


def pairs_text(rows: Iterable[tuple[str, str | Text]], *, label_width: int = 12) -> Text:
    """Label/value lines as one text: what a table shows, for a fraction of a table's drawing cost
    (the contribute screen redraws its numbers every second). Values are text, control characters
    replaced."""
    text = Text()
    for index, (label, value) in enumerate(rows):
        if index:
            text.append("\n")
        text.append(label.ljust(label_width), style="bold")
        text.append(cleaned(value) if isinstance(value, Text) else plain(value))
    return text


def count(n: int) -> str:
    return f"{n:,}" if n < 1_000_000 else human(n)

"""The agent's and the worker's messages, filterable by level and source, copyable for a bug report."""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import RichLog, Select, Static

from tui.literal import clean
from tui.screens.base import AgentScreen
from tui.widgets.tables import LEVEL_STYLES
from volunteer_app import __version__
from volunteer_app.control import AgentState, LogEntry

LEVELS = ("debug", "info", "warning", "error")
SOURCES = ("agent", "worker", "coordinator", "policy")
REPORT_TAIL_LINES = 300


def line_of(entry: LogEntry) -> str:
    """One message as the clipboard and the bug report have it, control characters replaced (the
    messages quote coordinators, and a report is read in a terminal too)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.at))
    return clean(f"{stamp} {entry.level:<7} {entry.source:<11} {entry.message}")


def passes(entry: LogEntry, level: str, source: str) -> bool:
    return LEVELS.index(entry.level) >= LEVELS.index(level) and source in ("all", entry.source)


def bug_report(entries: Iterable[LogEntry], state: AgentState | None, *, logs_dir: Path | None) -> str:
    """What a volunteer sends the organizers: versions, the agent's state in one line, the log lines, and
    the last lines of the agent's and worker's log files."""
    lines = [
        f"volunteer-app {__version__} · {platform.platform()} · Python {platform.python_version()}",
    ]
    if state is not None:
        c = state.contribution
        lines.append(f"agent {state.agent_version} (pid {state.pid}) state {state.state}")
        if c is not None:
            lines.append(
                clean(
                    f"run {c.run} at {c.coordinator} as {c.name}: {c.state}, {c.samples_total} samples, "
                    f"device {c.device}, threads {c.threads}, restarts {c.worker_restarts}, last error "
                    f"{c.last_error}"
                )
            )
        lines.append(f"settings {state.settings.model_dump_json()}")
    lines.append("")
    lines.extend(line_of(e) for e in entries)
    if logs_dir is not None and logs_dir.is_dir():
        for path in sorted(logs_dir.glob("*.log")):
            try:
                tail = path.read_text(errors="replace").splitlines()[-REPORT_TAIL_LINES:]
            except OSError:
                continue
            lines += ["", f"--- last {len(tail)} lines of {path} ---", *(clean(line) for line in tail)]
    return "\n".join(lines) + "\n"


class LogScreen(AgentScreen):
    MODE = "log"
    AUTO_FOCUS = "#log-view"  # not a filter: there the number keys would choose options, not screens
    BINDINGS: ClassVar[list[BindingType]] = [Binding("c", "copy_report", "Copy for a bug report")]

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="log-filters"):
            yield Static("Level", classes="filter-label")
            yield Select(
                [(f"{lvl} and above", lvl) for lvl in LEVELS],
                value="info",
                allow_blank=False,
                id="level",
                compact=True,
            )
            yield Static("Source", classes="filter-label")
            yield Select(
                [("all sources", "all"), *((s, s) for s in SOURCES)],
                value="all",
                allow_blank=False,
                id="source",
                compact=True,
            )
        yield RichLog(id="log-view", wrap=True, markup=False, highlight=False, max_lines=5000, min_width=20)

    @property
    def level(self) -> str:
        return str(self.query_one("#level", Select).value)

    @property
    def source(self) -> str:
        return str(self.query_one("#source", Select).value)

    def shown_entries(self) -> list[LogEntry]:
        level, source = self.level, self.source
        return [e for e in self.vapp.log_entries if passes(e, level, source)]

    def show_agent(self, fields: frozenset[str]) -> None:
        if "attached" in fields:
            self._rewrite()

    @on(Select.Changed)
    def _filter(self, event: Select.Changed) -> None:
        event.stop()
        self._rewrite()

    def _rewrite(self) -> None:
        view = self.query_one(RichLog)
        view.clear()
        entries = self.shown_entries()
        for entry in entries:
            view.write(self._text(entry))
        if not entries:
            view.write(Text("No messages at this level yet.", style="dim"))
        view.border_title = f"{len(entries)} of {len(self.vapp.log_entries)} messages"

    def show_log(self, entries: list[LogEntry]) -> None:
        view = self.query_one(RichLog)
        level, source = self.level, self.source
        for entry in entries:
            if passes(entry, level, source):
                view.write(self._text(entry))
        view.border_title = f"{len(self.shown_entries())} of {len(self.vapp.log_entries)} messages"

    @staticmethod
    def _text(entry: LogEntry) -> Text:
        """One message as text (it quotes coordinators): never markup, control characters replaced."""
        text = Text()
        text.append(time.strftime("%H:%M:%S ", time.localtime(entry.at)), style="dim")
        text.append(clean(f"{entry.source:<7} "), style="dim")
        text.append(clean(entry.message), style=LEVEL_STYLES.get(entry.level, ""))
        return text

    def action_copy_report(self) -> None:
        """Copy the shown messages to the clipboard and save a fuller report (with the log files) to a file."""
        app = self.vapp
        entries = self.shown_entries()
        app.copy_to_clipboard("\n".join(line_of(e) for e in entries) + "\n")
        logs_dir = Path(app.state.config_dir) / "logs" if app.state is not None else app.settings.logs_dir
        report = bug_report(app.log_entries, app.state, logs_dir=logs_dir)
        path = logs_dir / time.strftime("bug-report-%Y%m%d-%H%M%S.txt", time.localtime(app.clock()))
        try:
            logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_text(report)
        except OSError as exc:
            app.notify(
                f"Copied {len(entries)} lines to the clipboard, but could not save the report: {exc}",
                title="Bug report",
                severity="warning",
            )
            return
        app.notify(
            f"Copied {len(entries)} lines to the clipboard and saved a full report to {path}: attach that file "
            "to your bug report.",
            title="Bug report",
            timeout=15,
        )

"""The main screen: what this machine contributes now, as live numbers and charts, and the last events."""

from __future__ import annotations

import time
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Static

from tui.formatting import device_text, human_bytes, is_contributing, lease_text
from tui.literal import cleaned
from tui.screens.base import AgentScreen
from tui.widgets.chart import LineChart
from tui.widgets.tables import EventList, count, pairs_text
from volunteer_app.control import LogEntry

NETWORK_SHOWN = {
    "direct": "direct: other peers dial this computer",
    "relayed": "relayed: other peers reach it through the coordinator",
    "client": "client: nobody can dial it; it averages through others",
}


class ContributeScreen(AgentScreen):
    """State (and why it is paused), samples/s and loss charts, epochs, swarm, credit and rank, traffic,
    the current lease and the last events. Pause, resume, finish, snooze and leave are one key each."""

    MODE = "contribute"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "app.pause", "Pause"),
        Binding("r", "app.resume", "Resume"),
        Binding("f", "app.finish", "Finish"),
        Binding("z", "app.snooze", "Snooze"),
        Binding("l", "app.leave", "Leave"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._drawn_at = 0.0
        self._pending: Timer | None = None

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="contribute-top"):
            yield Static(id="stats", classes="panel")
            with Vertical(id="charts"):
                yield LineChart("samples/s", digits=1, id="speed-chart")
                yield LineChart("loss", digits=3, id="loss-chart")
        yield EventList(lines=8, id="events", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#stats").border_title = "This machine's contribution"
        self.query_one("#events").border_title = "Last events"
        super().on_mount()

    REDRAW_INTERVAL = 1.0
    """The agent sends its numbers twice a second; once a second is live enough, for half the CPU."""

    def show_agent(self, fields: frozenset[str]) -> None:
        if "attached" in fields:
            self.query_one(EventList).show(self.vapp.log_entries)
            self._redraw()
            return
        wait = self._drawn_at + self.REDRAW_INTERVAL - time.monotonic()
        if wait <= 0:
            self._redraw()
        elif self._pending is None:
            self._pending = self.set_timer(wait, self._redraw)

    def _redraw(self) -> None:
        self._pending = None
        self._drawn_at = time.monotonic()
        app = self.vapp
        # a fixed-size panel; its words quote the coordinator (run, errors): text, control characters replaced
        self.query_one("#stats", Static).update(cleaned(self._stats()), layout=False)
        self.query_one("#speed-chart", LineChart).show(app.history.speed)
        self.query_one("#loss-chart", LineChart).show(app.history.loss)

    def show_log(self, entries: list[LogEntry]) -> None:
        self.query_one(EventList).show(self.vapp.log_entries)

    def _stats(self) -> Text:
        state = self.state
        if state is None or not self.vapp.attached:
            return Text("Waiting for the agent…", style="dim")
        c = state.contribution
        if c is None or not is_contributing(state):
            last = ""
            if c is not None:
                last = (
                    f"\n\nLast run: {c.run} at {c.coordinator}: {c.samples_total:,} samples trained, "
                    f"{c.samples_credited:,} credited ({c.stop_reason or c.last_error or c.state})."
                )
            return Text(f"Not contributing. Press j to choose a run and join it.{last}")
        loss = "-" if c.loss is None else f"{c.loss:.3f}"
        if c.loss is not None and c.first_loss is not None:
            loss += f" (from {c.first_loss:.3f})"
        credited = count(c.samples_credited)
        rank = self.vapp.my_rank()
        if rank is not None:
            credited += f" · rank #{rank[0]} of {rank[1]}"
        state_text = Text(c.state, style="bold")
        if c.paused_by:
            state_text.append(f" (by {c.paused_by})")
        rows: list[tuple[str, str | Text]] = [
            ("State", state_text),
            ("Samples/s", f"{c.samples_per_second:.1f}"),
            ("Loss", loss),
            ("Epoch", f"local {c.local_epoch} · global {c.global_epoch}"),
            ("Swarm", f"{c.swarm_size} peer{'s' if c.swarm_size != 1 else ''} · {c.averaging_rounds} rounds"),
            ("Trained", f"{count(c.samples_total)} samples"),
            ("Credited", credited),
            ("Sent/recv", f"{human_bytes(c.bytes_sent)} / {human_bytes(c.bytes_received)}"),
            ("Lease", lease_text(c)),
            ("Device", device_text(c)),
            (
                "Coordinator",
                "reachable" if c.coordinator_ok else Text("unreachable: reports wait", style="bold"),
            ),
        ]
        if c.reachability:  # set at join: how the other peers reach this worker
            rows.insert(5, ("Network", NETWORK_SHOWN.get(c.reachability, c.reachability)))
        if c.isolated:  # its rounds keep failing: its work is not reaching the shared model
            rows.insert(5, ("Averaging", Text(c.isolated, style="bold")))
        return pairs_text(rows, label_width=12)

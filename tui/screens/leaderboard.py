"""The leaderboard: this run's, live from the coordinator's websocket feed, or all runs' (read every
30 s while shown). This volunteer's row is marked and selected."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType

from tui.link import CoordinatorUnavailable, fetch_overall_leaderboard
from tui.screens.base import AgentScreen
from tui.widgets.chrome import Words
from tui.widgets.tables import LeaderboardTable, count
from volunteer_app.protocol import LeaderboardEntry

OVERALL_REFRESH = 30.0


class LeaderboardScreen(AgentScreen):
    MODE = "leaderboard"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("t", "toggle_scope", "This run / all runs")]

    def __init__(self) -> None:
        super().__init__()
        self.overall = False
        self.overall_entries: list[LeaderboardEntry] = []
        self.overall_problem: str | None = None

    def compose_body(self) -> ComposeResult:
        yield Words(id="board-summary")
        yield LeaderboardTable(id="board")
        yield Words(id="board-note")

    def on_mount(self) -> None:
        super().on_mount()
        self.vapp.board_signal.subscribe(self, self._board_changed)
        self.set_interval(OVERALL_REFRESH, self._refresh_overall)

    def _board_changed(self, _: None) -> None:
        with self.vapp.drawing("LeaderboardScreen"):
            self._redraw()

    def show_agent(self, fields: frozenset[str]) -> None:
        if fields & {"attached", "name", "run", "coordinator", "contribution"}:
            self._redraw()

    def action_toggle_scope(self) -> None:
        self.overall = not self.overall
        if self.overall:
            self._refresh_overall()
        self._redraw()

    def _refresh_overall(self) -> None:
        if self.overall and self.shown:
            self._fetch_overall()

    @work(exclusive=True, group="overall", exit_on_error=False)
    async def _fetch_overall(self) -> None:
        coordinator = self.vapp.coordinator_url()
        if coordinator is None:
            self.overall_problem = "No coordinator yet: join a run first (press j)."
        else:
            try:
                board = await fetch_overall_leaderboard(
                    coordinator, address=self.vapp.route_coordinator(coordinator)
                )
            except CoordinatorUnavailable as exc:
                self.overall_problem = f"{exc}; trying again in {OVERALL_REFRESH:.0f} s."
            else:
                self.overall_entries, self.overall_problem = board.entries, None
        self._redraw()

    def _redraw(self) -> None:
        if not self.shown:
            return
        app = self.vapp
        me = app.state.name if app.state is not None else None
        table = self.query_one(LeaderboardTable)
        summary = self.query_one("#board-summary", Words)
        note = self.query_one("#board-note", Words)
        if self.overall:
            table.show(self.overall_entries, me=me, now=app.clock())
            summary.say(Text.assemble(("All runs", "bold"), f" at {app.coordinator_url() or '?'}"))
            note.say(self.overall_problem or "t shows this run · ranked by verified samples over all runs")
            return
        table.show(app.board_entries, me=me, now=app.clock())
        summary.say(self._run_summary())
        live = (
            Text("● live", style="bold green") if app.board_live else Text("○ not live", style="bold yellow")
        )
        note.say(
            Text.assemble(
                live,
                " · ",
                app.board_problem or "updates arrive as the coordinator's ledger changes",
                " · t shows all runs",
            )
        )

    def _run_summary(self) -> Text:
        app = self.vapp
        run = app.board_run
        if run is None:
            if app.feed_target() is None:
                return Text("Not in a run: join one (press j) to see its leaderboard.")
            return Text("Connecting to the coordinator's live leaderboard…", style="dim")
        s = run.stats
        text = Text()
        text.append(f"Run {run.name}", style="bold")
        text.append(f" ({run.task}, {run.state}) · {s.active_peers} of {s.volunteers} online · ")
        text.append(f"{count(s.samples_total)} samples · {s.samples_per_second:.1f}/s")
        if s.loss is not None:
            text.append(f" · loss {s.loss:.3f}")
        text.append(f" · epoch {s.global_epoch}")
        if s.shards_total:
            text.append(f" · shards {s.shards_done}/{s.shards_total} of data epoch {s.data_epoch + 1}")
        return text

"""What each screen looks like, at 80x24 and 120x40 (and a few states: paused by the policy, the agent
gone, the quit question, a refused join, the light theme), as SVG snapshots (pytest-textual-snapshot).

The app runs for real and attaches over the real control protocol to a recorded agent
(``fixed_agent.py``) so that every run draws the same screen. After a deliberate change, look at the
new SVGs (``--snapshot-update`` writes them; the HTML report shows the differences) before keeping them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytest_textual_snapshot")

from textual.pilot import Pilot
from textual.widgets import Input

from tests.tui.conftest import screen_text, until
from tests.tui.fixed_agent import (
    NOW,
    RUN,
    FixedAgent,
    agent_state,
    contribution,
    fixed_agent,
    progress,
)
from tui.app import VolunteerApp
from tui.widgets.chart import LineChart
from volunteer_app.control import ErrorMessage, PolicyDecision, ResultMessage
from volunteer_app.control_client import AgentNotRunning
from volunteer_app.settings import AgentSettings

SIZES = [(80, 24), (120, 40)]
SCREENS = ["contribute", "model", "leaderboard", "machine", "settings", "log", "join"]


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    """Clock times on screen (the log, the events) in UTC, whatever the machine's zone."""
    previous = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if previous is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = previous
    time.tzset()


@pytest.fixture(autouse=True)
def charts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Charts redraw at most every few seconds (to spare the CPU); a snapshot need not wait for that."""
    monkeypatch.setattr(LineChart, "MIN_INTERVAL", 0.0)


def make_app(agent: FixedAgent | None, tmp_path: Path, **kwargs: Any) -> VolunteerApp:
    def nowhere() -> Any:
        raise AgentNotRunning("no agent is running; start one with `volunteer-app agent --background`")

    return VolunteerApp(
        settings=AgentSettings(config_dir=tmp_path / "config"),
        locate=(lambda: agent.address) if agent is not None else nowhere,
        clock=lambda: NOW,
        route_coordinator=agent.route if agent is not None else None,
        **kwargs,
    )


def steady(app: VolunteerApp) -> None:
    """No blinking cursors in a snapshot."""
    for field in app.screen.query(Input):
        field.cursor_blink = False


def show(
    mode: str, *, ready: Callable[[VolunteerApp], bool] | None = None
) -> Callable[[Pilot[Any]], Awaitable[None]]:
    async def run_before(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, VolunteerApp)
        await until(pilot, "the app to attach", lambda: app.attached)
        if app.state is not None and app.state.contribution is not None:
            # the charts' points are what the app saw while it was attached: give it a few minutes' worth
            for point in progress():
                app.history.record(point)
            app.agent_signal.publish(frozenset({"contribution"}))
        app.show_mode(mode)
        await until(pilot, f"the {mode} screen", lambda: app.current_mode == mode and app.screen.is_mounted)
        if ready is not None:
            await until(pilot, f"the {mode} screen's data", lambda: ready(app))
        await pilot.pause()
        steady(app)

    return run_before


def charts_full(app: VolunteerApp) -> bool:
    """The charts drew all the points (they redraw at most every few seconds) and the rank is shown (the
    leaderboard arrives on its own feed; the status panel shows it at its next refresh)."""
    charts = app.screen.query(LineChart)
    drawn = all(chart.points_drawn == 40 for chart in charts)
    return len(charts) == 2 and drawn and bool(app.board_entries) and "rank #" in screen_text(app)


READY: dict[str, Callable[[VolunteerApp], bool]] = {
    "contribute": charts_full,
    "model": lambda app: len(app.screen.query("PictureTile")) == 8,
    "leaderboard": lambda app: bool(app.board_entries) and app.screen.query_one("#board").row_count == 7,
    "machine": lambda app: app.state is not None and app.state.profile is not None,
    "settings": lambda app: True,
    "log": lambda app: "12 of 12" in str(app.screen.query_one("#log-view").border_title),
    "join": lambda app: app.screen.query_one("#run").value == "shapes",
}


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", SCREENS)
def test_screen(snap_compare: Any, tmp_path: Path, mode: str, size: tuple[int, int]) -> None:
    joined = mode != "join"
    state = agent_state(joined=joined, gpu=size[0] >= 120)
    answers: dict[str, Any] = {"runs": ResultMessage(message="1 run(s) open", data=[RUN])}
    with fixed_agent(state, answers=answers) as agent:
        app = make_app(agent, tmp_path, coordinator=None if joined else "https://train.example.org")
        assert snap_compare(app, terminal_size=size, run_before=show(mode, ready=READY[mode]))


def test_leaderboard_of_all_runs(snap_compare: Any, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await show("leaderboard", ready=READY["leaderboard"])(pilot)
        await pilot.press("t")
        app = pilot.app
        await until(pilot, "all runs", lambda: app.screen.query_one("#board").row_count == 3)

    with fixed_agent(agent_state()) as agent:
        assert snap_compare(make_app(agent, tmp_path), terminal_size=(80, 24), run_before=run_before)


def test_paused_by_the_policy(snap_compare: Any, tmp_path: Path) -> None:
    """The banner says why the machine does not compute."""
    reasons = ["outside the schedule (mon-fri 18:00-08:00; sat,sun all)"]
    state = agent_state(
        state="paused",
        policy=PolicyDecision(compute=False, reasons=reasons),
        contribution=contribution(
            state="paused", paused_by="policy", pause_reasons=reasons, samples_per_second=0.0
        ),
    )
    with fixed_agent(state) as agent:
        assert snap_compare(
            make_app(agent, tmp_path),
            terminal_size=(80, 24),
            run_before=show("contribute", ready=charts_full),
        )


def test_the_agent_is_not_running(snap_compare: Any, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, VolunteerApp)
        await until(pilot, "the notification", lambda: bool(app._notifications))
        await pilot.pause()

    assert snap_compare(make_app(None, tmp_path), terminal_size=(80, 24), run_before=run_before)


def test_the_quit_question(snap_compare: Any, tmp_path: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await show("contribute", ready=charts_full)(pilot)
        await pilot.press("q")
        await until(pilot, "the question", lambda: type(pilot.app.screen).__name__ == "QuitDialog")

    with fixed_agent(agent_state()) as agent:
        assert snap_compare(make_app(agent, tmp_path), terminal_size=(80, 24), run_before=run_before)


def test_a_refused_join_is_shown_in_place(snap_compare: Any, tmp_path: Path) -> None:
    answers: dict[str, Any] = {
        "runs": ResultMessage(message="1 run(s) open", data=[RUN]),
        "join": ErrorMessage(
            error="name_taken", detail="the name 'ada' is taken on this coordinator; choose another"
        ),
    }

    async def run_before(pilot: Pilot[Any]) -> None:
        await show("join", ready=READY["join"])(pilot)
        app = pilot.app
        name = app.screen.query_one("#name", Input)
        name.value = "ada"
        name.focus()
        await pilot.press("enter")
        await until(
            pilot, "the refusal", lambda: "taken" in str(app.screen.query_one("#name-problem").render())
        )
        steady(app)

    with fixed_agent(agent_state(joined=False), answers=answers) as agent:
        app = make_app(agent, tmp_path, coordinator="https://train.example.org")
        assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize("mode", ["contribute", "model"])
def test_light_theme(snap_compare: Any, tmp_path: Path, mode: str) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        pilot.app.theme = "textual-light"
        await show(mode, ready=READY[mode])(pilot)

    with fixed_agent(agent_state()) as agent:
        assert snap_compare(make_app(agent, tmp_path), terminal_size=(80, 24), run_before=run_before)

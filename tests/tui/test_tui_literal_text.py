"""What a coordinator, a peer or the agent writes is shown as text: no markup, no terminal escapes.

A run description ``[@click=app.snooze(86400)]Click me[/]`` used to become a link on the join screen
that snoozed the agent for a day with one click. Here hostile text goes in everywhere the app shows
others' words (a run description, a refusal, a command's answer in a notification, a leaderboard name, a
log line, the banner, a dialog), over the real control protocol to the app of ``tui.app``, and the test
checks what a volunteer would see and what a click does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import App
from textual.content import Content
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import Button, Input

from tests.tui.conftest import open_model_screen, screen_text, until
from tests.tui.fixed_agent import BOARD, LOG, NOW, RUN, agent_state, contribution, entry, running_agent
from tests.tui.test_app_parts import SIZE, app_test, make_app, sent
from tui.widgets.chrome import NavBar
from volunteer_app.control import ErrorMessage, LogEntry, ResultMessage

CLICK = "[@click=app.snooze(86400)]x[/]"
BOLD = "[b]bold[/b]"
ESCAPES = "\x1b]0;pwned\x07\x1b[2K"
HOSTILE = f"{CLICK} {BOLD} {ESCAPES}end"


def click_actions(app: App[Any]) -> list[str]:
    """The click actions in what the widgets of the screen (and its notifications) render, the
    navigation bar's own links excepted."""
    found = []
    for widget in app.screen.query("*"):
        if isinstance(widget, NavBar):
            continue
        try:
            rendered = widget.render()
        except Exception:  # a widget that draws by lines (a table, a chart) renders no content object
            continue
        if isinstance(rendered, (Content, Text)):
            found += [str(span.style) for span in rendered.spans if "@click" in str(span.style)]
    return found


def shows_literally(app: App[Any], what: str = "") -> None:
    """The hostile text is on the screen as its characters, its escapes neutralised."""
    text = screen_text(app)
    assert CLICK in text and BOLD in text, f"the markup must show as text ({what}):\n{text}"
    assert "\x1b" not in text, f"no escape sequence may reach the terminal ({what})"
    assert click_actions(app) == [], f"others' words must not make links ({what})"


async def click_on(pilot: Pilot[Any], words: str) -> None:
    """Click where ``words`` are shown (the first place): on others' words, which must not be a link."""
    for y, line in enumerate(screen_text(pilot.app).splitlines()):
        x = line.find(words)
        if x >= 0:
            await pilot.click(offset=(x + 1, y))
            return
    raise AssertionError(f"{words!r} is not on the screen:\n{screen_text(pilot.app)}")


def literal_in(widget: Widget, text: str) -> bool:
    rendered = widget.render()
    return isinstance(rendered, Content | Text) and text in rendered.plain


@app_test
async def test_a_run_description_and_a_refusal_are_text(tmp_path: Path) -> None:
    run = {**RUN, "description": HOSTILE}
    answers = {
        "runs": ResultMessage(message="1 run", data=[run]),
        "join": ErrorMessage(error="run_paused", detail=f"paused: {HOSTILE}"),
    }
    async with running_agent(agent_state(joined=False), answers=answers) as agent:
        app = make_app(agent, tmp_path, coordinator="https://train.example.org")
        async with app.run_test(size=(160, 40)) as pilot:
            await until(
                pilot, "the description", lambda: literal_in(app.screen.query_one("#run-problem"), CLICK)
            )
            shows_literally(app, "run description")
            await click_on(pilot, CLICK)
            await pilot.pause()

            app.screen.query_one("#join", Button).press()
            await until(
                pilot, "the refusal", lambda: literal_in(app.screen.query_one("#run-problem"), "Paused: ")
            )
            shows_literally(app, "refusal")
            await click_on(pilot, CLICK)
            await pilot.pause()
            assert not sent(agent, "snooze"), "clicking the coordinator's words must not snooze the agent"


@app_test
async def test_notifications_leaderboard_names_and_log_lines_are_text(tmp_path: Path) -> None:
    log = [
        *LOG,
        LogEntry(at=NOW - 1, level="warning", source="coordinator", message=f"organizers say: {HOSTILE}"),
    ]
    board = [
        *BOARD,
        entry(8, f"{BOLD}{ESCAPES}", 1_000, 0.1, 1.0, NOW - 3, True),
        entry(9, CLICK, 9, 0, 0, None, False),
    ]
    answers = {"pause": ResultMessage(message=f"paused; the coordinator says {HOSTILE}")}
    async with running_agent(agent_state(), log=log, board=board, answers=answers) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=(160, 48), notifications=True) as pilot:
            await until(pilot, "the last events", lambda: "organizers say" in screen_text(app))
            shows_literally(app, "last events")

            await pilot.press("p")
            await until(pilot, "the notification", lambda: "coordinator says" in screen_text(app))
            shows_literally(app, "notification")
            assert all("\x1b" not in str(n.message) and not n.markup for n in app._notifications)
            await click_on(pilot, CLICK)
            await pilot.pause()

            await pilot.press("3")
            await until(
                pilot,
                "the leaderboard",
                lambda: app.current_mode == "leaderboard" and BOLD in screen_text(app),
            )
            assert "[@click=app.sno" in screen_text(app), "the name's brackets show (cut to the column)"
            assert "\x1b" not in screen_text(app) and click_actions(app) == []
            await click_on(pilot, "[@click=app.sno")
            await pilot.pause()

            await pilot.press("6")
            await until(
                pilot, "the log", lambda: app.current_mode == "log" and "organizers say" in screen_text(app)
            )
            shows_literally(app, "log")
            assert not sent(agent, "snooze"), "clicking others' words must not snooze the agent"


@app_test
async def test_the_banner_and_the_leave_question_are_text(tmp_path: Path) -> None:
    state = agent_state(
        run=HOSTILE,
        contribution=contribution(state="waiting", run=HOSTILE, last_error=f"the coordinator: {HOSTILE}"),
    )
    async with running_agent(state) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=(200, 40)) as pilot:
            await until(pilot, "the banner", lambda: "the coordinator: " in screen_text(app))
            shows_literally(app, "banner")
            await click_on(pilot, CLICK)
            await pilot.pause()

            await pilot.press("l")
            await until(pilot, "the leave question", lambda: "Leave run [@click" in screen_text(app))
            shows_literally(app, "leave question")
            await click_on(pilot, CLICK)
            await pilot.pause()
            assert not sent(agent, "snooze"), "clicking the run's name must not snooze the agent"
            assert not sent(agent, "leave")


@app_test
async def test_the_agents_refusal_of_a_drawing_is_text(tmp_path: Path) -> None:
    answers = {"evaluate": ErrorMessage(error="not_ready", detail=f"the worker says {HOSTILE}")}
    async with running_agent(agent_state(), answers=answers) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await open_model_screen(pilot, app)
            box = app.screen.query_one("#prompt", Input)
            box.focus()
            box.value = "a [red]circle"  # the volunteer's own brackets: text too
            await pilot.press("enter")
            note = app.screen.query_one("#drawing-note")
            await until(pilot, "the refusal", lambda: literal_in(note, "worker says"))
            assert literal_in(note, CLICK) and literal_in(note, BOLD)
            assert "\x1b" not in str(note.render()), "no escape sequence may reach the terminal"
            assert click_actions(app) == []

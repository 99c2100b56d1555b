"""The app's parts without a swarm: what each screen sends the agent for what the volunteer does, and what
it shows for each answer (over the real control protocol, to the recorded agent of ``fixed_agent.py``;
``test_app_swarm.py`` does the same against the real agent). Plus the pure helpers: the banner, the
chart history, the coordinator's leaderboard messages, pictures."""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.tui.conftest import open_model_screen, screen_text, until
from tests.tui.fixed_agent import NOW, RUN, FixedAgent, agent_state, contribution, drawing, running_agent
from tui.app import VolunteerApp
from tui.formatting import banner
from tui.history import ContributionHistory
from tui.link import parse_board
from tui.widgets.picture import picture_of, shrink
from volunteer_app.control import ErrorMessage, PolicyDecision, ResultMessage
from volunteer_app.pictures import Picture
from volunteer_app.settings import AgentSettings

SIZE = (100, 32)


def app_test(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def make_app(agent: FixedAgent, tmp_path: Path, **kwargs: Any) -> VolunteerApp:
    return VolunteerApp(
        settings=AgentSettings(config_dir=tmp_path / "config"),
        locate=lambda: agent.address,
        clock=lambda: NOW,
        route_coordinator=agent.route,
        **kwargs,
    )


def sent(agent: FixedAgent, command: str) -> list[dict[str, Any]]:
    return [c for c in agent.commands if c.get("command") == command]


@app_test
async def test_an_invite_only_run_asks_for_its_code(tmp_path: Path) -> None:
    run = {**RUN, "name": "secret", "visibility": "invite"}
    answers = {
        "runs": ResultMessage(message="1 run", data=[run]),
        "join": ErrorMessage(
            error="invalid_invite_code", detail="that invite code is not valid for run 'secret'"
        ),
    }
    async with running_agent(agent_state(joined=False), answers=answers) as agent:
        app = make_app(agent, tmp_path, coordinator="https://train.example.org")
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the run list", lambda: app.screen.query_one("#run").value == "secret")
            invite = app.screen.query_one("#invite")
            assert invite.display, "an invite-only run shows the invite field"
            invite.value = "inv-wrong"
            invite.focus()
            await pilot.press("enter")
            await until(
                pilot, "the refusal", lambda: app.screen.query_one("#invite-problem").has_class("-problem")
            )
            assert "not valid" in screen_text(app) and "Check the invite code" in screen_text(app)
            assert sent(agent, "join")[0]["invite_code"] == "inv-wrong"
            assert sent(agent, "join")[0]["coordinator"] == "https://train.example.org"


@app_test
async def test_settings_are_checked_before_they_are_sent(tmp_path: Path) -> None:
    answers = {"settings": ResultMessage(message="battery_pause_below = 20.0", data={"restart": []})}
    async with running_agent(agent_state(), answers=answers) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the agent", lambda: app.attached)
            await pilot.press("5")
            await until(
                pilot, "the settings", lambda: app.current_mode == "settings" and app.screen.is_mounted
            )
            below = app.screen.query_one("#edit-battery_pause_below")
            below.focus()
            below.value = "120"
            await until(
                pilot,
                "the problem",
                lambda: app.screen.query_one("#setting-battery_pause_below").has_class("-invalid"),
            )
            await pilot.press("enter")
            await pilot.pause()
            assert not sent(agent, "settings"), "an invalid value is not sent"
            below.value = "20"
            await pilot.press("enter")
            await until(pilot, "the command", lambda: sent(agent, "settings"))
            assert sent(agent, "settings")[0]["values"] == {"battery_pause_below": 20.0}
            await until(pilot, "the note", lambda: "Applied" in screen_text(app))

            schedule = app.screen.query_one("#edit-schedule")
            schedule.focus()
            schedule.value = "mon-fri 18:00-08:00; someday"
            await until(
                pilot,
                "the schedule problem",
                lambda: (
                    "is not a schedule window"
                    in str(app.screen.query_one("#setting-schedule .setting-problem").render())
                ),
            )


@app_test
async def test_snooze_and_leave_ask_first(tmp_path: Path) -> None:
    async with running_agent(agent_state()) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the agent", lambda: app.attached)
            await pilot.press("z")
            await until(pilot, "the snooze question", lambda: "Snooze for how long" in screen_text(app))
            field = app.screen.query_one("#duration")
            field.value = "soon"
            await until(pilot, "the problem", lambda: "is not a duration" in screen_text(app))
            await pilot.press("enter")
            await pilot.pause()
            assert not sent(agent, "snooze")
            field.value = "1h30m"
            await pilot.press("enter")
            await until(pilot, "the snooze", lambda: sent(agent, "snooze"))
            assert sent(agent, "snooze")[0]["seconds"] == 5400

            await pilot.press("l")
            await until(pilot, "the leave question", lambda: "Leave run shapes?" in screen_text(app))
            await pilot.press("n")
            await pilot.pause()
            assert not sent(agent, "leave")
            await pilot.press("l")
            await until(pilot, "the leave question", lambda: "Leave run shapes?" in screen_text(app))
            await pilot.press("y")
            await until(pilot, "the leave", lambda: sent(agent, "leave"))


@app_test
async def test_the_prompt_box_draws_a_caption(tmp_path: Path) -> None:
    caption = "a small red circle at the top"
    picture = {
        "prompt": caption,
        "kind": "image",
        "image": drawing([("circle", "red", 16, 6, 4)]),
        "correct": True,
    }
    answers = {
        "evaluate": ResultMessage(message="epoch 41", data={"at": NOW, "epoch": 41, "samples": [picture]})
    }
    async with running_agent(agent_state(), answers=answers) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await open_model_screen(pilot, app)
            box = app.screen.query_one("#prompt")
            box.focus()
            box.value = caption
            await pilot.press("enter")
            await until(pilot, "the drawing", lambda: app.screen.query("#drawing PictureTile"))
            assert sent(agent, "evaluate")[0]["prompts"] == [caption]
            assert "✓ a small red" in screen_text(app), screen_text(app)

            agent.answers["evaluate"] = ResultMessage(
                message="epoch 41",
                data={
                    "at": NOW,
                    "epoch": 41,
                    "samples": [{"prompt": "a dog", "error": "'a dog' must name exactly one size, found 0"}],
                },
            )
            box.value = "a dog"
            await pilot.press("enter")
            await until(pilot, "the refusal", lambda: "cannot draw that" in screen_text(app))
            assert "must name exactly one size" in screen_text(app)

            agent.answers["evaluate"] = ErrorMessage(
                error="not_ready", detail="the training worker is not running yet"
            )
            await pilot.press("escape", "e")
            await until(
                pilot,
                "the agent's refusal",
                lambda: "still starting" in str(app.screen.query_one("#drawing-note").render()),
            )


@app_test
async def test_the_log_is_saved_for_a_bug_report(tmp_path: Path) -> None:
    state = agent_state(config_dir=str(tmp_path / "agent-config"))
    logs = tmp_path / "agent-config" / "logs"
    logs.mkdir(parents=True)
    (logs / "worker-shapes.log").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    async with running_agent(state) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the agent", lambda: app.attached)
            await pilot.press("6")
            await until(
                pilot,
                "the log",
                lambda: "12 of 12 messages" in str(app.screen.query_one("#log-view").border_title),
            )
            app.screen.query_one("#level").value = "warning"
            await until(
                pilot,
                "the filter",
                lambda: "2 of 12 messages" in str(app.screen.query_one("#log-view").border_title),
            )
            await pilot.press("c")
            await until(pilot, "the report", lambda: list(logs.glob("bug-report-*.txt")))
            report = next(logs.glob("bug-report-*.txt")).read_text()
            assert "the coordinator did not answer" in report and "RuntimeError: boom" in report
            assert "run shapes at https://train.example.org as ada" in report
            assert any("saved a full report" in str(n.message) for n in app._notifications)


@app_test
async def test_the_palette_offers_the_actions(tmp_path: Path) -> None:
    async with running_agent(agent_state()) as agent:
        app = make_app(agent, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the agent", lambda: app.attached)
            titles = {command.title for command in app.get_system_commands(app.screen)}
            assert {
                "Pause",
                "Resume",
                "Finish",
                "Snooze 1 h 00 min",
                "Leave the run",
                "Show Leaderboard",
            } <= titles
            next(c for c in app.get_system_commands(app.screen) if c.title == "Pause").callback()
            await until(pilot, "the pause", lambda: sent(agent, "pause"))


# ----------------------------------------------------------------------------------------- pure parts
def test_the_banner_says_why_it_is_paused() -> None:
    state = agent_state(
        paused_by_user=True,
        policy=PolicyDecision(compute=False, reasons=["paused by you"]),
        contribution=contribution(state="paused", paused_by="volunteer", pause_reasons=["paused by you"]),
    )
    assert banner(state, attached=True, now=NOW) == ("Paused: paused by you · r resumes", "paused")
    snoozed = state.model_copy(update={"snoozed_until": NOW + 5400})
    assert banner(snoozed, attached=True, now=NOW)[0].startswith(
        "Snoozed (paused by you); resumes in 1 h 30 min"
    )
    assert banner(state, attached=False, now=NOW)[1] == "error"
    idle = agent_state(joined=False)
    assert banner(idle, attached=True, now=NOW)[0] == "Not contributing to any run. Press j to join one."
    lost = agent_state(contribution=contribution(coordinator_ok=False))
    assert "coordinator is unreachable" in banner(lost, attached=True, now=NOW)[0]


def test_the_chart_history_follows_one_session_and_stays_small() -> None:
    history = ContributionHistory(max_points=100)
    for i in range(1, 1000):
        history.record(contribution(samples_total=i * 16, samples_per_second=float(i), loss=1.0 / i))
    assert 50 <= len(history.speed) <= 100 and len(history.speed) == len(history.loss)
    assert history.speed.x == sorted(history.speed.x) and history.speed.x[-1] >= 990 * 16
    assert not history.record(contribution(samples_total=999 * 16)), "no new samples, no new point"
    history.record(contribution(session_id="another", samples_total=64))
    assert history.speed.x == [64], "a new session starts a new chart"


def test_malformed_leaderboard_entries_are_left_out() -> None:
    run, entries = parse_board(
        {
            "run": RUN,
            "leaderboard": [
                {"rank": 1, "volunteer": "grace", "samples": 5, "verified_samples": 5, "compute_seconds": 1,
                 "samples_per_second": 1, "last_seen": None, "devices": [], "flagged": 0, "online": True},
                {"rank": "first", "volunteer": "mallory"},
                "junk",
            ],
        }
    )  # fmt: skip
    assert run is not None and run.name == "shapes"
    assert [e.volunteer for e in entries] == ["grace"]
    assert parse_board({"run": "junk", "leaderboard": None}) == (None, [])


def test_pictures_from_the_agent_are_checked() -> None:
    pixels = base64.b64encode(bytes([255, 0, 0] * 4)).decode()
    picture = picture_of({"width": 2, "height": 2, "pixels": pixels})
    assert picture is not None and picture.pixel(1, 1) == (255, 0, 0)
    assert picture_of({"width": 3, "height": 2, "pixels": pixels}) is None, "size and bytes disagree"
    assert picture_of({"width": 2, "height": 2, "pixels": "not base64!"}) is None
    assert picture_of({"width": 100_000, "height": 1, "pixels": pixels}) is None
    assert picture_of(None) is None
    half = shrink(Picture(2, 2, bytes([0, 0, 0, 200, 200, 200, 0, 0, 0, 200, 200, 200])), 2)
    assert (half.width, half.height, half.pixel(0, 0)) == (1, 1, (100, 100, 100))


@pytest.mark.parametrize(
    "code", ["name_taken", "invite_required", "coordinator_unreachable", "worker_failing", "new_code"]
)
def test_every_refusal_says_what_to_do(code: str) -> None:
    from tui.formatting import refusal

    text = refusal("the agent said no", code)
    assert text.startswith("The agent said no.")
    if code != "name_taken":  # the agent's own words say it there
        assert len(text) > len("The agent said no.") + 10

"""The app against the real thing: a `volunteer-coordinator serve` process, a `volunteer-app agent`
process and its training worker on loopback, driven with Textual's pilot. One coordinator and one
agent serve the whole module (each test joins when it needs training, so any test also runs alone).

What a volunteer would notice: the first run leads to training and a refusal is shown in place; the
pause, resume and finish keys take effect in the agent; a settings change reaches the agent; another
volunteer's credit arrives on the leaderboard over the coordinator's websocket; killing the agent is
said plainly and the app reattaches when it is back; quitting keeps the agent training or stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import python_env, start_serve, stop_serve
from tests.tui.conftest import agent_call, screen_text, until
from tui.app import VolunteerApp
from volunteer_app.control import AgentState, JoinCommand
from volunteer_app.control_client import AgentNotRunning, get_state, locate_agent, send_command
from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.settings import AgentSettings

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]

SIZE = (100, 32)
TRAINING = 240.0  # seconds a join may take to reach the first trained samples on a busy 2-core machine


@dataclass
class Swarm:
    url: str
    data: Path
    config_dir: Path

    @property
    def settings(self) -> AgentSettings:
        return AgentSettings(config_dir=self.config_dir, benchmark_seconds=1)

    def state(self) -> AgentState:
        return get_state(locate_agent(self.settings))

    def agent_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            return int(json.loads((self.config_dir / "agent.json").read_text())["pid"])
        return None

    def start_agent(self) -> Any:
        """What the app's "start the agent" does: `volunteer-app agent --background` (the CLI's own helper)."""
        from volunteer_app.cli import start_background_agent

        return start_background_agent(self.settings, argparse.Namespace(listen_host="127.0.0.1"))

    def app(self, **kwargs: Any) -> VolunteerApp:
        return VolunteerApp(settings=self.settings, start_agent=self.start_agent, **kwargs)

    def kill_agent(self) -> None:
        pid = self.agent_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def training(self) -> AgentState:
        """The agent, contributing to run shapes with trained samples: started and joined if need be."""
        try:
            address = locate_agent(self.settings)
        except AgentNotRunning:
            address = self.start_agent()
        state = get_state(address)
        c = state.contribution
        if c is None or c.state in ("stopped", "failed"):
            send_command(address, "resume")
            agent_call(self.settings, JoinCommand(coordinator=self.url, run="shapes", name="ada"))
        elif state.paused_by_user or state.snoozed_until:
            send_command(address, "resume")
        deadline = time.monotonic() + TRAINING
        while time.monotonic() < deadline:
            state = get_state(address)
            c = state.contribution
            if c is not None and c.state == "training" and c.samples_total > 0:
                return state
            time.sleep(0.5)
        raise AssertionError(f"the agent did not start training: {state.model_dump_json()[:2000]}")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    root = tmp_path_factory.mktemp("tui-swarm")
    data = root / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=64", "--config",
         "num_shards=512"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    # the agents this module starts inherit a short speed test (the config dir is passed to them)
    previous = os.environ.get("VOLUNTEER_BENCHMARK_SECONDS")
    os.environ["VOLUNTEER_BENCHMARK_SECONDS"] = "1"
    swarm = Swarm(url=url, data=data, config_dir=root / "volunteer")
    swarm.start_agent()
    try:
        yield swarm
    finally:
        swarm.kill_agent()
        if previous is None:
            os.environ.pop("VOLUNTEER_BENCHMARK_SECONDS", None)
        else:
            os.environ["VOLUNTEER_BENCHMARK_SECONDS"] = previous
        stop_serve(process)
        for p in started:
            if p.poll() is None:
                p.kill()


def run_app_test(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test (the pilot) in its own event loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def shows(app: VolunteerApp, mode: str) -> bool:
    return app.current_mode == mode and app.screen.is_mounted


def text(app: VolunteerApp, selector: str) -> str:
    return str(app.screen.query_one(selector).render())


@run_app_test
async def test_first_run_to_training(swarm: Swarm) -> None:
    """An idle agent: the app opens on the first-run screen; a wrong address is refused in place; the
    run is chosen from the coordinator's list; Join leads to the contribute screen, training."""
    with contextlib.suppress(Exception):
        send_command(locate_agent(swarm.settings), "leave")
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the first-run screen", lambda: app.attached and shows(app, "join"))
        coordinator = app.screen.query_one("#coordinator")
        coordinator.value = "http://127.0.0.1:9"  # nothing listens there
        coordinator.focus()
        await pilot.press("enter")
        await until(
            pilot, "the refusal", lambda: app.screen.query_one("#coordinator-problem").has_class("-problem")
        )
        assert "http://127.0.0.1:9" in text(app, "#coordinator-problem")

        coordinator.value = swarm.url
        await pilot.press("enter")
        await until(pilot, "the coordinator's runs", lambda: app.screen.query_one("#run").value == "shapes")
        assert not app.screen.query_one("#coordinator-problem").has_class("-problem")
        name = app.screen.query_one("#name")
        name.value = "ada"
        name.focus()
        await pilot.press("enter")  # Enter in the name field joins
        await until(pilot, "the contribute screen", lambda: shows(app, "contribute"), timeout=TRAINING)
        await until(
            pilot,
            "training",
            lambda: app.state.contribution.state == "training" and app.state.contribution.samples_total > 0,
            timeout=TRAINING,
        )
        # What the terminal shows follows the state within a repaint or two.
        await until(
            pilot,
            "the screen to show training",
            lambda: (
                "Contributing to run shapes as ada" in (shown := screen_text(app))
                and "training" in shown
                and re.search(r"Trained\s+[1-9][\d,]* samples", shown)
            ),
        )
        assert swarm.state().contribution.name == "ada"


@run_app_test
async def test_pause_resume_and_finish_keys(swarm: Swarm) -> None:
    swarm.training()
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            "training on the contribute screen",
            lambda: app.attached and shows(app, "contribute"),
        )

        await pilot.press("p")
        await until(
            pilot, "the agent to pause", lambda: swarm.state().contribution.state == "paused", timeout=60
        )
        await until(pilot, "the reason on screen", lambda: "Paused: paused by you" in screen_text(app))
        held = swarm.state().contribution.samples_total

        await pilot.press("r")
        await until(
            pilot, "training again", lambda: swarm.state().contribution.samples_total > held, timeout=120
        )
        await until(pilot, "the banner", lambda: "Contributing to run shapes" in screen_text(app))

        # a lease of 64 samples trains in under a second, and the agent may hold no lease at all for a
        # while (it waits for the swarm to confirm its first shards): press "f" with a lease in hand, or
        # one that finished after `completed` was read (then "f" pauses at once)
        completed = swarm.state().contribution.leases_completed

        def lease_in_hand() -> bool:
            c = swarm.state().contribution
            return c.state == "training" and c.leases_in_hand >= 1

        await until(pilot, "a lease in hand", lease_in_hand, timeout=120)
        await pilot.press("f")

        def finished() -> bool:
            c = swarm.state().contribution
            return c.state == "paused" and c.leases_completed > completed and not c.finishing

        await until(pilot, "the lease to be finished, then a pause", finished, timeout=180)
        await until(pilot, "the pause on screen", lambda: "Paused" in screen_text(app))
        await pilot.press("r")
        await until(
            pilot, "training again", lambda: swarm.state().contribution.state == "training", timeout=120
        )


@run_app_test
async def test_a_settings_change_is_applied_live(swarm: Swarm) -> None:
    swarm.training()
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached)
        await pilot.press("5")
        await until(pilot, "the settings screen", lambda: shows(app, "settings"))
        field = app.screen.query_one("#edit-max_threads")
        field.focus()
        field.value = "0"
        await until(
            pilot,
            "the problem in place",
            lambda: app.screen.query_one("#setting-max_threads").has_class("-invalid"),
        )
        assert "greater than or equal to 1" in text(app, "#setting-max_threads .setting-problem")
        await pilot.press("enter")  # refused here: nothing is sent
        assert swarm.state().settings.max_threads != 0

        field.value = "1"
        await pilot.press("enter")
        await until(pilot, "the agent's setting", lambda: swarm.state().settings.max_threads == 1, timeout=30)
        await until(
            pilot, "the note", lambda: "Applied" in text(app, "#setting-max_threads .setting-problem")
        )
        await until(
            pilot, "the worker's threads", lambda: swarm.state().contribution.threads == 1, timeout=60
        )

        # a change made elsewhere (the shell) shows up here
        send_command(locate_agent(swarm.settings), "settings", {"idle_minutes": "7"})
        await until(
            pilot, "the shell's change", lambda: app.screen.query_one("#edit-idle_minutes").value == "7"
        )


@run_app_test
async def test_the_leaderboard_updates_over_the_websocket(swarm: Swarm) -> None:
    swarm.training()
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached)
        await pilot.press("3")
        await until(pilot, "the live feed", lambda: app.board_live and app.board_entries, timeout=30)
        await until(pilot, "ada's row", lambda: "▶ ada" in screen_text(app))
        assert "bob" not in screen_text(app)

        # another volunteer credits a lease at the coordinator: the row arrives without a reload
        await asyncio.to_thread(bob_credits_a_lease, swarm.url, swarm.data.parent)
        # (bob's join alone already brings an empty row: wait for the one with his credit)
        await until(
            pilot,
            "bob's credited row",
            lambda: (
                any(e.volunteer == "bob" and e.samples > 0 for e in app.board_entries)
                and "bob" in screen_text(app)
            ),
            timeout=30,
        )


def bob_credits_a_lease(url: str, root: Path) -> None:
    api = f"{url}/api/v1"
    registered = httpx.post(f"{api}/volunteers", json={"name": "bob"}, timeout=30)
    assert registered.status_code == 201, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['credential']}"}
    key = public_key_openssh(ensure_rsa_key(root / "bob.rsa"))
    profile = {"cpu_model": "laptop", "cpu_cores": 4, "cpu_threads": 8, "ram_bytes": 8_000_000_000}
    joined = httpx.post(
        f"{api}/runs/shapes/join",
        json={"agent_version": "test", "peer_public_key": key, "profile": profile},
        headers=headers,
        timeout=30,
    )
    assert joined.status_code == 200, joined.text
    session, lease = joined.json()["session_id"], joined.json()["lease"]["lease_id"]
    deadline = time.monotonic() + 120
    while True:  # a lease cannot be complete before its minimum duration: the coordinator says how long
        done = httpx.post(
            f"{api}/sessions/{session}/leases/{lease}/complete",
            json={"samples": 64, "compute_seconds": 2},
            headers=headers,
            timeout=30,
        )
        if done.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(float(done.headers.get("Retry-After", "1")))
    assert done.status_code == 200, done.text


@run_app_test
async def test_the_agent_restarted_under_the_app(swarm: Swarm) -> None:
    swarm.training()
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached and shows(app, "contribute"))
        swarm.kill_agent()
        await until(pilot, "the app to say so", lambda: not app.attached, timeout=30)
        await until(pilot, "the banner", lambda: "The agent is not running" in screen_text(app))
        assert any("Lost the agent" in str(n.message) for n in app._notifications)

        await pilot.press("a")  # start it again from the app; it rejoins the run it was in
        await until(pilot, "the app to reattach", lambda: app.attached, timeout=90)
        await until(
            pilot,
            "training after the restart",
            lambda: (
                app.state.contribution is not None
                and app.state.contribution.state == "training"
                and app.state.contribution.samples_total > 0
            ),
            timeout=TRAINING,
        )
        await until(pilot, "the banner", lambda: "Contributing to run shapes" in screen_text(app))


@run_app_test
async def test_quitting_asks_and_remembers(swarm: Swarm) -> None:
    """q asks once: keep contributing in the background (remembered), and the agent trains on."""
    swarm.training()
    send_command(locate_agent(swarm.settings), "settings", {"remember_quit_choice": "ask"})
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached)
        await pilot.press("q")
        await until(pilot, "the question", lambda: "Keep contributing to run shapes" in screen_text(app))
        await pilot.click("#remember")
        await pilot.press("b")
        await until(pilot, "the app to end", lambda: app.return_value is not None, timeout=30)
    assert "keeps contributing in the background" in str(app.return_value)
    state = swarm.state()
    assert state.settings.remember_quit_choice == "background"
    held = state.contribution.samples_total
    deadline = time.monotonic() + 120
    while swarm.state().contribution.samples_total <= held:
        assert time.monotonic() < deadline, "the agent must train on after the app quit"
        time.sleep(0.5)

    # remembered: the next quit does not ask
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached)
        await pilot.press("q")
        await until(pilot, "the app to end", lambda: app.return_value is not None, timeout=30)
    assert "background" in str(app.return_value)


@run_app_test
async def test_quitting_can_stop_the_agent(swarm: Swarm) -> None:
    swarm.training()
    send_command(locate_agent(swarm.settings), "settings", {"remember_quit_choice": "ask"})
    pid = swarm.agent_pid()
    app = swarm.app()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the agent", lambda: app.attached)
        await pilot.press("q")
        await until(pilot, "the question", lambda: "or stop?" in screen_text(app))
        await pilot.press("s")
        await until(pilot, "the app to end", lambda: app.return_value is not None, timeout=300)
    assert "stops" in str(app.return_value), app.return_value
    deadline = time.monotonic() + 120
    while pid is not None and _alive(pid):
        assert time.monotonic() < deadline, "the agent must end after the app stopped it"
        time.sleep(0.2)
    with pytest.raises(AgentNotRunning):
        locate_agent(swarm.settings)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return True

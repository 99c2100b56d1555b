"""Helpers of the app's tests: waiting for what the app shows, reading the screen as text, and
sending the agent a command."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel
from textual.app import App
from textual.css.query import NoMatches
from textual.pilot import Pilot

from tests.conftest import launch_chromium
from volunteer_app.control import ResultMessage
from volunteer_app.control_client import AgentConnection, locate_agent
from volunteer_app.settings import AgentSettings

if TYPE_CHECKING:
    from playwright.sync_api import Browser


async def until(pilot: Pilot[Any], what: str, condition: Callable[[], Any], timeout: float = 20) -> None:
    """Wait for ``condition`` (a widget it asks for may not be mounted yet); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except NoMatches:
            pass
        if time.monotonic() > deadline:
            app = pilot.app
            raise AssertionError(f"timed out waiting for {what}; the screen shows:\n{screen_text(app)}")
        await pilot.pause(0.1)


async def open_model_screen(pilot: Pilot[Any], app: Any) -> None:
    """Wait for the app to attach to the agent, then open the model screen (key 2) and wait for it."""
    await until(pilot, "the agent", lambda: app.attached)
    await pilot.press("2")
    await until(pilot, "the model", lambda: app.current_mode == "model" and app.screen.is_mounted)


def screen_text(app: App[Any]) -> str:
    """What the terminal shows now, as plain lines (the current screen and any dialog over it)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text.rstrip() for strip in strips)


def agent_call(settings: AgentSettings, command: BaseModel, *, timeout: float = 600) -> ResultMessage:
    """One command over the agent's websocket, from any thread (also inside a running event loop).

    Long commands (join) go over the websocket: the HTTP command endpoint answers within the
    websocket server's handshake timeout only.
    """

    async def call() -> ResultMessage:
        async with AgentConnection(locate_agent(settings)) as connection:
            return await connection.call(command, timeout=timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, call()).result()


# ----------------------------------------------------------------------------------------- the browser
def stop_web_server(process: subprocess.Popen[str]) -> None:
    """SIGTERM to a web server's process group; SIGKILL if it has not exited 20 s later."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=20)


def wait_for_web_link(
    process: subprocess.Popen[str], lines: list[str], what: str, timeout: float = 60
) -> str:
    """Read a starting web server's output into ``lines`` until it prints the link it serves at; the link.
    Fails, with ``what`` and the output, when it exits or ``timeout`` s pass first."""
    assert process.stdout is not None
    link = None
    deadline = time.monotonic() + timeout
    while link is None and time.monotonic() < deadline:
        if select.select([process.stdout], [], [], 0.5)[0]:
            line = process.stdout.readline()
            lines.append(line)
            if "serving volunteer-app at " in line:
                link = line.split("serving volunteer-app at ", 1)[1].split()[0]
        elif process.poll() is not None:
            break
    assert link is not None, f"{what} did not start: {''.join(lines)}"
    return link


@pytest.fixture
def browser() -> Iterator[Browser]:
    yield from launch_chromium()

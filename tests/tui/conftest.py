"""Helpers of the app's tests: waiting for what the app shows, reading the screen as text, and
sending the agent a command."""

from __future__ import annotations

import asyncio
import concurrent.futures
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
@pytest.fixture
def browser() -> Iterator[Browser]:
    yield from launch_chromium()

"""The app's two connections: to the local agent (its control API) and to the coordinator's live feed.

Both run as async workers of the app, post :mod:`tui.messages` and never raise: a lost connection is
announced once and retried with backoff until it is back (the agent restarted, the network returned).
The TUI is a client only: whatever happens here, the agent and its worker go on training.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError
from textual.message import Message

from tui.messages import (
    AgentAttached,
    AgentChanged,
    AgentLogged,
    AgentLost,
    LeaderboardChanged,
    LeaderboardStatus,
)
from volunteer_app.control import LogEntry
from volunteer_app.control_client import AgentAddress, AgentConnection, AgentNotRunning, ControlError
from volunteer_app.protocol import Leaderboard, LeaderboardEntry, RunOut
from volunteer_app.safetext import one_line

Post = Callable[[Message], Any]

PROBLEM_LIMIT = 200
"""Characters of a coordinator's error detail the app quotes (the coordinator decides what it sends)."""


class AgentLink:
    """Keeps one live connection to the agent, reattaching whenever it comes back.

    :param locate: where the agent is (``locate_agent(settings)`` in the app); raises
        :class:`AgentNotRunning` when none runs.
    :param post: where the messages go (the app's ``post_message``).
    :param retry: the first and the longest wait between attempts to attach, in seconds.
    """

    def __init__(
        self,
        *,
        locate: Callable[[], AgentAddress],
        post: Post,
        retry: tuple[float, float] = (0.5, 3.0),
        open_timeout: float = 5.0,
    ):
        self.locate = locate
        self.post = post
        self.retry = retry
        self.open_timeout = open_timeout
        self.connection: AgentConnection | None = None
        self.wake = asyncio.Event()

    @property
    def attached(self) -> bool:
        return self.connection is not None and not self.connection.closed.is_set()

    async def call(self, command: Any, *, timeout: float = 300.0) -> Any:
        """Send a command to the agent; :class:`ControlError` when it refuses or is not attached."""
        connection = self.connection
        if connection is None or connection.closed.is_set():
            raise ControlError("agent_unreachable", "this window is not attached to the agent")
        return await connection.call(command, timeout=timeout)

    async def run(self) -> None:
        """Attach, follow, reattach: forever (the app cancels it on exit)."""
        was_attached, announced = False, False
        delay = self.retry[0]
        while True:
            try:
                address = self.locate()
                connection = AgentConnection(address, open_timeout=self.open_timeout)
                await connection.__aenter__()
            except (AgentNotRunning, ControlError) as exc:
                if not announced:
                    self.post(AgentLost(str(exc), was_attached=was_attached))
                    announced = True
                await self._wait(delay)
                delay = min(delay * 2, self.retry[1])
                continue
            self.connection, delay, announced, was_attached = connection, self.retry[0], False, True
            self.post(AgentAttached(address.url))
            try:
                await self._follow(connection)
            finally:
                self.connection = None
                await connection.close()
            self.post(AgentLost("the agent closed the connection (it stopped or crashed)", was_attached=True))
            announced = True

    async def _wait(self, delay: float) -> None:
        """Wait before the next attempt; :meth:`retry_now` cuts it short (the volunteer started the agent)."""
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), delay)

    def retry_now(self) -> None:
        self.wake.set()

    async def _follow(self, connection: AgentConnection) -> None:
        while True:
            item = await connection.next_event()
            if item is None:
                return
            if isinstance(item, LogEntry):
                self.post(AgentLogged([item]))
            else:
                self.post(AgentChanged(frozenset(item)))


# ----------------------------------------------------------------------------------------- coordinator
def _ws_base(coordinator: str) -> str:
    return coordinator.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)


def parse_board(message: dict[str, Any]) -> tuple[RunOut | None, list[LeaderboardEntry]]:
    """A live-feed message's run and entries; entries the coordinator sent malformed are left out."""
    run = None
    raw_run = message.get("run")
    if isinstance(raw_run, dict):
        try:
            run = RunOut.model_validate(raw_run)
        except ValidationError:
            run = None
    entries = []
    for raw in message.get("leaderboard") or []:
        try:
            entries.append(LeaderboardEntry.model_validate(raw))
        except ValidationError:
            continue
    return run, entries


class LeaderboardFeed:
    """Follows one run's live feed at the coordinator (``WS /api/v1/runs/{run}/live``).

    The coordinator pushes the run's stats and leaderboard when they change; this posts them as
    :class:`LeaderboardChanged` and says through :class:`LeaderboardStatus` when the feed is down.
    """

    def __init__(
        self,
        *,
        coordinator: str,
        run: str,
        post: Post,
        address: str | None = None,
        retry: tuple[float, float] = (2.0, 60.0),
    ):
        self.coordinator = coordinator.rstrip("/")
        self.address = (address or coordinator).rstrip("/")
        self.run = run
        self.post = post
        self.retry = retry

    @property
    def url(self) -> str:
        return f"{_ws_base(self.address)}/api/v1/runs/{quote(self.run, safe='')}/live"

    async def follow(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

        delay = self.retry[0]
        while True:
            problem: str | None = None
            wait = delay
            code: int | None = None
            try:
                async with connect(self.url, open_timeout=10, max_size=8 << 20) as ws:
                    live = False
                    try:
                        async for raw in ws:
                            message = json.loads(raw)
                            kind = message.get("type") if isinstance(message, dict) else None
                            if kind in ("snapshot", "update"):
                                run, entries = parse_board(message)
                                if not live:
                                    live, delay = True, self.retry[0]
                                    self.post(LeaderboardStatus(live=True))
                                self.post(LeaderboardChanged(self.coordinator, run, entries))
                            elif kind == "error":  # the coordinator's words: one line, bounded
                                problem = one_line(
                                    message.get("detail") or message.get("error"), limit=PROBLEM_LIMIT
                                )
                    except ConnectionClosed:
                        pass
                    code = ws.close_code
            except (OSError, asyncio.TimeoutError, InvalidHandshake, InvalidURI) as exc:
                problem = f"the live leaderboard is unreachable ({exc or type(exc).__name__})"
            except ValueError as exc:  # not JSON: something else answers at this address
                problem = f"the coordinator's live feed sent something unreadable ({exc})"
            if code == 4404:
                problem, wait = f"the coordinator has no run {self.run!r} (any more)", self.retry[1]
            elif code == 4429:
                problem, wait = problem or "the coordinator limits live feeds per address", self.retry[1]
            elif problem is None:
                problem = "the coordinator closed the live feed"
            self.post(LeaderboardStatus(live=False, problem=f"{problem}; retrying in {wait:.0f} s"))
            await asyncio.sleep(wait * random.uniform(0.9, 1.1))
            delay = min(delay * 2, self.retry[1])


class CoordinatorUnavailable(Exception):
    """The coordinator's leaderboard could not be read; the message says why."""


async def fetch_overall_leaderboard(
    coordinator: str, *, address: str | None = None, timeout: float = 10.0
) -> Leaderboard:
    """``GET /api/v1/leaderboard``: every volunteer over all runs (``address``: where to reach ``coordinator``)."""
    import httpx

    url = f"{(address or coordinator).rstrip('/')}/api/v1/leaderboard"
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise CoordinatorUnavailable(f"the coordinator at {coordinator} did not answer ({exc})") from exc
    if response.status_code != 200:
        detail: Any = response.text[:PROBLEM_LIMIT]
        with contextlib.suppress(ValueError, AttributeError):
            detail = response.json().get("detail", detail)
        raise CoordinatorUnavailable(
            f"the coordinator answered {response.status_code}: {one_line(detail, limit=PROBLEM_LIMIT)}"
        )
    try:
        return Leaderboard.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise CoordinatorUnavailable(f"the coordinator's leaderboard is unreadable ({exc})") from exc

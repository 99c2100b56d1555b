"""App-wide messages: what the app's background workers (the agent link, the leaderboard feed) tell it.

The app keeps the state they carry and fans it out to the screens with signals (see ``VolunteerApp``);
widgets post their own messages, defined next to them.
"""

from __future__ import annotations

from textual.message import Message

from volunteer_app.control import LogEntry
from volunteer_app.protocol import LeaderboardEntry, RunOut


class AgentAttached(Message):
    """A connection to the agent is open; the app's ``state`` holds its snapshot."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url


class AgentChanged(Message):
    """Fields of the agent's state changed (names of ``AgentState`` fields)."""

    def __init__(self, fields: frozenset[str]) -> None:
        super().__init__()
        self.fields = fields


class AgentLogged(Message):
    """New log lines from the agent (its own, the worker's, the policy's)."""

    def __init__(self, entries: list[LogEntry]) -> None:
        super().__init__()
        self.entries = entries


class AgentLost(Message):
    """The agent went away, or could not be found; the link keeps trying to reattach."""

    def __init__(self, reason: str, *, was_attached: bool) -> None:
        super().__init__()
        self.reason = reason
        self.was_attached = was_attached


class LeaderboardChanged(Message):
    """The coordinator's live feed sent a run's stats and leaderboard."""

    def __init__(self, coordinator: str, run: RunOut | None, entries: list[LeaderboardEntry]) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.run = run
        self.entries = entries


class LeaderboardStatus(Message):
    """The live feed connected, or lost its connection (``problem`` says why and what happens next)."""

    def __init__(self, *, live: bool, problem: str | None = None) -> None:
        super().__init__()
        self.live = live
        self.problem = problem

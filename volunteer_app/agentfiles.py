"""The agent's files in the config dir, which the agent and its UIs both read: the one-agent-per-user lock,
where the running agent listens (``agent.json``), the control API's token, and the volunteer's settings.

A UI (the app, a shell command) finds the agent through these files without importing the agent itself
(``volunteer_app.control_client.locate_agent``); the agent service (``volunteer_app.agent.service``)
writes them. Stdlib and pydantic only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from volunteer_app.control import PolicySettings, validation_problems
from volunteer_app.settings import AgentSettings
from volunteer_app.tokens import write_private_file


class AgentAlreadyRunning(Exception):
    """Another agent holds this user's lock."""

    def __init__(self, location: dict[str, Any] | None):
        self.location = location or {}
        where = self.location.get("url", "an unknown address")
        pid = self.location.get("pid", "?")
        super().__init__(
            f"an agent is already running for this user (pid {pid}, {where}); use `volunteer-app status`, or "
            "`volunteer-app stop` to end it"
        )


class AgentLock:
    """An exclusive lock on a file, held for the agent's lifetime (released by the OS if it dies)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if not _try_lock(fd):
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            os.close(self._fd)
            self._fd = None


def _try_lock(fd: int) -> bool:
    if sys.platform == "win32":
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        if sys.platform == "win32":
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_UN)


def agent_running(settings: AgentSettings) -> bool:
    """Whether some process holds this user's agent lock."""
    lock = AgentLock(settings.agent_lock_path)
    if lock.acquire():
        lock.release()
        return False
    return True


def read_location(settings: AgentSettings) -> dict[str, Any] | None:
    """The running agent's state file (pid, URL, port), or None when no agent runs."""
    if not agent_running(settings):
        return None
    try:
        data = json.loads(settings.agent_state_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def control_token(settings: AgentSettings, *, create: bool) -> str | None:
    """The control API's token (created, mode 0600, when ``create`` and missing)."""
    path = settings.control_token_path
    with contextlib.suppress(OSError):
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    if not create:
        return None
    token = secrets.token_urlsafe(32)
    write_private_file(path, (token + "\n").encode())
    return token


def load_policy(settings: AgentSettings) -> tuple[PolicySettings, str | None]:
    """The saved settings; a damaged file is set aside (and the defaults used), never lost."""
    path = settings.policy_path
    if not path.exists():
        return PolicySettings(), None
    try:
        return PolicySettings.model_validate_json(path.read_text()), None
    except (OSError, ValidationError, ValueError) as exc:
        kept = path.with_name(f"settings.damaged-{int(os.path.getmtime(path))}.json")
        path.replace(kept)
        problem = validation_problems(exc) if isinstance(exc, ValidationError) else str(exc)
        return (
            PolicySettings(),
            f"the settings file was damaged ({problem}); it was kept as {kept}, defaults are used",
        )


def save_policy(settings: AgentSettings, policy: PolicySettings) -> None:
    write_private_file(settings.policy_path, (policy.model_dump_json(indent=2) + "\n").encode())

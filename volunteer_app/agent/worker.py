"""The training worker as a child process (``python -m workers.worker``), and the budget for restarting it.

:class:`WorkerProcess` starts the worker in its own process group (hivemind forks helpers; when the
worker ends, the group goes with it), writes the start message and commands to its stdin as JSON lines
and hands every event line it prints, validated, to ``on_event``. Its stderr goes to a log file that
is rotated at 10 MiB. The process can be started early (:meth:`WorkerProcess.prestart`), before the
join answer is known, so that Python and the worker's imports are done by the time the start message
arrives.

:class:`RestartBudget` says whether and when a crashed worker is restarted: with backoff, and at most
``limit`` times per hour before the agent gives up and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from volunteer_app.agent.clock import Clock
from volunteer_app.agent.link import backoff_delay
from volunteer_app.worker_protocol import EVENTS, StopCommand, WorkerEvent, WorkerStart, encode

logger = logging.getLogger(__name__)

LOG_ROTATE_BYTES = 10 * 2**20


class RestartBudget:
    """Restarts allowed: ``limit`` per ``window`` seconds, each after a growing delay.

    :meth:`failed` records a crash and returns the delay before the next start, or None once the budget
    is spent (the caller gives up).
    """

    def __init__(self, *, limit: int, clock: Clock, window: float = 3600.0, cap: float = 60.0):
        self.limit = limit
        self.window = window
        self.cap = cap
        self.clock = clock
        self._failures: list[float] = []

    @property
    def recent_failures(self) -> int:
        now = self.clock.monotonic()
        return sum(1 for t in self._failures if now - t < self.window)

    def failed(self) -> float | None:
        now = self.clock.monotonic()
        self._failures = [t for t in self._failures if now - t < self.window] + [now]
        if len(self._failures) > self.limit:
            return None
        return backoff_delay(len(self._failures), cap=self.cap)


def isolated_python(module: str, work_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``python -m module`` apart from where the volunteer is.

    ``python -m`` puts the current directory first on the import path, so a worker started from ``$HOME``
    could import any ``.py`` file of the volunteer's folders (``Downloads/volunteer_setup.py``) by name.
    The worker and the speed test run in ``work_dir`` (the agent's own empty folder, mode 0700), without
    the user site-packages (``-s``, unless volunteer-app itself is installed there) and with Python's safe
    path (``PYTHONSAFEPATH``: no directory added at all, on Python 3.11+). ``PYTHONPATH`` is the
    volunteer's own choice and stays.
    """
    import importlib.util
    import site

    work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    argv = [sys.executable]
    spec = importlib.util.find_spec("workers")
    origin = str(spec.origin) if spec is not None and spec.origin else ""
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if not (user_site and origin.startswith(str(user_site))):
        argv.append("-s")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if "-s" in argv:
        env["PYTHONNOUSERSITE"] = "1"
    return [*argv, "-m", module], env


def kill_process_group(pgid: int) -> None:
    """Kill what is left of a worker's process group (hivemind helpers orphaned by a crash)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class WorkerProcess:
    """One run of the worker process.

    :param log_path: the worker's stderr goes here (appended; rotated at 10 MiB).
    :param on_event: awaited with each validated event line, in order.
    :param work_dir: the worker's working directory (:func:`isolated_python`).
    :param env: extra environment for the worker.
    """

    def __init__(
        self,
        *,
        log_path: Path,
        on_event: Callable[[WorkerEvent], Awaitable[None]],
        work_dir: Path,
        env: dict[str, str] | None = None,
    ):
        self.log_path = log_path
        self.on_event = on_event
        self.work_dir = work_dir
        self.env = env or {}
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self.started = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def prestart(self) -> None:
        """Start the process now; it waits for :meth:`start`'s message (imports happen meanwhile)."""
        if self._process is not None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.log_path.exists() and self.log_path.stat().st_size > LOG_ROTATE_BYTES:
            self.log_path.replace(self.log_path.with_suffix(".log.1"))
        argv, env = isolated_python("workers.worker", self.work_dir)
        env.update(self.env)
        env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        with open(self.log_path, "ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=env, cwd=self.work_dir, start_new_session=True, limit=2**22,
            )  # fmt: skip
        assert self._process.stdout is not None
        self._reader = asyncio.create_task(self._read(self._process.stdout), name="worker-events")

    async def start(self, start: WorkerStart, commands: list[BaseModel]) -> None:
        """Send the start message, then ``commands`` (more leases, a pause)."""
        await self.prestart()
        self.started = True
        for message in [start, *commands]:
            await self.send(message)

    async def send(self, message: BaseModel) -> bool:
        """Write one command line; False when the worker is gone."""
        process = self._process
        if process is None or process.stdin is None or process.returncode is not None:
            return False
        try:
            process.stdin.write(encode(message).encode())
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def wait(self, poll: float = 0.2) -> int:
        """The exit status, as soon as the worker has exited; then its group is killed.

        ``Process.wait()`` (before Python 3.12) also waits until every pipe is closed, and hivemind helpers
        a killed worker leaves behind keep its stdout open; the return code is set as soon as the child is
        reaped, so poll that instead.
        """
        process = self._process
        assert process is not None
        while process.returncode is None:
            await asyncio.sleep(poll)
        if self._reader is not None:  # the helpers may hold the pipe open: drain what is there, move on
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        kill_process_group(process.pid)
        return process.returncode

    async def stop(
        self, *, grace: float, evaluate: bool = False, on_late: Callable[[str], None] | None = None
    ) -> None:
        """Ask the worker to finish its step and leave the swarm; terminate it if it takes too long."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        if not self.started:  # a prestarted worker that never got its start message
            process.kill()
            return
        await self.send(StopCommand(evaluate=evaluate))
        if await _exited(process, grace):
            return
        if on_late is not None:
            on_late("the worker did not stop in time; terminating it")
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        if not await _exited(process, 15):
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    def kill(self) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            kill_process_group(self._process.pid)

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the limit: skip it
                logger.warning("ignoring an over-long worker event")
                continue
            if not line:
                return
            try:
                event = EVENTS.validate_json(line)
            except ValidationError:
                logger.warning("ignoring a malformed worker event: %r", line[:200])
                continue
            try:
                await self.on_event(event)
            except Exception:  # a bug in a handler must not stop the event stream
                logger.exception("handling a worker event failed")


async def _exited(process: Any, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while process.returncode is None and loop.time() < deadline:
        await asyncio.sleep(0.2)
    return process.returncode is not None

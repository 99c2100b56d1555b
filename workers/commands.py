"""Command handling: the supervisor's commands, read on a thread and applied between micro-batches.

:func:`read_commands` turns stdin lines into validated commands on a queue (``None`` when the pipe
closes). :class:`Controls` holds what the commands decide (paused, stopping, evaluations asked for, a
new thread count) and applies each command it is given; the two that need the swarm or the data (a
refreshed peer token, a new lease) go to callbacks, so this part works, and is tested, alone.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from volunteer_app.protocol import LeaseOut
from volunteer_app.worker_protocol import (
    COMMANDS,
    DropLeaseCommand,
    EvaluateCommand,
    LeaseCommand,
    LimitsCommand,
    PauseCommand,
    ResumeCommand,
    StopCommand,
    TokenCommand,
)

MAX_PENDING_EVALUATIONS = 4
"""Evaluate commands kept waiting; older ones are dropped (a UI asking faster than the model draws)."""


@dataclass
class Controls:
    """What the supervisor has asked for so far.

    :param evaluate_on_stop: evaluate before exiting (a stop command may change it).
    :param on_token: called with a refreshed peer token.
    :param on_lease: called with a new lease.
    :param on_drop_lease: called with the id of a lease given back to the coordinator.
    """

    evaluate_on_stop: bool = False
    on_token: Callable[[str], None] = lambda _token: None
    on_lease: Callable[[LeaseOut], None] = lambda _lease: None
    on_drop_lease: Callable[[str], None] = lambda _lease_id: None
    paused: bool = False
    stopping: bool = False
    threads: int | None = None
    """A thread count to apply at the next micro-batch (None: nothing new)."""
    evaluations: collections.deque[EvaluateCommand] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_PENDING_EVALUATIONS)
    )

    def apply(self, command: Any) -> None:
        """Apply one command (``None`` means the supervisor is gone: leave gracefully)."""
        if isinstance(command, PauseCommand):
            self.paused = True
        elif isinstance(command, ResumeCommand):
            self.paused = False
        elif isinstance(command, StopCommand):
            self.stopping = True
            if command.evaluate is not None:
                self.evaluate_on_stop = command.evaluate
        elif isinstance(command, TokenCommand):
            self.on_token(command.peer_token)
        elif isinstance(command, LeaseCommand):
            self.on_lease(command.lease)
        elif isinstance(command, DropLeaseCommand):
            self.on_drop_lease(command.lease_id)
        elif isinstance(command, EvaluateCommand):
            self.evaluations.append(command)
        elif isinstance(command, LimitsCommand):
            self.threads = command.threads
        elif command is None:
            self.stopping = True

    def drain(self, commands: queue.Queue[Any]) -> None:
        """Apply every command waiting on ``commands`` without blocking."""
        while True:
            try:
                command = commands.get_nowait()
            except queue.Empty:
                return
            self.apply(command)

    def take_threads(self) -> int | None:
        """The thread count to apply now, once."""
        threads, self.threads = self.threads, None
        return threads


def read_commands(stream: TextIO, commands: queue.Queue[Any], on_error: Callable[[str], None]) -> None:
    """Read command lines until EOF, then queue ``None`` (the supervisor closed the pipe)."""
    from pydantic import ValidationError

    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            commands.put(COMMANDS.validate_json(line))
        except ValidationError as exc:
            on_error(f"ignoring a malformed command: {exc.errors()[0].get('msg', exc)}")
    commands.put(None)

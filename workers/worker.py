"""The worker process: ``python -m workers.worker``, started and fed by the agent supervisor.

stdin: one :class:`~volunteer_app.worker_protocol.WorkerStart` line, then command lines.
stdout: event lines. stderr: logs. Exit status 0 after a clean stop, 2 for a bad start message,
3 when the swarm cannot be joined, 5 when the run is refused (``EXIT_RUN_REFUSED``: a task that is not
installed, a refused config or file, a model too big for this machine's limits), 1 for anything
unexpected (reported as a fatal error event first).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from typing import Any

from pydantic import ValidationError

from volunteer_app.worker_protocol import ErrorEvent, StopCommand, WorkerStart
from workers.trainer import EventWriter, Trainer, read_commands


def _take_pipes() -> tuple[Any, Any]:
    """Move the supervisor's pipes off fds 0/1 and point stdin/stdout at /dev/null.

    hivemind forks helper processes (the DHT, the averagers). A forked child closes ``sys.stdin``, which
    deadlocks if the command-reader thread holds its lock at the moment of the fork, and children that
    inherit the events pipe would keep it open after this process ends. Private duplicates avoid both.
    """
    commands = os.fdopen(os.dup(0), "r", encoding="utf-8", buffering=1)
    events = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    return commands, events


def _prewarm() -> None:
    """Import torch, hivemind and the tasks before the start line arrives.

    The agent starts its worker while it is still registering and joining (``prestart``), so the few
    seconds these imports take are spent while the coordinator answers, not after.
    """
    import hivemind  # noqa: F401
    import torch  # noqa: F401

    import workers.collab
    import workers.tasks  # noqa: F401


def main() -> int:
    command_stream, event_stream = _take_pipes()
    events = EventWriter(event_stream)
    _prewarm()
    line = command_stream.readline()
    try:
        start = WorkerStart.model_validate_json(line)
    except ValidationError as exc:
        events.emit(ErrorEvent(message=f"bad start message: {exc.errors()[0].get('msg', exc)}", fatal=True))
        return 2
    from workers.fitting import cap_process_memory
    from workers.hivemind_logs import quiet_expected_tracebacks

    # before hivemind forks its helpers, so that they inherit it
    cap_process_memory(start.memory_limit_bytes, device=start.join.assignment.device)
    quiet_expected_tracebacks()
    logging.basicConfig(
        level=start.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s worker %(name)s %(levelname)s %(message)s",
    )
    commands: queue.Queue[Any] = queue.Queue()

    def on_bad_command(message: str) -> None:
        events.emit(ErrorEvent(message=message))

    threading.Thread(
        target=read_commands, args=(command_stream, commands, on_bad_command), daemon=True, name="commands"
    ).start()

    def stop(_signum: int, _frame: Any) -> None:
        commands.put(StopCommand())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    trainer = Trainer(start=start, events=events, commands=commands)
    try:
        return trainer.run()
    except Exception as exc:
        logging.getLogger("workers").exception("worker failed")
        events.emit(ErrorEvent(message=f"worker failed: {type(exc).__name__}: {exc}", fatal=True))
        return 1


if __name__ == "__main__":
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    code = main()
    logging.shutdown()
    # Everything was shut down explicitly; exit now rather than wait on helper threads or processes that a
    # failure may have left behind (the supervisor kills this process group after it exits).
    os._exit(code)

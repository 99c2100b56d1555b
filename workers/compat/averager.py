"""The averager's process: ``DecentralizedAverager``'s request tasks, held until they end.

Mirrors ``hivemind/averaging/averager.py``. Upstream's request loop (``DecentralizedAverager._run_internal``)
runs each request of the owner as ``asyncio.create_task(getattr(self, method)(...))`` and keeps no reference
to the task. :class:`_HeldRequestTasks`, a subclass (nothing is replaced process-wide), overrides ``_step`` to
hold its task in :data:`_HELD_TASKS` while it runs, then calls upstream's; the state download
(:mod:`workers.compat.state_download`) holds ``_load_state_from_peers``'s the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from hivemind.averaging.averager import DecentralizedAverager

from workers.compat.version import require

require(DecentralizedAverager, "_step")


_HELD_TASKS: set[asyncio.Task[Any]] = set()
"""Request tasks of this process's averagers that are still running (see :class:`_HeldRequestTasks`)."""


class _HeldRequestTasks(DecentralizedAverager):
    """Keeps the averager process's long-running request tasks alive until they finish.

    hivemind 1.1.12's averager process runs each request of its owner (``step``, ``load_state_from_peers``,
    a new download priority, ...) as ``task = asyncio.create_task(...)`` and drops that reference at the
    next request, and asyncio itself holds tasks only weakly. A pending averaging step waits on futures
    that only the step references, so from the next request on (the owner sends one at every epoch
    transition: its new download priority) nothing reachable holds it, and the next full garbage
    collection in that process destroys it mid-round ("Task was destroyed but it is pending!"). Its
    future dies with it ("pipe to origin process was broken ([Errno 9] Bad file descriptor)"), so the
    owner waits out the whole ``averaging_timeout`` holding its averaging lock: no round can start in the
    meantime, and the partner gets half a result. Serving a state download allocates enough to trigger that
    collection, so a checkpointer's download just before an epoch's end broke the round: 15 of 31 epochs of a
    150-s demo went without one, in two streaks of 30 s. Here each step and download task is held in
    :data:`_HELD_TASKS` until it ends.
    """

    async def _step(self, **kwargs: Any) -> Any:
        with _holding_current_task():
            return await super()._step(**kwargs)


@contextlib.contextmanager
def _holding_current_task() -> Iterator[None]:
    task = asyncio.current_task()
    if task is not None:
        _HELD_TASKS.add(task)
    try:
        yield
    finally:
        if task is not None:
            _HELD_TASKS.discard(task)

"""Time as a dependency (CONVENTIONS 8c): everything with timeouts, backoff, leases, schedules or expiries
takes a :class:`Clock`, so that tests move time instead of sleeping.

:class:`SystemClock` is the real one. :class:`ManualClock` is a clock whose time only moves when
:meth:`ManualClock.advance` is called; its sleepers wake in deadline order as time passes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from datetime import datetime
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch (wall clock: schedules, expiries, what users see)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations, timeouts)."""

    def now(self) -> datetime:
        """Local wall-clock time (weekly schedules)."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds pass; True when the event is set."""


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now().astimezone()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if timeout is None:
            await event.wait()
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout))
        return event.is_set()


class ManualClock:
    """A clock for tests: ``sleep`` and ``wait`` return when :meth:`advance` moves time past them."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._time = start
        self._monotonic = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._time

    def monotonic(self) -> float:
        return self._monotonic

    def now(self) -> datetime:
        return datetime.fromtimestamp(self._time).astimezone()

    @property
    def sleepers(self) -> int:
        """How many sleeps are pending (tests wait for the code under test to reach its next sleep)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._monotonic + max(0.0, seconds), next(self._order), future))
        await future

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if timeout is None:
            await event.wait()
            return True
        sleeper = asyncio.ensure_future(self.sleep(timeout))
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waiter):
                task.cancel()
        return event.is_set()

    async def advance(self, seconds: float) -> None:
        """Move both clocks forward, waking every sleeper whose deadline is passed, in order."""
        target = self._monotonic + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            self._time += max(0.0, deadline - self._monotonic)
            self._monotonic = max(self._monotonic, deadline)
            if not future.done():
                future.set_result(None)
            for _ in range(5):  # let the woken code run up to its next sleep
                await asyncio.sleep(0)
        self._time += target - self._monotonic
        self._monotonic = target
        for _ in range(5):
            await asyncio.sleep(0)

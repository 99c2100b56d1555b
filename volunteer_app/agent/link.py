"""The agent's line to the coordinator: the HTTP client, retried with backoff while it is unreachable.

Retries use tenacity (exponential backoff with jitter, capped at a minute) and sleep on the injected
clock, so tests move time instead of waiting. Only :class:`CoordinatorUnreachable` is retried (network
errors, timeouts, 5xx answers); a refusal (4xx) is the caller's to handle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from volunteer_app.agent.clock import Clock
from volunteer_app.client import CoordinatorClient, CoordinatorUnreachable

T = TypeVar("T")


class Stopped(Exception):
    """The agent was told to stop while it was waiting for the coordinator."""


def backoff_wait(*, initial: float = 1.0, cap: float = 60.0) -> wait_exponential_jitter:
    """The backoff every retry loop of the agent uses: ~1, 2, 4 ... s up to ``cap``, with jitter."""
    return wait_exponential_jitter(initial=initial, max=cap, jitter=initial)


def backoff_delay(attempt: int, *, initial: float = 1.0, cap: float = 60.0) -> float:
    """The delay before retry number ``attempt`` (1-based) of that backoff, for loops tenacity does not run
    (worker restarts, heartbeats that must keep their own schedule)."""
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = max(1, attempt)
    return float(backoff_wait(initial=initial, cap=cap)(state))


class CoordinatorLink:
    """A :class:`CoordinatorClient` plus reachability bookkeeping and retries.

    :param client: the coordinator client (credential set once registered).
    :param clock: sleeps between retries happen on this clock.
    :param stop: when set, a retry loop gives up with :class:`Stopped`.
    :param on_message: one-line messages for the volunteer ("cannot reach ...; retrying in 4 s").
    :param on_reachable: called with True/False as the coordinator comes and goes.
    """

    def __init__(
        self,
        *,
        client: CoordinatorClient,
        clock: Clock,
        stop: asyncio.Event,
        on_message: Callable[[str], None],
        on_reachable: Callable[[bool], None],
    ):
        self.client = client
        self.clock = clock
        self.stop = stop
        self.on_message = on_message
        self.on_reachable = on_reachable
        self.reachable = True

    def mark(self, reachable: bool) -> None:
        if reachable and not self.reachable:
            self.on_message("the coordinator is reachable again")
        if reachable != self.reachable:
            self.reachable = reachable
            self.on_reachable(reachable)

    async def call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` until it does not raise :class:`CoordinatorUnreachable` (or the agent stops)."""

        async def sleep(seconds: float) -> None:
            if await self.clock.wait(self.stop, seconds):
                raise Stopped(f"stopped while trying to {what}")

        def before_sleep(state: RetryCallState) -> None:
            self.mark(False)
            delay = state.next_action.sleep if state.next_action else 0.0
            error = state.outcome.exception() if state.outcome else None
            self.on_message(f"cannot {what} ({error}); retrying in {delay:.0f} s")

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(CoordinatorUnreachable),
            wait=backoff_wait(),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if self.stop.is_set():
                    raise Stopped(f"stopped while trying to {what}")
                result: Any = await call()
        self.mark(True)
        return result

    async def once(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` once; unreachable is recorded and re-raised."""
        try:
            result = await call()
        except CoordinatorUnreachable:
            self.mark(False)
            raise
        self.mark(True)
        return result

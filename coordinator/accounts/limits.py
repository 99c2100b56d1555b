"""Small in-memory limiters: a token bucket keyed by (action, caller), and a budget of failed guesses.

They are hand-written rather than taken from the ``limits`` package because they need two things it does
not give together: an injectable clock (tests move time instead of sleeping; daily quotas run on the
coordinator's own clock) and, for invite codes, a budget that only *failures* spend but that, once spent,
refuses every attempt, right or wrong, until its window ends.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import RateLimited

_PRUNE_EVERY = 60.0
"""Seconds between sweeps of the tables for entries that no longer hold anything back."""


@dataclass
class _Bucket:
    tokens: float
    updated: float
    size: float
    rate: float
    """Tokens per second."""


class RateLimiter:
    """Allows ``burst`` requests at once, refilled at ``per_minute`` per minute, per key.

    One coordinator process serves all requests, so memory is the right place; a bucket is dropped only
    once it would have refilled completely, so the table does not grow without bound and a long quota
    (registrations per day) is not reset by waiting a few minutes.

    :param clock: seconds for refills (default ``time.monotonic``); a limiter for daily quotas takes the
        coordinator's clock, so that tests can move a day forward.
    """

    def __init__(self, *, burst: int, clock: Callable[[], float] = time.monotonic):
        self.burst = burst
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()
        self._last_prune = clock()

    def check(self, action: str, key: str, *, per_minute: float, burst: int | None = None) -> None:
        """Take one request from the (action, key) bucket, or raise :class:`RateLimited` with Retry-After.

        ``burst`` overrides the limiter's default for this action (reads come in small bursts: a page
        asks for the run, its leaderboard and the run list at once)."""
        now = self.clock()
        rate = per_minute / 60.0
        size = float(burst if burst is not None else self.burst)
        with self._lock:
            bucket = self._buckets.get((action, key))
            if bucket is None:
                bucket = self._buckets[(action, key)] = _Bucket(
                    tokens=size, updated=now, size=size, rate=rate
                )
            bucket.size, bucket.rate = size, rate
            bucket.tokens = min(size, bucket.tokens + max(0.0, now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                retry = (1.0 - bucket.tokens) / rate
                raise RateLimited(
                    f"too many {action} requests; retry in {retry:.1f} s",
                    headers={"Retry-After": str(max(1, math.ceil(retry)))},
                )
            bucket.tokens -= 1.0
            if now - self._last_prune > _PRUNE_EVERY:
                self._prune(now)

    def refund(self, action: str, key: str) -> None:
        """Give back the request :meth:`check` took (it failed and left nothing behind, so it should not
        count against a quota of things made)."""
        with self._lock:
            bucket = self._buckets.get((action, key))
            if bucket is not None:
                bucket.tokens = min(bucket.size, bucket.tokens + 1.0)

    def _prune(self, now: float) -> None:
        self._last_prune = now
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.updated) * b.rate >= b.size]
        for key in full:
            del self._buckets[key]


@dataclass
class _Window:
    spent: int
    ends: float


class GuessLimiter:
    """A budget of failed guesses per key (a client address) per window, for secrets people type.

    :meth:`take` reserves one guess before the secret is checked and :meth:`refund` gives it back when the
    secret was right, so that concurrent requests cannot overshoot the budget between the check and the
    count. The window starts at the first guess; once the budget is spent, every guess (a right one too)
    is refused with 429 and Retry-After until the window ends, so that spending it and then trying the
    right code cannot tell an attacker anything.

    :param clock: Unix seconds (the coordinator's clock, which tests move).
    :param on_refused: called once per refused guess (the ``/metrics`` counter).
    """

    def __init__(self, *, clock: Callable[[], float], on_refused: Callable[[], None] | None = None):
        self.clock = clock
        self.on_refused = on_refused
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        self._last_prune = clock()

    def take(self, key: str, *, budget: int, window: float, what: str = "guesses") -> None:
        """Reserve one guess for ``key``, or raise :class:`RateLimited` when its budget is spent."""
        now = self.clock()
        with self._lock:
            if now - self._last_prune > _PRUNE_EVERY:
                self._prune(now)
            current = self._windows.get(key)
            if current is None or now >= current.ends:
                current = self._windows[key] = _Window(spent=0, ends=now + window)
            if current.spent >= budget:
                retry = max(1, math.ceil(current.ends - now))
                if self.on_refused is not None:
                    self.on_refused()
                raise RateLimited(
                    f"too many wrong {what} from this address; try again in {retry} s",
                    code="too_many_guesses",
                    headers={"Retry-After": str(retry)},
                )
            current.spent += 1

    def refund(self, key: str) -> None:
        """Give back the guess :meth:`take` reserved: the secret was right."""
        with self._lock:
            current = self._windows.get(key)
            if current is not None and current.spent > 0:
                current.spent -= 1

    def _prune(self, now: float) -> None:
        self._last_prune = now
        for key in [k for k, w in self._windows.items() if now >= w.ends]:
            del self._windows[key]

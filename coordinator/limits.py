"""A small in-memory token-bucket rate limiter, keyed by (action, caller)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from coordinator.errors import RateLimited


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Allows ``burst`` requests at once, refilled at ``per_minute`` per minute, per key.

    One coordinator process serves all requests, so memory is the right place; buckets of idle callers
    are dropped once full so the table does not grow without bound.
    """

    def __init__(self, *, burst: int):
        self.burst = burst
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()
        self._last_prune = time.monotonic()

    def check(self, action: str, key: str, *, per_minute: float, burst: int | None = None) -> None:
        """Take one request from the (action, key) bucket, or raise :class:`RateLimited` with Retry-After.

        ``burst`` overrides the limiter's default for this action (reads come in small bursts: a page
        asks for the run, its leaderboard and the run list at once)."""
        now = time.monotonic()
        rate = per_minute / 60.0
        size = float(burst if burst is not None else self.burst)
        with self._lock:
            bucket = self._buckets.get((action, key))
            if bucket is None:
                bucket = self._buckets[(action, key)] = _Bucket(tokens=size, updated=now)
            bucket.tokens = min(size, bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                retry = (1.0 - bucket.tokens) / rate
                raise RateLimited(
                    f"too many {action} requests; retry in {retry:.1f} s",
                    headers={"Retry-After": str(max(1, math.ceil(retry)))},
                )
            bucket.tokens -= 1.0
            if now - self._last_prune > 60.0:
                self._prune(now)

    def _prune(self, now: float) -> None:
        self._last_prune = now
        for key in [k for k, b in self._buckets.items() if now - b.updated > 600.0]:
            del self._buckets[key]

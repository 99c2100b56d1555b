"""Reporting: events to the supervisor as JSON lines, and the measurements they carry.

:class:`EventWriter` writes events (thread-safe; a closed pipe is not an error), :class:`RateMeter`
measures samples per second over a sliding window, and :class:`TrainingTally` keeps the running totals
(samples, compute time, smoothed loss, averaging rounds) that progress and lease events report.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from pydantic import BaseModel

from volunteer_app.worker_protocol import encode


class EventWriter:
    """Writes events as JSON lines; thread-safe. A closed pipe (the supervisor died) is not an error."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def emit(self, event: BaseModel) -> None:
        line = encode(event)
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(line)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken = True


class RateMeter:
    """Samples per second over a sliding window of recent micro-batches."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._points: list[tuple[float, int]] = []

    def add(self, samples: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._points.append((now, samples))
        cutoff = now - self.window
        while len(self._points) > 2 and self._points[0][0] < cutoff:
            self._points.pop(0)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        points = [p for p in self._points if p[0] >= now - self.window]
        if len(points) < 2:
            return 0.0
        elapsed = points[-1][0] - points[0][0]
        return sum(s for _, s in points[1:]) / elapsed if elapsed > 0 else 0.0


@dataclass
class TrainingTally:
    """Running totals of one worker's training."""

    samples_total: int = 0
    compute_seconds: float = 0.0
    loss_ema: float | None = None
    averaging_rounds: int = 0
    failed_rounds: int = 0

    def add_micro_batch(self, samples: int, seconds: float, loss: float) -> None:
        """Count a trained micro-batch; the loss is smoothed (EMA 0.95), and non-finite losses are skipped."""
        self.samples_total += samples
        self.compute_seconds += seconds
        if math.isfinite(loss):
            self.loss_ema = loss if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * loss

    def add_round(self, *, sent_bytes: int, swarm_size: int) -> bool:
        """Count an epoch transition: a round that sent bytes succeeded; one that sent nothing while other
        peers were there failed. Returns whether it went as it should (alone, nothing is expected)."""
        if swarm_size <= 1:
            return True
        if sent_bytes > 0:
            self.averaging_rounds += 1
            return True
        self.failed_rounds += 1
        return False

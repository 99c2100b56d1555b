"""The progress tracker: throttled progress records, and the readings of the worker's progress events.

Mirrors ``hivemind/optim/progress_tracker.py``. :func:`throttle_progress_reports` replaces two attributes of
one ``ProgressTracker`` (that instance only, not process-wide): ``should_report_progress``, the event that
upstream's reporter (``ProgressTracker._progress_reporter``) waits on before it stores a record, becomes a
:class:`_ThrottledEvent`; and ``report_local_progress`` is wrapped to mark a new epoch, a reset sample count
and an epoch's first samples urgent. :func:`swarm_size`, :func:`global_epoch` and :func:`samples_accumulated`
read the tracker's (and the gradient averager's) attributes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import hivemind
from hivemind.optim.progress_tracker import ProgressTracker

from workers.compat.version import require


class _ThrottledEvent(threading.Event):
    """An Event whose ``set()`` takes effect at most once per ``min_interval`` (a late one is deferred,
    never dropped), except when ``urgent`` is raised or ``bypass()`` says so."""

    def __init__(self, min_interval: float, bypass: Callable[[], bool]):
        super().__init__()
        self.min_interval = min_interval
        self.urgent = False
        self._bypass = bypass
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            now = time.monotonic()
            wait = self._last + self.min_interval - now
            if wait <= 0 or self.urgent or self._bypass():
                self.urgent = False
                self._last = now
                super().set()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            self._last = time.monotonic()
            super().set()


FIRST_EPOCH_REPORT_INTERVAL = 0.5
"""Seconds at least between two progress records during a run's first epoch (see
:data:`FIRST_EPOCH_REFRESH_PERIOD`): the peers' first records carry their throughput while start-up still
slows it, so the swarm extrapolates too little from them and needs the real counts to end the epoch on time."""


def throttle_progress_reports(
    tracker: ProgressTracker,
    *,
    min_interval: float,
    first_epoch_interval: float = FIRST_EPOCH_REPORT_INTERVAL,
) -> None:
    """Let at most one progress record per ``min_interval`` seconds reach the DHT (``first_epoch_interval``
    in epoch 0).

    hivemind 1.1.12 stores a signed record on every ``Optimizer.step``; each costs the DHT process and
    p2pd CPU that the training loop needs. The latest progress is always published within
    ``min_interval``; a new epoch or a reset sample count is published at once, so peers never wait on a
    stale record at an epoch boundary. Peers extrapolate between records from the reported throughput.

    The first samples of an epoch are published at once too: hivemind's reporter stores nothing for a
    peer until it has seen that peer with samples in hand, so a deferred report that found the count
    already reset by the next epoch would leave the peer unseen by the swarm (and its work unverified by
    the coordinator) for as long as it then stayed idle.
    """
    require(
        tracker, "should_report_progress", "report_local_progress", "shutdown_triggered", "local_progress"
    )
    old_event = tracker.should_report_progress
    first = min(min_interval, first_epoch_interval)
    event = _ThrottledEvent(
        first if tracker.local_progress.epoch == 0 else min_interval, bypass=tracker.shutdown_triggered.is_set
    )
    original = tracker.report_local_progress
    state = {"epoch": -1, "samples": 0}

    def report(local_epoch: int, samples_accumulated: int, update_global_samples: bool = True) -> None:
        event.min_interval = first if local_epoch == 0 else min_interval
        first_samples = samples_accumulated > 0 and (state["samples"] == 0 or local_epoch != state["epoch"])
        if local_epoch != state["epoch"] or samples_accumulated < state["samples"] or first_samples:
            event.urgent = True
        state["epoch"], state["samples"] = local_epoch, samples_accumulated
        original(local_epoch, samples_accumulated, update_global_samples)

    tracker.should_report_progress = event
    tracker.report_local_progress = report
    old_event.set()  # wake the reporter thread so that it starts waiting on the throttled event


def swarm_size(optimizer: hivemind.Optimizer) -> int:
    """Peers the progress tracker currently sees (this one included)."""
    return int(optimizer.tracker.global_progress.num_peers)


def global_epoch(optimizer: hivemind.Optimizer) -> int:
    return int(optimizer.tracker.global_epoch)


def samples_accumulated(optimizer: hivemind.Optimizer) -> int:
    """Samples this peer has contributed toward the swarm's current epoch."""
    if optimizer.grad_averager is not None:
        return int(optimizer.grad_averager.local_samples_accumulated)
    return int(optimizer.tracker.local_progress.samples_accumulated)  # local updates: no gradient averager

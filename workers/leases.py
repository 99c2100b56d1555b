"""The lease feeder: turns the coordinator's work leases into micro-batches, one shard at a time.

The supervisor keeps it stocked (the current lease and one prefetched); when a shard's last sample has
been trained on, the feeder reports the lease done with the samples and compute time it took.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from volunteer_app.protocol import LeaseOut
from workers.tasks.base import TaskRuntime


@dataclass
class FinishedLease:
    lease_id: str
    samples: int
    compute_seconds: float


class LeaseFeeder:
    """Yields micro-batches of the current lease; ``take_finished`` returns leases whose shard is done.

    :param runtime: the task runtime that generates a shard's batches.
    :param micro_batch_size: samples per micro-batch (the last one of a shard may be smaller).
    :param device: where batches are placed.
    """

    def __init__(self, *, runtime: TaskRuntime, micro_batch_size: int, device: Any, num_shards: int = 1):
        self.runtime = runtime
        self.num_shards = num_shards
        self.micro_batch_size = micro_batch_size
        self.device = device
        self._queue: collections.deque[LeaseOut] = collections.deque()
        self._known: set[str] = set()
        self.current: LeaseOut | None = None
        self._batches: Iterator[Any] | None = None
        self.samples_done = 0
        self.compute_seconds = 0.0
        self._finished: list[FinishedLease] = []

    def add(self, lease: LeaseOut) -> None:
        if lease.lease_id in self._known:
            return  # the supervisor may resend a lease after a restart; it is only worked once
        self._known.add(lease.lease_id)
        self._queue.append(lease)

    @property
    def queued(self) -> int:
        return len(self._queue) + (1 if self.current is not None else 0)

    def next_batch(self) -> Any | None:
        """The next micro-batch, or None when there is no work (the supervisor should send a lease)."""
        while True:
            if self._batches is None:
                if not self._queue:
                    return None
                self.current = self._queue.popleft()
                self.samples_done = 0
                self.compute_seconds = 0.0
                self._batches = iter(
                    self.runtime.shard_batches(
                        self._shard_of(self.current),
                        batch_size=self.micro_batch_size,
                        seed=self.current.seed,
                        device=self.device,
                    )
                )
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            self._finish()

    def drop(self, lease_id: str) -> int | None:
        """Forget a lease (given back to the coordinator): the samples trained on it so far, or None if unknown.

        The next micro-batch comes from the next lease in hand; the dropped one is never reported.
        """
        if self.current is not None and self.current.lease_id == lease_id:
            done = self.samples_done
            self.current, self._batches = None, None
            self.samples_done, self.compute_seconds = 0, 0.0
            return done
        for lease in list(self._queue):
            if lease.lease_id == lease_id:
                self._queue.remove(lease)
                return 0
        return None

    def _shard_of(self, lease: LeaseOut) -> int:
        """The lease's shard; an unleased one (shard -1, while the coordinator is away) picks a random shard."""
        if lease.shard >= 0:
            return lease.shard
        return random.Random(lease.seed).randrange(max(1, self.num_shards))

    def record(self, samples: int, seconds: float) -> None:
        """Count a trained micro-batch toward the current lease."""
        self.samples_done += samples
        self.compute_seconds += seconds

    def _finish(self) -> None:
        assert self.current is not None
        self._finished.append(FinishedLease(self.current.lease_id, self.samples_done, self.compute_seconds))
        self.current = None
        self._batches = None

    def take_finished(self) -> list[FinishedLease]:
        finished, self._finished = self._finished, []
        return finished

    def pending_lease_ids(self) -> list[str]:
        ids = [lease.lease_id for lease in self._queue]
        if self.current is not None:
            ids.insert(0, self.current.lease_id)
        return ids

    @staticmethod
    def now() -> float:
        return time.perf_counter()

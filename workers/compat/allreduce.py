"""The all-reduce: byte counting and robust averaging, installed process-wide (:func:`workers.compat.install`).

Mirrors ``hivemind/averaging/allreduce.py`` and ``hivemind/averaging/partition.py``. ``AllReduceRunner`` looks
up ``deserialize_torch_tensor``, ``TensorPartReducer`` and ``TensorPartContainer`` as globals of
``hivemind.averaging.allreduce`` whenever it runs, and hivemind has no hook for them, so they are replaced
there: every all-reduce of this process changes, and of the averager processes it forks afterwards.

* ``allreduce.deserialize_torch_tensor`` is wrapped by :func:`count_received_bytes` to count the bytes this
  peer receives in averaging rounds.
* ``allreduce.TensorPartReducer`` becomes :class:`RobustPartReducer`, a subclass. Its ``accumulate_part`` is a
  copy of ``partition.TensorPartReducer.accumulate_part`` (1.1.12) that keeps each contribution
  (``self._contributions``) where upstream adds it to a running sum (``self.accumulator.add_(...)``,
  ``self.denominator += weight``); its ``check_current_part_finished`` averages them with
  :func:`workers.robust.robust_mean` where upstream divides the sum (``self.accumulator.div_(...)``);
  ``reset_accumulators`` and ``finalize`` extend upstream's (no running sum; a log line naming the senders
  whose contributions were left out).
* ``allreduce.TensorPartContainer`` becomes :class:`RobustPartContainer`, a subclass that screens the averaged
  parts other reducers send back (:func:`workers.robust.screen_deltas`) before handing them out: its
  ``register_processed_part`` also keeps each part, and its ``iterate_output_tensors`` waits for all of them,
  screens them, then yields upstream's.
* ``allreduce.AllReduceRunner.__init__`` is wrapped by :func:`install_robust_averaging`: after upstream's, it
  tells the reducer and the container which peer this is, the peers' names and whether they average gradients
  or parameters (upstream passes none of that to them).

The maths is :mod:`workers.robust`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.proto import runtime_pb2

from workers.compat.version import require
from workers.robust import ChangeHistory, ScreenReport, robust_mean, root_mean_square, screen_deltas

logger = logging.getLogger(__name__)


def count_received_bytes(add_received: Callable[[int], None]) -> None:
    """Count incoming all-reduce parts: hivemind decodes each with ``allreduce.deserialize_torch_tensor``.

    Idempotent: a second call replaces the counter, never wraps the wrapper.
    """
    import hivemind.averaging.allreduce as allreduce

    require(allreduce, "deserialize_torch_tensor")
    original = getattr(allreduce, "_va_original_deserialize", allreduce.deserialize_torch_tensor)

    def counting_deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
        add_received(len(serialized.buffer))
        return original(serialized)

    allreduce._va_original_deserialize = original
    allreduce.deserialize_torch_tensor = counting_deserialize


class RobustPartReducer(TensorPartReducer):
    """hivemind's part reducer, averaging each part with :func:`workers.robust.robust_mean` (non-finite
    contributions dropped, weights capped, CenteredClip with three or more senders) instead of a running
    weighted sum. Keeps every contribution of the current part until the part is complete."""

    sender_names: Sequence[str] = ()
    own_sender: int | None = None
    kind = "gradients"
    own_rms = 0.0
    """This peer's whole contribution's root mean square per element (:func:`workers.robust.robust_mean`'s
    ``rms``)."""

    def reset_accumulators(self) -> None:
        self._contributions: list[tuple[torch.Tensor, float]] = []
        self._senders: list[int] = []
        if not hasattr(self, "dropped_by_sender"):
            self.dropped_by_sender: dict[int, int] = {}
        super().reset_accumulators()
        self.accumulator = None  # hivemind's running sum is not used

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind's accumulate_part, keeping the contribution instead of adding it to a running sum
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._contributions.append((tensor_part, float(weight)))
            self._senders.append(sender_index)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            shape = self.part_shapes[self.current_part_index]
            dropped: list[int] = []
            own = self._senders.index(self.own_sender) if self.own_sender in self._senders else None
            result = robust_mean(
                self._contributions, shape, dropped, own=own, kind=self.kind, rms=self.own_rms
            )
            self.current_part_future.set_result(result)
            for index in dropped:
                sender = self._senders[index]
                self.dropped_by_sender[sender] = self.dropped_by_sender.get(sender, 0) + 1
            self.reset_accumulators()

    def finalize(self) -> None:
        if not self.finished.is_set() and getattr(self, "dropped_by_sender", None):
            said = ", ".join(
                f"{count} part(s) from peer ...{self.sender_names[s] if s < len(self.sender_names) else s}"
                for s, count in sorted(self.dropped_by_sender.items())
            )
            logger.info("averaging: left out non-finite or outlying contributions: %s", said)
        super().finalize()


class RobustPartContainer(TensorPartContainer):
    """hivemind's part container, screening what other reducers send back (:func:`workers.robust.screen_deltas`)
    before the averaged tensors are assembled: it waits for every part of the round, then hands them out.
    Each averager (``history_key``: its prefix) keeps its parts' :class:`workers.robust.ChangeHistory` in
    this process (the averager's own) across rounds."""

    own_index: int | None = None
    senders = 0
    peer_names: Sequence[str] = ()
    history_key = ""
    kind = "gradients"
    histories: dict[str, ChangeHistory] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._registered = 0
        self._all_registered = asyncio.Event()
        self._expected = sum(self.num_parts_by_peer)
        self._deltas: list[list[torch.Tensor]] = [[] for _ in range(self.group_size)]
        if self._expected == 0:
            self._all_registered.set()

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        super().register_processed_part(peer_index, part_index, part)
        self._deltas[peer_index].append(part)
        self._registered += 1
        if self._registered >= self._expected:
            self._all_registered.set()

    async def iterate_output_tensors(self) -> Any:
        done = asyncio.create_task(self._all_registered.wait())
        ended = asyncio.create_task(self.finished.wait())
        try:
            await asyncio.wait({done, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (done, ended):
                task.cancel()
        if self._all_registered.is_set() and self.return_deltas:
            inputs = [[part for part, _ in self._input_parts_by_peer[i]] for i in range(self.group_size)]
            history = self.histories.setdefault(f"{self.history_key}/{self.total_size}", ChangeHistory())
            report = screen_deltas(
                self._deltas,
                inputs,
                own_index=self.own_index,
                senders=self.senders,
                history=history,
                kind=self.kind,
            )
            if report:
                _note_screening(report, self.peer_names, self.history_key)
        async for tensor in super().iterate_output_tensors():
            yield tensor


def _note_screening(report: ScreenReport, peer_names: Sequence[str], what: str) -> None:
    said = []
    if report.non_finite_parts:
        said.append(f"refused {report.non_finite_parts} non-finite part(s)")
    for peer, count in sorted(report.refused_parts.items()):
        name = peer_names[peer] if peer < len(peer_names) else f"#{peer}"
        said.append(f"refused {count} outlandish part(s) from peer ...{name}")
    if report.largest_refused > 0:
        said.append(f"the largest change refused was {report.largest_refused:.2f} times its part's size")
    logger.warning("averaging (%s): %s; kept this peer's own values there", what, ", ".join(said))


def install_robust_averaging() -> None:
    """Make every all-reduce of this process robust (:mod:`workers.robust`): hivemind's ``AllReduceRunner``
    builds its part reducer and container from :mod:`hivemind.averaging.allreduce`'s names, which now
    point at :class:`RobustPartReducer` and :class:`RobustPartContainer`. Idempotent."""
    from hivemind.averaging import allreduce

    require(allreduce, "AllReduceRunner", "TensorPartReducer", "TensorPartContainer")
    if getattr(allreduce, "_va_robust", False):
        return
    allreduce.TensorPartReducer = RobustPartReducer
    allreduce.TensorPartContainer = RobustPartContainer
    original_init = allreduce.AllReduceRunner.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        prefix = str(getattr(self, "_prefix", "") or "")
        # the parameter rules know that the tensors are copies of one model (the optimizer's state averager);
        # any other averager (gradients, or a plain DecentralizedAverager of anything) gets the generic rules
        kind = "parameters" if prefix.endswith("_state_averager") else "gradients"
        container = self.tensor_part_container
        if isinstance(container, RobustPartContainer):
            own = self.ordered_peer_ids.index(self.peer_id)
            container.own_index = own if container.num_parts_by_peer[own] > 0 else None
            container.senders = len(self.sender_peer_ids)
            container.peer_names = [str(peer)[-8:] for peer in self.ordered_peer_ids]
            container.history_key, container.kind = prefix, kind
        reducer = self.tensor_part_reducer
        if isinstance(reducer, RobustPartReducer):
            reducer.sender_names = [str(peer)[-8:] for peer in self.sender_peer_ids]
            reducer.kind = kind
            reducer.own_rms = root_mean_square([container.local_tensors]) if kind == "gradients" else 0.0
            if self.peer_id in self.sender_peer_ids:
                reducer.own_sender = self.sender_peer_ids.index(self.peer_id)

    allreduce.AllReduceRunner.__init__ = init
    allreduce._va_robust = True

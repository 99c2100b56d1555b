"""The collaborative optimizer: the guarded state averager, epochs of changing size, catching up, DiLoCo.

Mirrors ``hivemind/optim/optimizer.py``. :class:`GuardedOptimizer` subclasses ``hivemind.Optimizer`` through
its hooks (nothing is replaced process-wide):

* ``_make_state_averager``: a copy of upstream's (1.1.12) with the same arguments, except that it builds the
  class :meth:`GuardedOptimizer._averager_class` names (:class:`~workers.compat.state_averager.GuardedStateAverager`,
  or :class:`~workers.compat.state_averager.OuterStepStateAverager` with its outer-step settings) instead of
  ``TrainingStateAverager``;
* ``__init__``: upstream's, then the epoch settings, and one measurement of no delay in
  ``delay_before_state_averaging`` so that state-averaging rounds get pre-scheduled;
* ``load_state_from_peers``, ``_update_global_epoch``: upstream's, then this peer's epoch settings (and a peer
  that refused every state joins the swarm's epoch with its own parameters);
* ``_should_load_state_from_peers``: upstream's answer, except for a peer one epoch behind in the local-updates
  modes.

It also wraps one instance attribute of its tracker, ``ProgressTracker.update_epoch``
(``hivemind/optim/progress_tracker.py``), so that a new epoch's target batch size is set under the tracker's
lock. :class:`OuterStepOptimizer` is DiLoCo's variant; :func:`update_global_epoch` calls
``Optimizer._update_global_epoch`` for a peer that computes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.optim.state_averager import TrainingStateAverager

from workers.compat.progress import samples_accumulated
from workers.compat.state_averager import GuardedStateAverager, OuterStepStateAverager
from workers.compat.version import require

logger = logging.getLogger(__name__)

require(hivemind.Optimizer, "_update_global_epoch", "_make_state_averager")


def update_global_epoch(optimizer: hivemind.Optimizer, grad_scaler: Any = None) -> None:
    """While a peer computes nothing, still take part in the swarm's epoch transition with what it already
    accumulated (hivemind would otherwise count those samples and then never receive them). The same call
    hivemind makes at the end of ``Optimizer.step``."""
    optimizer.state_averager.step(apply_delayed_updates=True)
    if samples_accumulated(optimizer) > 0 and optimizer.tracker.ready_to_update_epoch:
        optimizer._update_global_epoch(grad_scaler)


FIRST_EPOCH_REFRESH_PERIOD = 1.0
"""Seconds at most between two reads of the swarm's progress during a run's first epoch. hivemind waits up to
``max_refresh_period`` when it expects the epoch to end later, and at the start it expects that from the
first steps' throughput, slowed by start-up: a demo's peers saw each other with an ETA of 19 s and read again
7.5 s later, by when they had trained 2,416 samples for a target of 2,048, each on its own from the same
initial weights. Their first round came after ~2,800 samples per peer, and simulated, a first round that late
costs 7-25 points of prompt accuracy at 100k samples (README, "Learning per sample")."""

EpochSettings = Callable[[int], tuple[int, float, float]]
"""``epoch -> (target_batch_size, matchmaking_time, request_timeout)`` for a run whose epochs differ
(``OptimizerSettings.early_epochs``)."""


class GuardedOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose state averager is a :class:`GuardedStateAverager`, whose state
    averaging rounds are pre-scheduled (below), and whose epochs may differ in size.

    :param epoch_settings: the target batch size, matchmaking time and request timeout of each global
        epoch (None: hivemind's fixed ``target_batch_size`` and ``matchmaking_time``). Every peer derives
        them from its epoch, so the swarm agrees on them; they are applied whenever this peer's epoch
        changes (an epoch transition, or catching up by a state download).
    """

    def __init__(self, *, epoch_settings: EpochSettings | None = None, **kwargs: Any):
        self._epoch_settings = epoch_settings
        self._settings_epoch: int | None = None
        super().__init__(**kwargs)
        require(self, "tracker", "matchmaking_time", "target_batch_size", "local_epoch")
        require(self.tracker, "target_batch_size", "max_refresh_period", "update_epoch", "global_progress")
        self._refresh_period = self.tracker.max_refresh_period
        if epoch_settings is not None:
            self._size_epochs_as_they_begin(epoch_settings)
        self._apply_epoch_settings()
        # hivemind 1.1.12 starts looking for a state-averaging group ``matchmaking_time`` before the epoch
        # ends only once it has measured the delay before such a round, and measures it only for a round it
        # pre-scheduled, so it never does: every round then begins its matchmaking at the epoch boundary and
        # the peers train on for the whole matchmaking time before the result arrives, by the delta rule. That
        # staleness costs learning (README, "Learning per sample"). One measurement of no delay starts the
        # cycle; hivemind's own measurements of the following rounds take over.
        require(self, "delay_before_state_averaging", "_maybe_schedule_state_averaging")
        require(self, "_should_load_state_from_peers", "use_gradient_averaging")
        if self.delay_before_state_averaging.num_updates == 0:
            self.delay_before_state_averaging.update(task_size=1, interval=0.0)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """hivemind's catching up, except that a peer which refused every state it was served (see
        :class:`GuardedStateAverager`) joins the swarm's epoch with its own parameters, which the next
        averaging round merges with its partners'. Without this it would stay behind and download again
        at every step."""
        super().load_state_from_peers(**kwargs)
        averager = self.state_averager
        if getattr(averager, "last_download_refused", False) and self.local_epoch < self.tracker.global_epoch:
            logger.warning(
                "joining the swarm's epoch %d with this peer's own parameters (was at %d)",
                self.tracker.global_epoch, self.local_epoch,
            )  # fmt: skip
            averager.local_epoch = self.tracker.global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                averager.state_sharing_priority = self.local_epoch
        self._apply_epoch_settings()

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        super()._update_global_epoch(grad_scaler)
        self._apply_epoch_settings()

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's check, except that in the local-updates modes a peer exactly one epoch behind ends its
        epoch and averages in the swarm's next round instead of downloading.

        hivemind requires, at a peer's first read of the swarm's progress in each epoch, that it be at the
        swarm's epoch exactly, and a peer one epoch behind downloads a partner's state: right when a missed
        gradient step left its parameters out of date, but in the local-updates modes it discards everything
        the peer trained since its last round, and stalls it for the download while its partners, counting on
        its throughput, end the epoch short. In four 36-s runs of ``test_a_runs_early_epochs_...``'s script
        on a loaded machine (epochs of ~1 s) the first two peers downloaded 2-4 times per run, and one epoch
        ended at 352 of its 1,024 samples; with this change none downloaded. In the 5-minute demo with 80
        early epochs of 256 samples (~1 s) a peer lost its work this way in a quarter of them (20 downloads);
        of 512 (~2 s), in none (README, "Learning per sample"). A peer two or more epochs behind still
        downloads."""
        should = bool(super()._should_load_state_from_peers())
        behind = self.local_epoch == self.tracker.global_epoch - 1
        if should and behind and not self.use_gradient_averaging:
            self.behind_transitions += 1
            logger.info(
                "one epoch behind the swarm (epoch %d, the swarm's %d): ending this epoch to catch up",
                self.local_epoch, self.tracker.global_epoch,
            )  # fmt: skip
            return False
        if should:
            self.behind_downloads += 1
            logger.info(
                "behind the swarm (epoch %d, the swarm's %d): downloading its state",
                self.local_epoch, self.tracker.global_epoch,
            )  # fmt: skip
        return should

    behind_downloads = 0
    """Downloads this peer made because it was behind the swarm's epoch (not counting a joiner's first)."""
    behind_transitions = 0
    """Epochs this peer ended, one epoch behind the swarm, instead of downloading (local-updates modes)."""

    def _size_epochs_as_they_begin(self, epoch_settings: EpochSettings) -> None:
        """Give the tracker each epoch's target batch size when the epoch begins, under its lock: set later,
        a progress read in between would size the new epoch as the old (a 1024-sample epoch ended after 368)."""
        tracker = self.tracker
        original = tracker.update_epoch

        def update_epoch(new_epoch: int | None = None) -> int:
            epoch = tracker.local_progress.epoch + 1 if new_epoch is None else new_epoch
            target = epoch_settings(epoch)[0]
            if target != tracker.target_batch_size:
                tracker.target_batch_size = target
                # a read made before now estimated the epoch's end for the old size
                tracker.global_progress.eta_next_epoch = float("inf")
            return original(new_epoch)

        tracker.update_epoch = update_epoch

    def _apply_epoch_settings(self) -> None:
        """The target batch size and matchmaking time of this peer's epoch, if they differ from the last, and
        the tracker's quick refreshes of the run's first epoch (:data:`FIRST_EPOCH_REFRESH_PERIOD`)."""
        if self._settings_epoch == self.local_epoch:
            return
        self._settings_epoch = epoch = self.local_epoch
        first = min(self._refresh_period, FIRST_EPOCH_REFRESH_PERIOD)
        self.tracker.max_refresh_period = first if epoch == 0 else self._refresh_period
        if self._epoch_settings is None:
            return
        target, matchmaking, request_timeout = self._epoch_settings(epoch)
        if target != self.target_batch_size:
            logger.info(
                "epoch %d: averaging every %d samples (was %d)", epoch, target, self.target_batch_size
            )
        self.tracker.target_batch_size = self.target_batch_size = target
        if matchmaking != self.matchmaking_time:
            logger.info(
                "epoch %d: %.2f s of matchmaking (was %.2f)", epoch, matchmaking, self.matchmaking_time
            )
            self.matchmaking_time = matchmaking
            averager = self.state_averager
            if isinstance(averager, GuardedStateAverager):
                averager.set_matchmaking_time(matchmaking, request_timeout=request_timeout)

    def _averager_class(self) -> tuple[type[TrainingStateAverager], dict[str, Any]]:
        return GuardedStateAverager, {}

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        cls, extra = self._averager_class()
        return cls(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **extra,
            **kwargs,
        )


class OuterStepOptimizer(GuardedOptimizer):
    """``hivemind.Optimizer`` in local-updates mode whose state averager is an :class:`OuterStepStateAverager`.

    While the peer is alone (no averaging round this epoch) its anchor follows its parameters, so that
    when a partner arrives the first outer gradient spans one round, not everything trained alone.
    """

    def __init__(self, *, outer_lr: float, outer_momentum: float, **kwargs: Any):
        self._outer_settings = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
        if not kwargs.get("use_local_updates"):
            raise ValueError("the outer step needs use_local_updates=True")
        super().__init__(**kwargs)

    def _averager_class(self) -> tuple[type[TrainingStateAverager], dict[str, Any]]:
        return OuterStepStateAverager, dict(self._outer_settings)

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        alone = self.tracker.global_progress.num_peers <= 1
        super()._update_global_epoch(grad_scaler)
        averager = self.state_averager
        if alone and isinstance(averager, OuterStepStateAverager) and not averager.averaging_in_progress:
            averager.reanchor()

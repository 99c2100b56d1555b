"""The training state averager: nothing non-finite in or out, local steps during rounds, DiLoCo's outer step.

Mirrors ``hivemind/optim/state_averager.py``. Subclasses of ``TrainingStateAverager``, built by
:class:`workers.compat.optimizer.GuardedOptimizer`'s ``_make_state_averager`` (nothing is replaced
process-wide).

:class:`GuardedStateAverager` overrides

* ``_apply_averaging_results_``: a result that holds NaN or infinity is refused (upstream applies it);
* ``get_current_state``: a non-finite state is not served;
* ``step``: a plain local optimizer step of the local-updates modes runs at once in the caller's thread
  (upstream first waits for every pending background round, ``self.pending_updates``), and
  ``_load_local_tensors_into_averager_`` takes the same lock as that step;
* ``_get_handle_name``: answers the RPC names of a plain ``TrainingStateAverager`` (upstream derives them from
  the class name);
* ``served_state_problem`` (:mod:`workers.compat.state_download`): adds the loss check;

and adds :meth:`GuardedStateAverager.set_matchmaking_time`, which sets ``Matchmaking.min_matchmaking_time``,
``Matchmaking.request_timeout`` and ``PotentialLeaders.min_matchmaking_time``
(``hivemind/averaging/matchmaking.py``) in the averager's process, and
:meth:`GuardedStateAverager.average_with_peers`.

:class:`OuterStepStateAverager` (DiLoCo) applies a round's result through an outer Nesterov step. The
functions :func:`dump_optimizer_state` and :func:`load_optimizer_state` wrap upstream's of the same names.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import MPFuture

from workers.compat.matchmaking import matchmaking_query_interval
from workers.compat.state_download import _CheckedStateDownload, tensors_finite
from workers.compat.version import require
from workers.robust import state_loss_problem

logger = logging.getLogger(__name__)

require(
    TrainingStateAverager,
    "_apply_averaging_results_",
    "_local_tensors",
    "get_tensors",
    "_get_handle_name",
    "get_current_state",
    "load_state_from_peers",
    "_load_local_tensors_into_averager_",
    "_update_scheduler",
    "step",
)


class GuardedStateAverager(TrainingStateAverager, _CheckedStateDownload):
    """hivemind's state averager that never lets a non-finite number in or out.

    * An averaging round whose result holds NaN or infinity (a peer sent them, or an all-reduce part was
      divided by a zero total weight) is not applied: the peer keeps its local parameters.
    * A downloaded state (joining, catching up) with NaN or infinity is refused, and so is one whose
      parameters do far worse on a fixed batch than this peer's own (:attr:`state_probe`, set by the owner:
      :func:`workers.robust.loss_probe`; the bound is :func:`workers.robust.state_loss_problem`). The state
      is then taken from another peer.
    * A peer whose own state is not finite does not serve it to others (the downloader moves on to the
      next peer).

    When hivemind averages in place (``reuse_tensors``: the gradients mode with an offloaded optimizer)
    there is no result to refuse; the worker's check after every round (``Trainer._ensure_finite_model``)
    replaces a broken model with the swarm's state.

    It speaks the plain averager's RPC names, so that every kind of peer can average and download with it.
    """

    refused_rounds = 0
    state_probe: Callable[[], float] | None = None
    """The model's loss on a fixed batch (:func:`workers.robust.loss_probe`): what a downloaded state's
    parameters are checked with. None: only non-finite states are refused."""

    def __init__(self, **kwargs: Any):
        # held by a local step and by the round's copy of the local tensors (step, below)
        self._local_tensors_lock = threading.Lock()
        super().__init__(**kwargs)

    def step(self, **kwargs: Any) -> Any:
        """hivemind's ``step``, except that a plain local optimizer step of the local-updates modes no
        longer waits for a background averaging round to finish.

        With ``delta_rule_averaging`` hivemind 1.1.12 makes every local step wait for any pending round
        (matchmaking, then the all-reduce), so a peer stood idle from its epoch transition until the round
        ended: 40 % of the wall time of a 2-peer ``volunteer-app demo`` (py-spy). The delta rule already
        keeps the steps taken while a round runs; here they are taken in the caller's thread (the
        executor may be busy with the round), the round's result is applied at the first step after it
        finished, and the copy of the local tensors into the averager's buffers at the round's start is
        kept apart from the steps by a lock, so that a round never averages a half-updated model.
        """
        if not self._is_plain_local_step(kwargs):
            return super().step(**kwargs)
        if kwargs.get("apply_delayed_updates", True) and self.finished_averaging_round.is_set():
            self._apply_averaging_results_()
            self.finished_averaging_round.clear()
        with self._local_tensors_lock, self.lock_optimizer:
            self.optimizer.step()
            self._update_scheduler()
        return None

    def _is_plain_local_step(self, kwargs: dict[str, Any]) -> bool:
        allowed = {
            "optimizer_step",
            "increment_epoch",
            "delay_optimizer_step",
            "grad_scaler",
            "apply_delayed_updates",
        }
        return (
            self.delta_rule_averaging
            and not self.reuse_tensors
            and not self.offload_optimizer
            and bool(kwargs.get("optimizer_step"))
            and not kwargs.get("increment_epoch")
            and not kwargs.get("delay_optimizer_step")
            and kwargs.get("grad_scaler") is None
            and set(kwargs) <= allowed
        )

    def _load_local_tensors_into_averager_(self) -> None:
        with self._local_tensors_lock:
            super()._load_local_tensors_into_averager_()

    def set_matchmaking_time(self, seconds: float, *, request_timeout: float) -> None:
        """Gather the following averaging groups for ``seconds`` (a run's early epochs use a shorter time
        than its later ones), asking potential leaders with ``request_timeout``. hivemind fixes both when
        the averager starts; they live in this process (where a round's start is scheduled) and in the
        averager's process (where groups are gathered), so both are updated. A round already gathering
        keeps the time it began with."""
        self.matchmaking_kwargs["min_matchmaking_time"] = seconds
        self.matchmaking_kwargs["request_timeout"] = request_timeout
        future: MPFuture[None] = MPFuture()
        self._outer_pipe.send(
            (
                "_va_set_matchmaking_time",
                [],
                dict(seconds=seconds, request_timeout=request_timeout, future=future),
            )
        )

        def report(done: MPFuture[None]) -> None:
            if done.exception() is not None:
                logger.warning("could not change the averager's matchmaking time: %s", done.exception())

        future.add_done_callback(report)

    async def _va_set_matchmaking_time(
        self, seconds: float, request_timeout: float, future: MPFuture[None]
    ) -> None:
        try:
            matchmaking = self._matchmaking
            require(
                matchmaking,
                "min_matchmaking_time",
                "request_timeout",
                "potential_leaders",
                "group_key_manager",
            )
            require(matchmaking.potential_leaders, "min_matchmaking_time")
            matchmaking.min_matchmaking_time = seconds
            matchmaking.potential_leaders.min_matchmaking_time = seconds
            matchmaking.request_timeout = request_timeout
            # the pace of group-key reads follows the declarations' lifetime (install_calm_matchmaking)
            matchmaking.group_key_manager._va_query_interval = matchmaking_query_interval(seconds)
            self.matchmaking_kwargs["min_matchmaking_time"] = seconds
            self.matchmaking_kwargs["request_timeout"] = request_timeout
            future.set_result(None)
        except Exception as exc:  # reported in the owner's process
            future.set_exception(exc)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names every RPC after the servicer's class; a subclass would speak a protocol that plain
        # state averagers (the coordinator's checkpointer, peers of older versions) do not understand.
        return TrainingStateAverager._get_handle_name(namespace, method_name)

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        with self.get_tensors() as averaged:
            finite = tensors_finite(averaged)
        old = getattr(self, "_old_tensors", None)
        if finite and old is not None and not tensors_finite(old):
            # this peer contributed while broken: take the average as it is (hivemind's own fallback)
            self._old_tensors = None
        if not finite:
            self.refused_rounds += 1
            self._old_tensors = None
            logger.warning(
                "refused the result of an averaging round: it holds non-finite numbers (NaN or infinity) "
                "from a broken or hostile peer; keeping this peer's parameters"
            )
            return
        self._apply_finite_results_()

    def _apply_finite_results_(self) -> None:
        super()._apply_averaging_results_()

    @torch.no_grad()
    def served_state_problem(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> str | None:
        """Non-finite numbers, or parameters whose loss on the check batch is far worse than this peer's own
        (measured by putting them in the model for one forward pass, then putting its own back)."""
        problem = super().served_state_problem(metadata, tensors)
        probe, parameters = self.state_probe, self.main_parameters
        if problem is not None or probe is None or len(tensors) < len(parameters):
            return problem  # too few tensors: hivemind refuses the state itself
        for mine, served in zip(parameters, tensors, strict=False):
            if tuple(mine.shape) != tuple(served.shape):
                return f"a tensor has shape {tuple(served.shape)}, not {tuple(mine.shape)}"
        with self._local_tensors_lock:
            own = probe()
            kept = [p.detach().to("cpu", copy=True) for p in parameters]
            try:
                for mine, served in zip(parameters, tensors, strict=False):
                    mine.copy_(served)
                loss = probe()
            finally:
                for mine, before in zip(parameters, kept, strict=True):
                    mine.copy_(before)
        return state_loss_problem(own, loss)

    def _averaged_tensor_count(self, tensors: Sequence[torch.Tensor]) -> int:
        # a state is the parameters, then extra tensors, then the optimizer's statistics and step counts, which
        # are the first peer's: its moments go with its step count
        return len(self.main_parameters)

    def average_with_peers(
        self, peers: int, timeout: float | None = None, *, exclude: Iterable[str] = ()
    ) -> int:
        """Replace this peer's parameters by their mean with those of up to ``peers`` other peers at its epoch
        (each state checked, and the mean too): the swarm's model between two rounds, rather than this peer's
        drift from it (what the demo's final evaluation draws with). ``timeout``: seconds for all the
        downloads together (none is started after it). ``exclude``: peer ids not to ask (the coordinator's
        checkpointer, which serves an earlier mean). Returns how many other peers' parameters went into the
        mean (0: nobody answered at this epoch in time, or the mean was refused; nothing changed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        states = self._download_states(
            peers, timeout, self._current_refusals(), epoch=self.local_epoch, skip=set(exclude),
            deadline=deadline,
        )  # fmt: skip
        if not states:
            return 0
        with self._local_tensors_lock, torch.no_grad():
            own = [p.detach().to("cpu", copy=True) for p in self.main_parameters]
        mean = self._checked_mean([own, *(tensors[: len(own)] for _, tensors in states)], None)
        if mean is None:
            return 0
        with self._local_tensors_lock, self.lock_optimizer, torch.no_grad():
            for parameter, value in zip(self.main_parameters, mean, strict=True):
                parameter.copy_(value)
        logger.info(
            "this peer's parameters are now their mean with %d other peer(s)' parameters", len(states)
        )
        return len(states)

    def get_current_state(self) -> Any:
        state = super().get_current_state()
        if not tensors_finite(state[1]):
            raise RuntimeError("this peer's state holds non-finite numbers; not serving it")
        return state


class OuterStepStateAverager(GuardedStateAverager):
    """A state averager whose averaging round ends with DiLoCo's outer step instead of plain averaging.

    hivemind's local-updates mode averages parameters in the background and applies the result by the
    delta rule: ``local += averaged - contributed``, which keeps the local steps taken while the round ran.
    Here the averaged parameters first go through :class:`workers.optim.OuterNesterov`, and the peer moves
    to ``local += new_anchor - contributed``. A round that failed (nobody to average with: the averaged
    tensors equal the contributed ones) changes nothing, so its local progress counts toward the next
    round's outer gradient. Loading the swarm's state (joining, catching up) re-anchors the outer step.

    :param outer_lr: the outer learning rate (DiLoCo: 0.7).
    :param outer_momentum: its Nesterov momentum (DiLoCo: 0.9).
    """

    def __init__(self, *, outer_lr: float, outer_momentum: float, **kwargs: Any):
        from workers.optim import OuterNesterov

        super().__init__(**kwargs)
        self.outer = OuterNesterov(list(self.main_parameters), lr=outer_lr, momentum=outer_momentum)
        self.outer_steps = 0

    @torch.no_grad()
    def _apply_finite_results_(self) -> None:
        old: Any = getattr(self, "_old_tensors", None)
        if not self.delta_rule_averaging or old is None:
            super()._apply_finite_results_()
            return
        self._old_tensors = None  # hivemind keeps them; a later failed round must not reuse them
        count = len(self.main_parameters)
        with self.get_tensors() as averaged:
            locals_ = list(self._local_tensors())
            if all(torch.equal(a, o) for a, o in zip(averaged[:count], old[:count], strict=True)):
                logger.debug("averaging round changed nothing (no partner); no outer step")
                return
            anchor = self.outer.step(averaged[:count])
            for local, new, before in zip(locals_[:count], anchor, old[:count], strict=True):
                local.add_((new - before).to(device=local.device, dtype=local.dtype))
            for local, new, before in zip(locals_[count:], averaged[count:], old[count:], strict=True):
                local.add_((new - before).to(device=local.device, dtype=local.dtype))
        self.outer_steps += 1

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        result = super().load_state_from_peers(wait=wait, timeout=timeout)
        self.reanchor()
        return result

    def reanchor(self) -> None:
        """Take the current parameters as the synchronised ones (after loading state, or training alone)."""
        self.outer.reset(list(self.main_parameters))


def dump_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """The optimizer's state as (JSON-ready structure, tensors), the form hivemind sends to joining peers."""
    from hivemind.optim.state_averager import dump_optimizer_state as dump

    metadata, tensors = dump(optimizer)
    return list(metadata), list(tensors)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, metadata: list[dict[str, Any]], tensors: list[torch.Tensor]
) -> None:
    """The inverse of :func:`dump_optimizer_state` for an optimizer of the same structure.

    :raises ValueError: when the saved state does not fit the optimizer.
    """
    from hivemind.optim.state_averager import load_optimizer_state as load

    try:
        load(optimizer, metadata, tensors)
    except (StopIteration, IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"the saved optimizer state does not fit this optimizer ({exc!r})") from exc

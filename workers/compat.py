"""Every place where this project reaches into hivemind's internals, in one module, for one hivemind release.

hivemind's public API does not offer what a volunteer worker needs in several places, so this module
patches or calls private parts of hivemind |version| (``WRITTEN_FOR``). Importing it checks the installed
release: a different minor version is refused with a clear error (the pin in ``pyproject.toml`` says the
same), because a private attribute may have changed meaning without changing name. Each helper also
checks that what it touches still exists, so a mismatch fails at start-up, not mid-training.

* **The all-reduce deserializer** (``hivemind.averaging.allreduce.deserialize_torch_tensor``): wrapped to
  count the bytes this peer receives in averaging rounds (:func:`count_received_bytes`).
* **The progress tracker's reporter** (``ProgressTracker.should_report_progress``,
  ``report_local_progress``, ``shutdown_triggered``, ``global_progress``, ``local_progress``,
  ``ready_to_update_epoch``): throttled so that one signed DHT record per few seconds is stored instead
  of one per step (:func:`throttle_progress_reports`), and read for the worker's progress events.
* **``Optimizer._update_global_epoch``**: called while a peer idles (paused, or waiting for a lease) so that
  the samples it already reported still reach the swarm's epoch transition (:func:`update_global_epoch`).
* **``TrainingStateAverager._apply_averaging_results_``, ``_get_handle_name`` and
  ``Optimizer._make_state_averager``**: the DiLoCo update mode replaces plain parameter averaging by an
  outer Nesterov step on the averaged parameters (:class:`OuterStepStateAverager`,
  :class:`OuterStepOptimizer`), speaking the RPC names of the plain averager (hivemind derives them from
  the class name) so that checkpointers and joining peers can still download its state.
* **The all-reduce's part reducer and part container** (``hivemind.averaging.allreduce``'s
  ``TensorPartReducer``, ``TensorPartContainer`` and ``AllReduceRunner.__init__``): every average is robust
  to a hostile group member (:func:`install_robust_averaging`, the maths in :mod:`workers.robust`).
* **``TrainingStateAverager._apply_averaging_results_``, ``get_current_state`` and
  ``DecentralizedAverager.load_state_from_peers``**: no NaN or infinity enters or leaves a peer's state
  through averaging or state downloads (:class:`GuardedStateAverager`, :class:`GuardedOptimizer`).
* **``DecentralizedAverager._load_state_from_peers``** (the download loop, run in the averager's process;
  re-implemented here from 1.1.12's) and **``Optimizer.load_state_from_peers``**: a downloaded state is
  checked before it is loaded, a refused one is taken from another peer, and a peer refused by everyone
  joins the swarm's epoch with its own parameters (:class:`GuardedStateAverager`).
* **``TrainingStateAverager.step``, ``_load_local_tensors_into_averager_``, ``_update_scheduler``,
  ``lock_optimizer`` and ``finished_averaging_round``**: in the local-updates modes a peer's own optimizer
  steps go on while an averaging round runs, instead of waiting for it (:meth:`GuardedStateAverager.step`).
* **The averagers' matchmaking reads and state-download records** (``GroupKeyManager.get_averagers``,
  ``DecentralizedAverager._declare_for_download_periodically``): paced so that an averager waiting for a
  late partner, or finishing a round, does not flood the DHT with signed requests
  (:func:`install_calm_matchmaking`).
* **``DecentralizedAverager._step`` and ``_load_state_from_peers``** (coroutines that the averager's process
  runs as tasks, one per request from the owner): each task holds a strong reference to itself while it
  runs, which hivemind's request loop does not keep (:class:`_HeldRequestTasks`).
* **The tracker's ``target_batch_size``, the optimizer's ``matchmaking_time`` and the averager's matchmaking
  settings** (``matchmaking_kwargs``, and in its process ``Matchmaking.min_matchmaking_time``,
  ``request_timeout``, ``PotentialLeaders.min_matchmaking_time``): hivemind fixes them at start; a run's
  early epochs change them as the swarm's epoch advances (:class:`GuardedOptimizer`'s ``epoch_settings``;
  ``ProgressTracker.update_epoch`` is wrapped so that an epoch's size is set under the tracker's lock). The
  tracker's ``max_refresh_period`` and the reporter's interval are short in a run's first epoch, so that peers
  starting together average before either has trained far alone (:data:`FIRST_EPOCH_REFRESH_PERIOD`).
* **``Optimizer._should_load_state_from_peers``**: in the local-updates modes a peer one epoch behind the
  swarm ends its epoch instead of discarding its work for a partner's state
  (:meth:`GuardedOptimizer._should_load_state_from_peers`).
* **The DHT node's authorizer** (``DHTNode.protocol.authorizer``): where a refreshed peer token and the
  revocation list are handed to the DHT process (:func:`node_authorizer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from workers.robust import ChangeHistory, ScreenReport, robust_mean, screen_deltas, state_loss_problem

logger = logging.getLogger(__name__)

WRITTEN_FOR = "1.1.12"
"""The hivemind release whose internals this module was written against (and tested with)."""


class HivemindVersionError(RuntimeError):
    """The installed hivemind is not the release this module's patches were written for."""


def check_hivemind_version(installed: str | None = None) -> str:
    """Refuse a hivemind whose major.minor differs from :data:`WRITTEN_FOR`; returns the installed version.

    Patch releases are accepted (1.1.x), with a log line when they differ from the tested one.
    """
    installed = installed or str(getattr(hivemind, "__version__", "unknown"))
    if installed.split(".")[:2] != WRITTEN_FOR.split(".")[:2]:
        raise HivemindVersionError(
            f"hivemind {installed} is installed, but volunteer-app's worker reaches into internals of hivemind "
            f"{WRITTEN_FOR} (workers/compat.py); install 'hivemind>=1.1.12,<1.2'"
        )
    if installed != WRITTEN_FOR:
        logger.info("hivemind %s; workers/compat.py was tested with %s", installed, WRITTEN_FOR)
    return installed


def _require(owner: Any, *names: str) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise HivemindVersionError(
            f"hivemind {getattr(hivemind, '__version__', '?')} lacks {', '.join(missing)} on "
            f"{getattr(owner, '__name__', type(owner).__name__)}; workers/compat.py needs updating"
        )


check_hivemind_version()


# ------------------------------------------------------------------------------------ byte counting


def count_received_bytes(add_received: Callable[[int], None]) -> None:
    """Count incoming all-reduce parts: hivemind decodes each with ``allreduce.deserialize_torch_tensor``.

    Idempotent: a second call replaces the counter, never wraps the wrapper.
    """
    import hivemind.averaging.allreduce as allreduce

    _require(allreduce, "deserialize_torch_tensor")
    original = getattr(allreduce, "_va_original_deserialize", allreduce.deserialize_torch_tensor)

    def counting_deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
        add_received(len(serialized.buffer))
        return original(serialized)

    allreduce._va_original_deserialize = original
    allreduce.deserialize_torch_tensor = counting_deserialize


# ------------------------------------------------------------------------------------ progress tracker


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
    _require(
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


def update_global_epoch(optimizer: hivemind.Optimizer, grad_scaler: Any = None) -> None:
    """While a peer computes nothing, still take part in the swarm's epoch transition with what it already
    accumulated (hivemind would otherwise count those samples and then never receive them). The same call
    hivemind makes at the end of ``Optimizer.step``."""
    optimizer.state_averager.step(apply_delayed_updates=True)
    if samples_accumulated(optimizer) > 0 and optimizer.tracker.ready_to_update_epoch:
        optimizer._update_global_epoch(grad_scaler)


_require(hivemind.Optimizer, "_update_global_epoch", "_make_state_averager")
_require(
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
_require(
    DecentralizedAverager,
    "_step",
    "_load_state_from_peers",
    "load_state_from_peers",
    "get_stub",
    "serializer",
)


# ------------------------------------------------------------------------------------ finite state


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point tensor holds finite numbers only (no NaN, no infinity)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


_HELD_TASKS: set[asyncio.Task[Any]] = set()
"""Request tasks of this process's averagers that are still running (see :class:`_HeldRequestTasks`)."""


class _HeldRequestTasks(DecentralizedAverager):
    """Keeps the averager process's long-running request tasks alive until they finish.

    hivemind 1.1.12's averager process runs each request of its owner (``step``, ``load_state_from_peers``,
    a new download priority, ...) as ``task = asyncio.create_task(...)`` and drops that reference at the
    next request, and asyncio itself holds tasks only weakly. A pending averaging step waits on futures
    that only the step references, so from the next request on (the owner sends one at every epoch
    transition: its new download priority) nothing reachable holds it, and the next full garbage
    collection in that process destroys it mid-round ("Task was destroyed but it is pending!"). Its
    future dies with it ("pipe to origin process was broken ([Errno 9] Bad file descriptor)"), so the
    owner waits out the whole ``averaging_timeout`` holding its averaging lock: no round can start in the
    meantime, and the partner gets half a result. Serving a state download allocates enough to trigger that
    collection, so a checkpointer's download just before an epoch's end broke the round: 15 of 31 epochs of a
    150-s demo went without one, in two streaks of 30 s. Here each step and download task is held in
    :data:`_HELD_TASKS` until it ends.
    """

    async def _step(self, **kwargs: Any) -> Any:
        with _holding_current_task():
            return await super()._step(**kwargs)


@contextlib.contextmanager
def _holding_current_task() -> Iterator[None]:
    task = asyncio.current_task()
    if task is not None:
        _HELD_TASKS.add(task)
    try:
        yield
    finally:
        if task is not None:
            _HELD_TASKS.discard(task)


def states_spread(states: Sequence[Sequence[torch.Tensor]], mean: Sequence[torch.Tensor]) -> float:
    """How far several copies of a model's tensors lie from their ``mean``: the root mean square over the
    copies of their distance to it, over its norm (0: they agree; a copy at twice the mean: 1). Tensors that
    are not floating point are skipped."""
    distance = norm = 0.0
    for i, m in enumerate(mean):
        if not m.is_floating_point():
            continue
        m = m.float()
        norm += float(m.pow(2).sum())
        distance += sum(float((state[i].float() - m).pow(2).sum()) for state in states) / len(states)
    return (distance / norm) ** 0.5 if norm > 0 else 0.0


class _CheckedStateDownload(_HeldRequestTasks):
    """Checks a downloaded state before it is loaded, and takes it from another peer when it is refused.

    hivemind downloads from the peer that declared the highest priority (the newest epoch, by its own word)
    and loads whatever it served. Here a served state is refused when :meth:`served_state_problem` names
    a problem (NaN or infinity here; the parameters' loss in :class:`GuardedStateAverager`), the peer that
    served it is passed over for :data:`REFUSED_SERVER_SECONDS`, and up to :data:`STATE_SERVERS_TRIED`
    peers are tried in all. When every served state is refused the caller loads nothing and keeps its own.
    With :attr:`consensus_peers` above 1, the states of up to that many peers are downloaded and checked, and
    the mean (checked too) of those at the epoch most of them hold is loaded. Sits between
    ``TrainingStateAverager`` and ``DecentralizedAverager`` in :class:`GuardedStateAverager`'s bases, where
    the download returns the tensors before they are copied into the model."""

    STATE_SERVERS_TRIED = 4
    REFUSED_SERVER_SECONDS = 600.0

    refused_states = 0
    consensus_peers = 1
    """How many peers' states a download averages (each checked, all at one epoch). 1: the state
    of the peer with the highest declared priority, as hivemind loads it. The coordinator's checkpointer asks
    for several: between two rounds each peer's model drifts from the swarm's by its own steps (simulated, a
    peer at a round's end scored 7 points below the round's mean at 100k samples), and their mean is close to
    what the next round will give."""
    last_download_peers = 0
    """How many peers' states the last download averaged (0: it loaded nothing)."""
    last_download_spread: float | None = None
    """How far the states the last download averaged lay from their mean (:func:`states_spread`); None: one
    state."""
    last_download_refused = False
    """Whether the last download found no acceptable state although some peer served (or, passed over for a
    state refused earlier, would serve) one."""

    def served_state_problem(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why the state a peer served must not be loaded, or None."""
        if not tensors_finite(tensors):
            return "it holds non-finite numbers (NaN or infinity)"
        return None

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        if not wait:
            return super().load_state_from_peers(wait=wait, timeout=timeout)
        refused = self._current_refusals()
        self.last_download_refused = bool(refused)  # passing over a refused peer is refusing its state
        states = self._download_states(max(1, self.consensus_peers), timeout, refused)
        if len(states) > 1:
            # the epoch most of them hold (the newest among equals): a peer that claims a newer epoch than its
            # partners is downloaded first, and must not decide alone which round's model is kept
            epochs = [metadata.get("epoch") for metadata, _ in states]
            chosen = max(set(epochs), key=lambda e: (epochs.count(e), e if isinstance(e, int) else -1))
            states = [state for state, epoch in zip(states, epochs, strict=True) if epoch == chosen]
        self.last_download_peers, self.last_download_spread = len(states), None
        if not states:
            return None
        self.last_download_refused = False  # a state was loaded, whatever the partners' downloads found
        first = states[0]
        if len(states) == 1:
            return first
        mean = self._checked_mean([tensors for _, tensors in states], first[0])
        if mean is None:
            self.last_download_peers = 1
            return first
        count = self._averaged_tensor_count(first[1])
        self.last_download_spread = states_spread([tensors[:count] for _, tensors in states], mean[:count])
        logger.info(
            "loaded the mean of %d peers' states (their spread: %.4f of its norm)",
            len(states), self.last_download_spread,
        )  # fmt: skip
        return first[0], mean

    def _current_refusals(self) -> dict[str, float]:
        """Peers whose state was refused, with when they may be asked again (expired ones dropped)."""
        refused: dict[str, float] = self.__dict__.setdefault("_refused_servers", {})
        now = time.monotonic()
        for peer in [p for p, until in refused.items() if until <= now]:
            del refused[peer]
        return refused

    def _download_states(
        self,
        count: int,
        timeout: float | None,
        refused: dict[str, float],
        *,
        epoch: int | None = None,
        skip: set[str] | None = None,
        deadline: float | None = None,
    ) -> list[tuple[Any, list[torch.Tensor]]]:
        """Up to ``count`` accepted states of different peers at ``epoch`` (None: at any epoch), highest
        declared priority first, none from the peers in ``skip``, none started after ``deadline`` (a
        ``time.monotonic()`` value). A peer at another epoch holds another round's model: it is passed over."""
        states: list[tuple[Any, list[torch.Tensor]]] = []
        used: set[str] = set(skip or ())
        while len(states) < count:
            try:
                served = self._download_acceptable_state(timeout, refused, used=used, deadline=deadline)
            except TimeoutError:
                if deadline is None:
                    raise
                logger.warning("a peer's state did not arrive in time; averaging %d state(s)", len(states))
                break
            if served is None:
                break
            metadata, tensors, server = served
            used.add(server)
            if epoch is None or metadata.get("epoch") == epoch:
                states.append((metadata, tensors))
        return states

    def _checked_mean(
        self, states: Sequence[Sequence[torch.Tensor]], metadata: Any
    ) -> list[torch.Tensor] | None:
        """The states' mean (:meth:`_mean_state`) if it passes the checks a served state passes, else None."""
        mean = self._mean_state(states)
        try:
            problem = self.served_state_problem(metadata, mean)
        except Exception as exc:
            problem = f"it could not be checked ({exc!r})"
        if problem is not None:  # the peers drifted too far apart for their mean to be a model
            logger.warning(
                "the mean of %d peers' states is refused (%s); keeping one peer's", len(states), problem
            )
            return None
        return mean

    def _download_acceptable_state(
        self,
        timeout: float | None,
        refused: dict[str, float],
        *,
        used: set[str],
        deadline: float | None = None,
    ) -> tuple[Any, list[torch.Tensor], str] | None:
        """``(metadata, tensors, server)`` of the first state that passes the checks, from the peers not in
        ``refused`` or ``used``, highest declared priority first (up to :data:`STATE_SERVERS_TRIED` tried);
        None when no peer served an acceptable one."""
        for _ in range(self.STATE_SERVERS_TRIED):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                timeout = left if timeout is None else min(timeout, left)
            future: Any = MPFuture()
            self._outer_pipe.send(
                (
                    "_load_state_from_peers",
                    [],
                    dict(
                        timeout=timeout, future=future, exclude=sorted(set(refused) | used), with_server=True
                    ),
                )
            )
            served = future.result(timeout=timeout)
            if served is None:
                return None
            metadata, tensors, server = served
            try:
                problem = self.served_state_problem(metadata, tensors)
            except Exception as exc:  # the check itself failed: nothing vouches for this state
                problem = f"it could not be checked ({exc!r})"
            if problem is None:
                return metadata, tensors, server
            self.refused_states += 1
            self.last_download_refused = True
            refused[server] = time.monotonic() + self.REFUSED_SERVER_SECONDS
            logger.warning(
                "refused the state peer ...%s served: %s; not downloading from it for %d minutes",
                server[-8:], problem, self.REFUSED_SERVER_SECONDS // 60,
            )  # fmt: skip
        if not used:
            logger.warning("no peer served an acceptable state; keeping this peer's own")
        return None

    def _mean_state(self, states: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The first state, with its first :meth:`_averaged_tensor_count` tensors replaced by the states' mean
        (only floating-point tensors of one shape in every state; the rest are the first state's)."""
        count = self._averaged_tensor_count(states[0])
        mean = list(states[0])
        for i in range(min(count, len(mean))):
            group = [state[i] for state in states if i < len(state)]
            if len(group) == len(states) and all(
                t.is_floating_point() and t.shape == group[0].shape for t in group
            ):
                mean[i] = torch.stack([t.float() for t in group]).mean(dim=0).to(group[0].dtype)
        return mean

    def _averaged_tensor_count(self, tensors: Sequence[torch.Tensor]) -> int:
        """How many leading tensors of a state are averaged by a download from several peers: all of them
        here; the model's parameters in :class:`GuardedStateAverager`."""
        return len(tensors)

    async def _load_state_from_peers(
        self,
        future: Any,
        timeout: float | None = None,
        exclude: Sequence[str] = (),
        with_server: bool = False,
    ) -> None:
        """hivemind 1.1.12's download loop (peers by declared priority, highest first), except that it skips
        the peers in ``exclude`` and, ``with_server``, answers ``(metadata, tensors, server's peer id)``.
        Its task is held until it ends (:class:`_HeldRequestTasks`)."""
        with _holding_current_task():
            await self._download_state(future, timeout, exclude, with_server)

    async def _download_state(
        self, future: Any, timeout: float | None, exclude: Sequence[str], with_server: bool
    ) -> None:
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            peer_priority, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            if not isinstance(peer_priority, dict):
                peer_priority = {}
            priorities = {
                PeerID(peer_id): (float(info.value), random.random())  # randomness breaks ties
                for peer_id, info in peer_priority.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
            }
            skip = set(exclude)
            for peer in sorted(priorities, key=priorities.__getitem__, reverse=True):
                if peer == self.peer_id or str(peer) in skip:
                    continue
                started = time.monotonic()
                logger.info("downloading the swarm's state from peer ...%s", str(peer)[-8:])
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata: Any = None
                    parts: list[Any] = []
                    tensors: list[torch.Tensor] = []
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # the start of the next tensor
                            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    if not metadata:
                        logger.debug("peer %s did not send its state", peer)
                        continue
                    logger.info(
                        "downloaded the state in %.3f s from ...%s",
                        time.monotonic() - started,
                        str(peer)[-8:],
                    )
                    future.set_result((metadata, tensors, str(peer)) if with_server else (metadata, tensors))
                    return
                except Exception as exc:
                    logger.warning("could not download the state from ...%s: %r", str(peer)[-8:], exc)
        finally:
            if not future.done():
                future.set_result(None)


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
            _require(
                matchmaking,
                "min_matchmaking_time",
                "request_timeout",
                "potential_leaders",
                "group_key_manager",
            )
            _require(matchmaking.potential_leaders, "min_matchmaking_time")
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
        _require(self, "tracker", "matchmaking_time", "target_batch_size", "local_epoch")
        _require(self.tracker, "target_batch_size", "max_refresh_period", "update_epoch", "global_progress")
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
        _require(self, "delay_before_state_averaging", "_maybe_schedule_state_averaging")
        _require(self, "_should_load_state_from_peers", "use_gradient_averaging")
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


# ------------------------------------------------------------------------------------ robust all-reduce


class RobustPartReducer(TensorPartReducer):
    """hivemind's part reducer, averaging each part with :func:`workers.robust.robust_mean` (non-finite
    contributions dropped, weights capped, CenteredClip with three or more senders) instead of a running
    weighted sum. Keeps every contribution of the current part until the part is complete."""

    sender_names: Sequence[str] = ()
    own_sender: int | None = None
    kind = "gradients"

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
            result = robust_mean(self._contributions, shape, dropped, own=own, kind=self.kind)
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

    _require(allreduce, "AllReduceRunner", "TensorPartReducer", "TensorPartContainer")
    if getattr(allreduce, "_va_robust", False):
        return
    allreduce.TensorPartReducer = RobustPartReducer
    allreduce.TensorPartContainer = RobustPartContainer
    original_init = allreduce.AllReduceRunner.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        prefix = str(getattr(self, "_prefix", "") or "")
        kind = "gradients" if prefix.endswith("_grad_averager") else "parameters"
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
            if self.peer_id in self.sender_peer_ids:
                reducer.own_sender = self.sender_peer_ids.index(self.peer_id)

    allreduce.AllReduceRunner.__init__ = init
    allreduce._va_robust = True


# ------------------------------------------------------------------------------------ matchmaking pace

MATCHMAKING_QUERY_INTERVAL = 0.5
"""Seconds at least between two reads of an averaging group's key by one averager while it looks for a
group. hivemind reads it again as soon as the previous read ends whenever no leader is in view, which
in a 2-peer ``volunteer-app demo`` was 10-60 signed DHT requests a second for as long as a partner was
late (one peer made 8,015 in 2 minutes), each answered by the other peers' DHTs too: the workers' DHT and
averager processes took 0.34 of the 2 cores and p2pd 0.17 (0.06 and 0.03 with this pacing and the state
record's; ``tests/perf/bench_demo.py``). Half a second still finds a partner well within the runs'
``matchmaking_time`` of several seconds. A shorter ``matchmaking_time`` reads proportionally more often
(:func:`matchmaking_query_interval`)."""

STATE_DECLARE_INTERVAL = 2.0
"""Seconds at least between two records of this averager's state-download priority. hivemind stores the
record again whenever its state changes, and an averaging round marks the state changed once per tensor,
so each round sent dozens of signed DHT stores in a burst; the priority is the local epoch, which a
record every few seconds keeps current."""


def matchmaking_query_interval(matchmaking_time: float) -> float:
    """Seconds between two reads of a group's key for averagers whose ``matchmaking_time`` is this.

    An averager declares itself a leader for ``matchmaking_time`` and others see it only if they read the
    key within that window. Two peers that look for a group at the same moment both find none at first, and
    with reads ``matchmaking_time`` apart each later read came after the other's declaration had expired:
    with 0.5 s of matchmaking, rounds of a demo took 2-3.5 s to match, longer than an epoch, and 15 of 116
    epochs went without a round. A quarter of the window gives every declaration three reads."""
    return min(MATCHMAKING_QUERY_INTERVAL, max(0.02, matchmaking_time / 4))


def install_calm_matchmaking(
    *, query_interval: float = MATCHMAKING_QUERY_INTERVAL, declare_interval: float = STATE_DECLARE_INTERVAL
) -> None:
    """Pace the averagers' DHT traffic of this process and of the averager processes it starts later:
    ``GroupKeyManager.get_averagers`` waits until ``query_interval`` has passed since its previous read,
    and ``DecentralizedAverager._declare_for_download_periodically`` waits ``declare_interval`` after each
    record before it stores a newer one (the latest priority is always the one stored). Installed once;
    a later call sets the intervals for averager processes started after it."""
    from hivemind.averaging import key_manager
    from hivemind.utils.timed_storage import get_dht_time

    _require(key_manager.GroupKeyManager, "get_averagers", "current_key")
    _require(
        DecentralizedAverager,
        "_declare_for_download_periodically",
        "_trigger_declare_load_state",
        "allow_state_sharing",
        "state_sharing_priority",
    )
    manager_class = key_manager.GroupKeyManager
    manager_class._va_query_interval = query_interval
    DecentralizedAverager._va_declare_interval = declare_interval
    if getattr(manager_class, "_va_calm", False):
        return
    original_get_averagers = manager_class.get_averagers

    async def get_averagers(self: Any, group_key: str, only_active: bool) -> Any:
        wait = getattr(self, "_va_last_query", float("-inf")) + self._va_query_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._va_last_query = time.monotonic()
        return await original_get_averagers(self, group_key, only_active)

    async def declare_for_download_periodically(self: Any) -> None:
        # hivemind 1.1.12's loop, with a pause of declare_interval after each record
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        stores: set[asyncio.Task[Any]] = set()  # referenced until done, so that none is collected early
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            self._state_updated.clear()  # a change from now on is stored after the pause
            if self.allow_state_sharing or sharing_was_allowed:
                task = asyncio.create_task(
                    asyncio.wait_for(
                        self.dht.store(
                            download_key,
                            subkey=self.peer_id.to_bytes(),
                            value=self.state_sharing_priority if self.allow_state_sharing else None,
                            expiration_time=expiration_time,
                            return_future=True,
                        ),
                        timeout=expiration_time - get_dht_time(),
                    )
                )
                stores.add(task)
                task.add_done_callback(stores.discard)
                sharing_was_allowed = self.allow_state_sharing
            await asyncio.sleep(self._va_declare_interval)
            try:
                remaining = max(0.0, expiration_time - get_dht_time())
                await asyncio.wait_for(self._state_updated.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    manager_class.get_averagers = get_averagers
    DecentralizedAverager._declare_for_download_periodically = declare_for_download_periodically
    manager_class._va_calm = True


# ------------------------------------------------------------------------------------ DiLoCo


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


# ------------------------------------------------------------------------------------ optimizer state


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


# ------------------------------------------------------------------------------------ DHT


def node_authorizer(node: Any) -> Any:
    """The authorizer of a DHT node, inside the DHT's process (for ``DHT.run_coroutine`` callbacks)."""
    return node.protocol.authorizer

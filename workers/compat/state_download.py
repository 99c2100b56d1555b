"""State downloads (joining, catching up): checked before loading, taken elsewhere when refused, averaged.

Mirrors ``DecentralizedAverager.load_state_from_peers`` and ``_load_state_from_peers`` of
``hivemind/averaging/averager.py``. :class:`_CheckedStateDownload` is a subclass (it sits between
``TrainingStateAverager`` and ``DecentralizedAverager`` in the bases of
:class:`workers.compat.state_averager.GuardedStateAverager`; nothing is replaced process-wide) that overrides:

* ``load_state_from_peers`` (the owner's side): asks the averager's process for one state at a time, without
  the peers it refused, checks each (:meth:`_CheckedStateDownload.served_state_problem`) and, with
  :attr:`_CheckedStateDownload.consensus_peers` above 1, answers the mean of several. Upstream sends one
  ``_load_state_from_peers`` request and answers what it got; ``TrainingStateAverager.load_state_from_peers``
  (which calls it) loads the answer, in both cases.
* ``_load_state_from_peers`` (in the averager's process): a re-written copy of hivemind 1.1.12's
  ``DecentralizedAverager._load_state_from_peers`` (:meth:`_CheckedStateDownload._download_state`). What
  differs, for a diff against upstream: the arguments ``exclude`` (peer ids it skips) and ``with_server`` (it
  answers ``(metadata, tensors, server's peer id)``); a priority record that is not a dict counts as empty
  (upstream fails on it); no "could not load state from peers" log line when nobody is there; a failed peer is
  a warning without a traceback (upstream: ``logger.exception``); and its task is held until it ends
  (:mod:`workers.compat.averager`). The order of peers, the streaming and the timeouts are upstream's.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from workers.compat.averager import _HeldRequestTasks, _holding_current_task
from workers.compat.version import require

logger = logging.getLogger(__name__)

require(DecentralizedAverager, "_load_state_from_peers", "load_state_from_peers", "get_stub", "serializer")


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point tensor holds finite numbers only (no NaN, no infinity)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


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

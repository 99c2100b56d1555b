"""The hivemind parts of a worker: the run's DHT, the collaborative optimizer in its update mode, and
their instruments.

The update modes (``OptimizerSettings.update_mode``; docs/learning-per-sample.md compares them, measured
with ``tests/perf/bench_learning.py`` and ``tests/perf/bench_collaboration.py``):

* ``gradients``: every peer accumulates gradients until the swarm has ``target_batch_size`` samples,
  the gradients are averaged and every peer takes the same optimizer step. Exactly synchronous data
  parallelism, but one step per target batch: a small swarm learns far less per sample than one
  process stepping every micro-batch, and an averaging round is needed for every step.
* ``local``: every peer steps on its own micro-batches (``local_batch_size`` samples per step, as one
  process would) and the swarm averages parameters every ``target_batch_size`` samples, in the
  background (hivemind's delta rule keeps the steps taken while a round runs).
* ``diloco``: ``local``, and the averaged parameters' offset from the previous round's is the
  gradient of an outer SGD with Nesterov momentum (DiLoCo; INTELLECT-1 ran it across continents): the
  outer momentum carries the swarm's consensus direction between rounds.

Choices that matter for speed on small CPU peers (measured with ``tests/perf/bench_swarm_efficiency.py``):

* **Progress reports are throttled** (:func:`workers.compat.throttle_progress_reports`): one signed DHT
  record per few seconds instead of one per step.
* **Gradient averaging runs in the background** (``delay_optimizer_step`` + ``delay_grad_averaging``)
  in ``gradients`` mode: the peer keeps computing while the all-reduce of the previous epoch finishes,
  at the cost of one step of staleness. Parameter averaging of the local modes is always in the background.
* **Relays, AutoNAT and UPnP are off** when the worker listens on loopback or a public address: they only
  add background traffic. Peers behind NAT run in client mode instead (the coordinator decides).
* **The tracker refreshes global progress less eagerly** than hivemind's defaults.

"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable, Iterable
from typing import Any

import hivemind
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)
from hivemind.proto import runtime_pb2

from volunteer_app.protocol import DIRECT, RELAYED, Compression, OptimizerSettings, PeerAssignment
from volunteer_app.tokens import PeerToken, TokenError, VerifyingKeys, verify_revocation
from workers import compat
from workers.authorizer import PeerTokenAuthorizer, push_revocations

logger = logging.getLogger(__name__)


class ByteCounter:
    """Bytes this peer sent and received in averaging rounds, shared with hivemind's averager processes.

    The averagers are forked from the worker, so the counters live in shared memory created before the
    fork; compression of every outgoing tensor part and decoding of every incoming one add to them.
    """

    def __init__(self) -> None:
        self._sent = mp.Value("q", 0, lock=True)
        self._received = mp.Value("q", 0, lock=True)

    def add_sent(self, count: int) -> None:
        with self._sent.get_lock():
            self._sent.value += count

    def add_received(self, count: int) -> None:
        with self._received.get_lock():
            self._received.value += count

    @property
    def sent(self) -> int:
        return int(self._sent.value)

    @property
    def received(self) -> int:
        return int(self._received.value)


class CountingCompression(CompressionBase):
    """Wraps a hivemind compression and counts the bytes of every tensor part it encodes."""

    def __init__(self, inner: CompressionBase, counter: ByteCounter):
        self.inner = inner
        self.counter = counter
        self.compression_type = inner.compression_type

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        serialized = self.inner.compress(tensor, info, allow_inplace)
        self.counter.add_sent(len(serialized.buffer))
        return serialized

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)

    def __repr__(self) -> str:
        return f"Counting({self.inner!r})"


def count_received_bytes(counter: ByteCounter) -> None:
    """Count incoming all-reduce parts too (see :func:`workers.compat.count_received_bytes`)."""
    compat.count_received_bytes(counter.add_received)


def make_compression(name: Compression, *, gradients: bool) -> CompressionBase:
    """``none``, ``fp16`` (scaled fp16 for gradients, plain fp16 for parameters) or ``8bit`` (uniform)."""
    if name == "fp16":
        return ScaledFloat16Compression() if gradients else Float16Compression()
    if name == "8bit":
        return Uniform8BitQuantization()
    return NoCompression()


def listen_maddrs(host: str, port: int = 0) -> list[str]:
    return [f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"]


def build_dht(
    *,
    initial_peers: list[str],
    authorizer: PeerTokenAuthorizer,
    host: str,
    announce_host: str | None,
    client_mode: bool,
    port: int = 0,
    reachability: str = DIRECT,
    await_ready: bool = True,
) -> hivemind.DHT:
    """Join the run's DHT through the coordinator's swarm peer (and any other initial peers).

    ``reachability`` is the coordinator's verdict at join (``coordinator/reachability.py``): a ``relayed``
    peer reserves a slot on the initial peers (the run's swarm peers, which relay) and announces only the
    addresses through them (:func:`workers.compat.relayed_options`); a ``client`` dials and is never dialled.

    With ``await_ready=False`` the DHT's process starts in the background; call ``wait_until_ready`` before
    using it (a failure to start or to reach the initial peers is raised there)."""
    quiet = host.startswith("127.") or host == "::1" or announce_host is not None
    relays = [peer for peer in initial_peers if "/p2p/" in peer]
    if reachability == RELAYED and not relays:
        logger.warning(
            "told to go through a relay, but no initial peer names its id: taking part as a client"
        )
        client_mode = True
    kwargs: dict[str, Any] = {}
    if quiet or client_mode:
        kwargs.update(use_relay=False, auto_nat=False, nat_port_map=False)
    if announce_host:
        kwargs["announce_maddrs"] = listen_maddrs(announce_host, port)
    if reachability == RELAYED and not client_mode:
        compat.install_static_relays()  # before the DHT's process starts its daemon
        kwargs.update(compat.relayed_options(relays))
    return hivemind.DHT(
        initial_peers=initial_peers,
        start=True,
        host_maddrs=listen_maddrs(host, port),
        client_mode=client_mode,
        authorizer=authorizer,
        await_ready=await_ready,
        **kwargs,
    )


def build_optimizer(
    *,
    dht: hivemind.DHT,
    run_id: str,
    params: Iterable[Any],
    optimizer_factory: Callable[[Any], torch.optim.Optimizer],
    settings: OptimizerSettings,
    assignment: PeerAssignment,
    micro_batch_size: int,
    counter: ByteCounter,
    scheduler_factory: Callable[[Any], Any] | None = None,
    report_interval: float = 5.0,
) -> hivemind.Optimizer:
    """The collaborative optimizer for this peer, with the run's settings and this peer's assignment.

    :param params: parameters or param-group dicts (:func:`workers.optim.param_groups`).
    :param optimizer_factory: builds the local optimizer from hivemind's copies of ``params``.
    :param scheduler_factory: the learning-rate schedule over global epochs (``workers.optim``).
    """
    # every process-wide replacement, before hivemind starts the averagers' processes (which inherit them)
    first_matchmaking = settings.epoch_matchmaking_time(0)
    compat.install(query_interval=compat.matchmaking_query_interval(first_matchmaking))
    local = settings.update_mode != "gradients"
    delayed = not local and (assignment.delay_optimizer_step or assignment.device == "cpu")
    kwargs: dict[str, Any] = dict(
        dht=dht,
        run_id=run_id,
        target_batch_size=settings.epoch_target_batch_size(0),
        batch_size_per_step=micro_batch_size * assignment.accumulation_steps,
        optimizer=optimizer_factory,
        params=params,
        scheduler=scheduler_factory,
        matchmaking_time=first_matchmaking,
        # hivemind's default is the matchmaking time, which the early epochs shorten: a partner that stalls
        # mid-round gets the later epochs' patience throughout
        next_chunk_timeout=max(settings.matchmaking_time, settings.early_matchmaking_time),
        averaging_timeout=settings.averaging_timeout,
        offload_optimizer=assignment.offload_optimizer or delayed,
        delay_optimizer_step=delayed,
        delay_grad_averaging=delayed,
        average_state_every=settings.average_state_every,
        use_local_updates=local,
        client_mode=assignment.client_mode,
        grad_compression=CountingCompression(
            make_compression(settings.grad_compression, gradients=True), counter
        ),
        state_averaging_compression=CountingCompression(
            make_compression(settings.state_compression, gradients=False), counter
        ),
        load_state_compression=make_compression(settings.state_compression, gradients=False),
        # a peer that sees nobody yet looks again every second: a run's peers starting together find each
        # other before either has trained far on its own (also compat.FIRST_EPOCH_REFRESH_PERIOD)
        tracker_opts={"min_refresh_period": 1.0, "max_refresh_period": 10.0, "default_refresh_period": 1.0},
        averager_opts={"request_timeout": averaging_request_timeout(first_matchmaking)},
        shutdown_timeout=5,
        verbose=False,
    )
    if settings.early_epochs:
        kwargs["epoch_settings"] = lambda epoch: (
            settings.epoch_target_batch_size(epoch),
            settings.epoch_matchmaking_time(epoch),
            averaging_request_timeout(settings.epoch_matchmaking_time(epoch)),
        )
    if settings.update_mode == "diloco":
        optimizer: hivemind.Optimizer = compat.OuterStepOptimizer(
            outer_lr=settings.outer_lr, outer_momentum=settings.outer_momentum, **kwargs
        )
    else:
        optimizer = compat.GuardedOptimizer(**kwargs)
    compat.throttle_progress_reports(optimizer.tracker, min_interval=report_interval)
    return optimizer


def averaging_request_timeout(matchmaking_time: float) -> float:
    """Seconds an averager waits for a potential leader's answer: under the matchmaking time, which hivemind
    warns can deadlock matchmaking otherwise."""
    return min(1.0, matchmaking_time / 2)


def revocations_key(run_id: str) -> str:
    return f"{run_id}_revoked"


def refresh_revocations(dht: hivemind.DHT, *, run_id: str, run_name: str, keys: VerifyingKeys) -> set[str]:
    """Read the coordinator's signed revocation records from the DHT and hand them to the authorizer."""
    found = dht.get(revocations_key(run_id), latest=False)
    revoked: set[str] = set()
    if found is not None and isinstance(found.value, dict):
        for item in found.value.values():
            try:
                revoked.add(verify_revocation(getattr(item, "value", None), keys, run=run_name))
            except TokenError as exc:
                logger.debug("ignoring a revocation record: %s", exc.detail)
    if revoked:
        push_revocations(dht, revoked)
    return revoked


def make_authorizer(*, run: str, keys: VerifyingKeys, token: str, private_key: Any) -> PeerTokenAuthorizer:
    return PeerTokenAuthorizer(
        run=run, coordinator_keys=keys, peer_token=PeerToken.decode(token), local_private_key=private_key
    )

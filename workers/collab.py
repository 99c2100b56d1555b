"""The hivemind parts of a worker: the run's DHT, the collaborative optimizer, and their instruments.

Choices that matter for speed on small CPU peers (measured with ``tests/perf/bench_swarm_efficiency.py``):

* **Progress reports are throttled.** hivemind 1.1.12 stores a signed progress record in the DHT on
  every ``Optimizer.step`` (``ProgressTracker.report_local_progress`` has no throttle); each store costs
  the DHT process and p2pd CPU that the training loop needs. :func:`throttle_progress_reports` lets a
  report through at most every ``min_interval`` seconds, and always when the epoch or the sample
  count drops; peers extrapolate between reports from the reported throughput, as hivemind intends.
* **One optimizer step call per ~64 samples** (the assignment's ``accumulation_steps``), not per
  micro-batch: fewer DHT writes and fewer checks of the swarm's progress.
* **Gradient averaging runs in the background** (``delay_optimizer_step`` + ``delay_grad_averaging``)
  unless the run asks for local updates: the peer keeps computing the next gradients while the
  all-reduce and the optimizer step of the previous epoch finish, at the cost of one step of staleness.
* **Relays, AutoNAT and UPnP are off** when the worker listens on loopback or a public address: they only
  add background traffic. Peers behind NAT run in client mode instead (the coordinator decides).
* **State averaging every few epochs**, and the tracker refreshes global progress less eagerly.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
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
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.proto import runtime_pb2

from volunteer_app.protocol import Compression, OptimizerSettings, PeerAssignment
from volunteer_app.tokens import PeerToken, TokenError, VerifyingKeys, verify_revocation
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
    """Count incoming all-reduce parts too (hivemind decodes them with ``deserialize_torch_tensor``)."""
    import hivemind.averaging.allreduce as allreduce

    original = getattr(allreduce, "_va_original_deserialize", allreduce.deserialize_torch_tensor)

    def counting_deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
        counter.add_received(len(serialized.buffer))
        return original(serialized)

    allreduce._va_original_deserialize = original
    allreduce.deserialize_torch_tensor = counting_deserialize


def make_compression(name: Compression, *, gradients: bool) -> CompressionBase:
    """``none``, ``fp16`` (scaled fp16 for gradients, plain fp16 for parameters) or ``8bit`` (uniform)."""
    if name == "fp16":
        return ScaledFloat16Compression() if gradients else Float16Compression()
    if name == "8bit":
        return Uniform8BitQuantization()
    return NoCompression()


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


def throttle_progress_reports(tracker: ProgressTracker, *, min_interval: float) -> None:
    """Let at most one progress record per ``min_interval`` seconds reach the DHT (see module docs).

    The latest progress is always published within ``min_interval``; a new epoch or a reset sample
    count is published at once, so peers never wait on a stale record at an epoch boundary.
    """
    old_event = tracker.should_report_progress
    event = _ThrottledEvent(min_interval, bypass=tracker.shutdown_triggered.is_set)
    original = tracker.report_local_progress
    state = {"epoch": -1, "samples": 0}

    def report(local_epoch: int, samples_accumulated: int, update_global_samples: bool = True) -> None:
        if local_epoch != state["epoch"] or samples_accumulated < state["samples"]:
            event.urgent = True
        state["epoch"], state["samples"] = local_epoch, samples_accumulated
        original(local_epoch, samples_accumulated, update_global_samples)

    tracker.should_report_progress = event
    tracker.report_local_progress = report
    old_event.set()  # wake the reporter thread so that it starts waiting on the throttled event


def listen_maddrs(host: str) -> list[str]:
    return [f"/ip6/{host}/tcp/0" if ":" in host else f"/ip4/{host}/tcp/0"]


def build_dht(
    *,
    initial_peers: list[str],
    authorizer: PeerTokenAuthorizer,
    host: str,
    announce_host: str | None,
    client_mode: bool,
) -> hivemind.DHT:
    """Join the run's DHT through the coordinator's swarm peer (and any other initial peers)."""
    quiet = host.startswith("127.") or host == "::1" or announce_host is not None
    kwargs: dict[str, Any] = {}
    if quiet or client_mode:
        kwargs.update(use_relay=False, auto_nat=False, nat_port_map=False)
    if announce_host:
        kwargs["announce_maddrs"] = listen_maddrs(announce_host)
    return hivemind.DHT(
        initial_peers=initial_peers,
        start=True,
        host_maddrs=listen_maddrs(host),
        client_mode=client_mode,
        authorizer=authorizer,
        **kwargs,
    )


def build_optimizer(
    *,
    dht: hivemind.DHT,
    run_id: str,
    params: Iterable[torch.nn.Parameter],
    optimizer_factory: Callable[[Any], torch.optim.Optimizer],
    settings: OptimizerSettings,
    assignment: PeerAssignment,
    micro_batch_size: int,
    counter: ByteCounter,
    report_interval: float = 5.0,
) -> hivemind.Optimizer:
    """The collaborative optimizer for this peer, with the run's settings and this peer's assignment."""
    delayed = not settings.use_local_updates and (
        assignment.delay_optimizer_step or assignment.device == "cpu"
    )
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=settings.target_batch_size,
        batch_size_per_step=micro_batch_size * assignment.accumulation_steps,
        optimizer=optimizer_factory,
        params=params,
        matchmaking_time=settings.matchmaking_time,
        averaging_timeout=settings.averaging_timeout,
        offload_optimizer=assignment.offload_optimizer or delayed,
        delay_optimizer_step=delayed,
        delay_grad_averaging=delayed,
        average_state_every=settings.average_state_every,
        use_local_updates=settings.use_local_updates,
        client_mode=assignment.client_mode,
        grad_compression=CountingCompression(
            make_compression(settings.grad_compression, gradients=True), counter
        ),
        state_averaging_compression=CountingCompression(
            make_compression(settings.state_compression, gradients=False), counter
        ),
        load_state_compression=make_compression(settings.state_compression, gradients=False),
        tracker_opts={"min_refresh_period": 1.0, "max_refresh_period": 10.0, "default_refresh_period": 3.0},
        # hivemind warns that request_timeout >= matchmaking_time can deadlock matchmaking
        averager_opts={"request_timeout": min(1.0, settings.matchmaking_time / 2)},
        shutdown_timeout=5,
        verbose=False,
    )
    throttle_progress_reports(optimizer.tracker, min_interval=report_interval)
    return optimizer


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

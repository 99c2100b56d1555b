"""Proof-of-training spot checks: the swarm peer's side (the coordinator's side, which samples and judges, is
:mod:`coordinator.credit.spotchecks`).

:class:`SpotChecker` runs in a thread of the run's swarm peer process: it claims the leases
``coordinator.credit.spotchecks`` sampled, recomputes the loss of each peer's shard on the shared model
(:func:`shard_loss`) and records the verdict. torch is imported only inside the functions that use it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from coordinator.credit import spotchecks
from coordinator.errors import Conflict, NotFound
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.states import SpotCheckState

logger = logging.getLogger("coordinator.swarm")

# Spot checks: how much of the shared model's time one check may take.
CHECK_MICRO_BATCHES = 4
"""Micro-batches of the peer's shard (in the peer's own order) whose loss a check recomputes."""
CHECK_MAX_SAMPLES = 64
"""At most this many samples per recomputed loss, whatever the peer's micro-batch size."""
MIN_CHECK_INTERVAL = 2.0
_DEFAULT_CHECK_INTERVAL = 5.0
STATE_REFRESH_INTERVAL = 30.0
"""At most one download of the swarm's state per this many seconds on behalf of spot checks."""


def shard_loss(
    runtime: Any,
    model: Any,
    *,
    shard: int,
    seed: int,
    micro_batch_size: int,
    micro_batches: int = CHECK_MICRO_BATCHES,
    max_samples: int = CHECK_MAX_SAMPLES,
) -> float:
    """The mean loss of ``model`` over the first ``micro_batches`` micro-batches of ``shard`` as the peer
    saw them (shuffled by ``seed``, ``micro_batch_size`` samples each), at most ``max_samples`` samples,
    weighted by samples. Eval mode, no gradients, on the CPU."""
    import torch

    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            batches = runtime.shard_batches(
                shard, batch_size=max(1, micro_batch_size), seed=seed, device="cpu"
            )
            for index, batch in enumerate(batches):
                if index >= micro_batches or count >= max_samples:
                    break
                room = max_samples - count
                if runtime.batch_size_of(batch) > room and isinstance(batch, torch.Tensor):
                    batch = batch[:room]
                n = runtime.batch_size_of(batch)
                total += float(runtime.loss(model, batch)) * n
                count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


class SpotChecker:
    """Runs the proof-of-training spot checks of one run, in a background thread of the swarm peer.

    Every ``interval`` seconds it claims at most one pending check (``spotchecks.claim_pending``) and
    recomputes, on the shared model (``state``: the swarm peer's
    :class:`~coordinator.swarm.checkpointer.Checkpointer`, the state every joining peer downloads), three losses of :data:`CHECK_MICRO_BATCHES` micro-batches
    (at most :data:`CHECK_MAX_SAMPLES` samples) each: the peer's shard in the peer's own order, control data
    of the same distribution that no lease hands out (shard ``num_shards + shard``), and the peer's shard
    on an untrained model. ``spotchecks.judge_loss`` turns them into a verdict, ``record_verdict`` records it.

    The one-sided judgement needs a shared model at least as trained as the peer's was, so it judges only
    with a model *past* the swarm epoch the peer reported when it completed the lease (in ``local`` and
    ``diloco`` modes peers drift apart within an epoch; the next epoch's state holds the averaged work of
    every peer of the last round). When the model is not past it, the checker downloads the swarm's state
    first (at most once per :data:`STATE_REFRESH_INTERVAL`); if it is still not past it, the check waits
    (it is offered again after a tenth of ``spot_check_timeout``, and expires, settling the credit as it
    stands, after all of it). An untrained model (nothing downloaded, no checkpoint) is at epoch 0 and
    so never judges, and neither does a shared model that scores no better on the shard than an untrained
    one (a state served by a hostile peer, a diverged swarm): that check waits too.

    CPU: one thread (the checkpointer set ``torch.set_num_threads(1)``), 3 x 64 samples forward-only per
    check, one check per ``interval``. The shared model is held under ``state_lock`` only while a check
    reads it; the swarm peer's checkpoints skip a poll rather than wait for it.

    :param clock: unix time (tests move it).
    """

    def __init__(
        self,
        *,
        store: Store,
        settings: CoordinatorSettings,
        run_id: str,
        state: Any,
        state_lock: threading.Lock,
        interval: float = _DEFAULT_CHECK_INTERVAL,
        clock: Any = time.time,
    ):
        self.store = store
        self.settings = settings
        self.run_id = run_id
        self.state = state
        self.state_lock = state_lock
        self.interval = interval
        self.clock = clock
        self.num_shards = max(1, int(state.spec.num_shards(state.config)))
        self._untrained: Any = None
        self._refreshed_at = float("-inf")
        self._refreshed_once = False
        self.decided = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spot-checks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception:
                logger.exception("spot check failed; retrying")

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def untrained_model(self) -> Any:
        if self._untrained is None:
            self._untrained = self.state.runtime.build_model()
        return self._untrained

    def _refresh(self) -> None:
        """Download the swarm's current state into the shared model (rate-limited)."""
        now = time.monotonic()
        if now - self._refreshed_at < STATE_REFRESH_INTERVAL:
            return
        self._refreshed_at = now
        try:
            self.state.averager.load_state_from_peers(timeout=30)
        except Exception as exc:
            logger.warning("spot checks: could not download the swarm's state: %s", exc)
        self._refreshed_once = True

    def check_once(self) -> str | None:
        """Claim and decide one pending check. Returns its verdict (``passed``/``failed``), ``deferred`` when
        the shared model is behind the peer's epoch, or None when there was nothing to check."""
        with self.store.write() as db:
            claimed = spotchecks.claim_pending(
                db, run_id=self.run_id, now=self.clock(), settings=self.settings, limit=1
            )
        if not claimed:
            return None
        check = claimed[0]
        runtime = self.state.runtime
        with self.state_lock:
            wanted = check.model_epoch or 0
            if self.state.epoch <= wanted or not self._refreshed_once:
                self._refresh()
            epoch = self.state.epoch
            if epoch <= wanted:
                logger.info(
                    "spot check %s waits: the shared model is at epoch %d, not past the peer's %d",
                    check.check_id, epoch, wanted,
                )  # fmt: skip
                return "deferred"
            args = dict(seed=check.seed, micro_batch_size=check.micro_batch_size)
            recomputed = shard_loss(runtime, self.state.model, shard=check.shard, **args)
            control = shard_loss(runtime, self.state.model, shard=self.num_shards + check.shard, **args)
        untrained = shard_loss(runtime, self.untrained_model(), shard=check.shard, **args)
        if not recomputed < untrained:
            # a shared model no better than an untrained one (a state served by a hostile peer, a diverged
            # swarm) is no yardstick: judging with it would fail honest peers
            logger.warning(
                "spot check %s waits: the shared model (epoch %d) scores %.4f on the shard, an untrained one %.4f",
                check.check_id, epoch, recomputed, untrained,
            )  # fmt: skip
            return "deferred"
        passed, detail = spotchecks.judge_loss(
            check.reported_loss, recomputed, control=control, untrained=untrained
        )
        detail = f"{detail} (shared model at epoch {epoch}, the peer's at {wanted})"
        try:
            with self.store.write() as db:
                spotchecks.record_verdict(
                    db,
                    check_id=check.check_id,
                    passed=passed,
                    detail=detail,
                    now=self.clock(),
                    recomputed_loss=recomputed,
                )
        except (Conflict, NotFound) as exc:  # decided or removed meanwhile (another checker, an expiry)
            logger.info("spot check %s: %s", check.check_id, exc)
            return None
        self.decided += 1
        verdict = SpotCheckState.PASSED if passed else SpotCheckState.FAILED
        log = logger.info if passed else logger.warning
        log("spot check of lease %s (shard %d) %s: %s", check.lease_id, check.shard, verdict, detail)
        return verdict

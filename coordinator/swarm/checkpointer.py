"""The checkpointer: the torch half of :mod:`coordinator.checkpoints`, run inside each run's swarm peer
process (:mod:`coordinator.swarm.peer`, the only coordinator process that imports torch, and only inside
functions).

:class:`Checkpointer` holds a hivemind ``TrainingStateAverager`` with the task's model and optimizer on the
run's state-averaging key, downloads the state of up to :data:`CONSENSUS_PEERS` volunteers every ``interval``
seconds, checks each (as a late-joining peer checks what it downloads), averages the parameters of those at
the epoch most of them hold (the optimizer's statistics are the first one's), evaluates the mean and writes
it. Between two averaging rounds every peer's model has drifted from the swarm's by its own steps; the mean
is close to what the next round gives. It also *serves* the latest checkpoint's state with its epoch as
priority, so a volunteer who joins an empty swarm resumes from it, while one who joins a live swarm still
prefers the fresher state of its peers. It never joins an averaging round.

:func:`save_checkpoint` evaluates a model and writes it through a
:class:`~coordinator.checkpoints.CheckpointStore`; :func:`load_checkpoint_into` and :func:`load_model_file`
read one back into a model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.checkpoints import (
    DEFAULT_KEEP,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAMPLES_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
)

if TYPE_CHECKING:
    from workers.optim import SamplesPerEpoch

logger = logging.getLogger("coordinator.checkpoints")

CONSENSUS_PEERS = 4
"""Peers whose parameters a checkpoint averages (fewer when fewer answer, or fewer are at the epoch most of
them hold). In ``tests/perf/bench_learning_swarm.py`` the mean of two real peers' models beat one peer's own
at 21 of 23 points from 40k samples on (+3.1 points of prompt accuracy on average, a lower held-out loss at
all 23); each save downloads one model's state per peer asked."""


def model_tensors(model: Any) -> dict[str, Any]:
    """The model's state as contiguous CPU tensors by name (what ``model.safetensors`` holds)."""
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}


def load_model_file(model: Any, path: Path) -> None:
    """Load ``model.safetensors`` into ``model`` (every tensor must be there, with its shape).

    :raises CheckpointError: for a file that does not fit the model.
    """
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        model.load_state_dict(tensors, strict=True)
    except (RuntimeError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} does not fit the run's model: {exc}") from exc


def build_model_for(manifest: dict[str, Any]) -> tuple[Any, Any]:
    """The task runtime and an untrained model for a checkpoint's task and config."""
    from workers.tasks import load_task

    spec = load_task(str(manifest["task"]))
    runtime = spec.build_runtime(spec.make_config(manifest.get("task_config") or {}))
    return runtime, runtime.build_model()


def samples_grid_png(samples: list[Any], *, scale: int = 4) -> bytes | None:
    """A PNG of the drawn answers (``EvalSample``s with images), 4 per row; None when none has an image."""
    from volunteer_app.pictures import Picture, grid, png_bytes

    pictures = [Picture(s.image.width, s.image.height, s.image.rgb()) for s in samples if s.image is not None]
    if not pictures:
        return None
    return png_bytes(grid(pictures, columns=4, pad=1, background=(90, 90, 90)), scale=scale)


def save_checkpoint(
    store: CheckpointStore,
    *,
    runtime: Any,
    model: Any,
    optimizer: Any,
    epoch: int,
    run: str,
    task: str,
    task_config: dict[str, Any],
    metric: str,
    samples: int,
    averaged_peers: int | None = None,
    peer_spread: float | None = None,
) -> CheckpointInfo:
    """Evaluate ``model`` (the task's metrics and its showcase drawings) and write it with ``optimizer``'s
    state as the checkpoint of ``epoch``; older checkpoints beyond the store's ``keep`` are removed.
    ``averaged_peers``: how many peers' parameters the model is the mean of, when it came from the swarm, and
    ``peer_spread`` how far they lay from their mean (relative to its norm)."""
    from safetensors.torch import save

    from workers import compat
    from workers.evaluation import evaluate

    started = time.monotonic()
    metrics: dict[str, float] = {}
    drawn: list[Any] = []
    try:
        event = evaluate(runtime, model, epoch=epoch)
        metrics, drawn = event.metrics, event.samples
    except Exception as exc:  # a checkpoint without metrics still keeps the model
        logger.warning("evaluating the checkpoint of epoch %d failed: %s", epoch, exc)
    metadata, tensors = compat.dump_optimizer_state(optimizer)
    files = {
        MODEL_FILE: save(model_tensors(model)),
        OPTIMIZER_FILE: save({f"t{i}": t.detach().to("cpu").contiguous() for i, t in enumerate(tensors)}),
    }
    grid = samples_grid_png(drawn)
    if grid is not None:
        files[SAMPLES_FILE] = grid
    manifest = {
        "run": run,
        "task": task,
        "task_config": task_config,
        "samples": samples,
        "saved_at": time.time(),
        "metric": metric,
        "metrics": metrics,
        # each answer with its drawing (a few KB): what the demo and the dashboard show without torch
        "prompts": [s.model_dump(mode="json") for s in drawn],
        "optimizer": metadata,
        "evaluation_seconds": round(time.monotonic() - started, 2),
    }
    if averaged_peers is not None:
        manifest["averaged_peers"] = averaged_peers
    if peer_spread is not None:
        manifest["peer_spread"] = round(peer_spread, 6)
    info = store.write(epoch=epoch, files=files, manifest=manifest)
    store.prune()
    shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    logger.info("checkpoint of epoch %d written to %s (%s)", epoch, info.path, shown or "no metrics")
    return info


def load_checkpoint_into(info: CheckpointInfo, *, model: Any, optimizer: Any | None = None) -> None:
    """Load a verified checkpoint's model (and optimizer state, when given) in place.

    :raises CheckpointError: for files that do not fit the model or the optimizer.
    """
    import torch
    from safetensors.torch import load_file

    from workers import compat

    load_model_file(model, info.path / MODEL_FILE)
    metadata = info.manifest.get("optimizer")
    if optimizer is None or metadata is None or OPTIMIZER_FILE not in info.manifest["files"]:
        return
    try:
        tensors = load_file(str(info.path / OPTIMIZER_FILE))
        flat = [tensors[f"t{i}"] for i in range(len(tensors))]
        with torch.no_grad():
            compat.load_optimizer_state(optimizer, metadata, flat)
    except (KeyError, ValueError, OSError) as exc:
        raise CheckpointError(
            f"{info.path / OPTIMIZER_FILE} does not fit the run's optimizer: {exc}"
        ) from exc


class Checkpointer:
    """Keeps, evaluates and serves the latest state of one run.

    :param dht: the swarm peer's DHT (already joined to the run's swarm).
    :param hivemind_run_id: the run's hivemind ``run_id`` (state averaging uses ``<run_id>_state_averager``).
    :param run: the run's name; :param task: its task; :param task_config: its validated config.
    :param directory: where checkpoints are written.
    :param interval: seconds between downloads of the swarm's state.
    :param samples_per_epoch: the run's target batch size, or its epochs' sizes as a function
        (``OptimizerSettings.samples_at_epoch``): the schedule, and the samples a checkpoint reports.
    :param keep: checkpoints kept.
    :param consensus_peers: how many peers' states each download averages
        (:attr:`workers.compat.GuardedStateAverager.consensus_peers`): a checkpoint is the swarm's consensus,
        not one peer's model caught between two rounds.
    """

    def __init__(
        self,
        *,
        dht: Any,
        hivemind_run_id: str,
        task: str,
        task_config: dict[str, Any],
        directory: Path,
        interval: float,
        matchmaking_time: float,
        run: str = "",
        samples_per_epoch: SamplesPerEpoch = 0,
        keep: int = DEFAULT_KEEP,
        consensus_peers: int = CONSENSUS_PEERS,
    ):
        import torch

        from workers import compat
        from workers.optim import optimizer_parts, samples_at_epoch
        from workers.robust import loss_probe
        from workers.tasks import load_task

        torch.set_num_threads(1)
        spec = load_task(task)
        config = spec.make_config(task_config)
        self.spec, self.config = spec, config
        self.runtime = spec.build_runtime(config)
        self.model = self.runtime.build_model()
        self.run, self.task, self.task_config = run, task, spec.config_to_dict(config)
        # a run whose epoch size is unknown (0) reports no samples rather than made-up ones
        self.samples_at_epoch = samples_at_epoch(samples_per_epoch) if samples_per_epoch else lambda _: 0.0
        # The same parameter groups, optimizer and schedule as every worker: hivemind matches tensors by
        # position and packs the optimizer state it downloads into this optimizer's structure.
        groups, optimizer_factory, scheduler_factory = optimizer_parts(
            self.runtime, self.model, config, samples_per_epoch=samples_per_epoch
        )
        self.store = CheckpointStore(directory, keep=keep)
        self.directory = directory
        self.interval = interval
        # refuses a downloaded state with NaN or infinity: the checkpoints and spot checks keep the last good one
        self.averager = compat.GuardedStateAverager(
            dht=dht,
            optimizer=optimizer_factory,
            params=groups,
            scheduler=scheduler_factory,
            prefix=f"{hivemind_run_id}_state_averager",
            min_matchmaking_time=matchmaking_time,
            start=True,
        )
        # ... and one whose parameters do far worse on a fixed batch than the model it would replace
        self.averager.state_probe = loss_probe(self.runtime, self.model)
        self.averager.consensus_peers = consensus_peers
        self.next_save = time.monotonic() + interval
        self.saved_epoch: int | None = None
        self.restore()

    @property
    def epoch(self) -> int:
        return int(self.averager.local_epoch)

    def restore(self) -> CheckpointInfo | None:
        """Load the newest intact checkpoint (damaged ones are set aside as ``*.corrupt``) and offer it to
        joining peers. Returns what was loaded."""
        for info in self.store.checkpoints():
            if not info.valid:
                moved = self.store.quarantine(info)
                logger.error("checkpoint damaged, not loaded (%s); moved to %s", info.problem, moved)
                continue
            try:
                self._load(info)
            except (CheckpointError, ValueError, RuntimeError, OSError) as exc:
                moved = self.store.quarantine(info)
                logger.error("checkpoint %s could not be loaded (%s); moved to %s", info.path, exc, moved)
                continue
            self.saved_epoch = self.epoch
            self.averager.state_sharing_priority = self.epoch
            logger.info("restored the checkpoint of epoch %d from %s", self.epoch, info.path)
            return info
        self.averager.state_sharing_priority = 0
        return None

    def _load(self, info: CheckpointInfo) -> None:
        load_checkpoint_into(info, model=self.model, optimizer=self.averager.optimizer)
        self.averager.local_epoch = int(info.epoch)

    def maybe_save(self) -> bool:
        """Download the swarm's state and write it if it is newer than the last checkpoint."""
        if time.monotonic() < self.next_save:
            return False
        self.next_save = time.monotonic() + self.interval
        try:
            self.averager.load_state_from_peers(timeout=60)
        except Exception as exc:
            logger.warning("could not download the swarm's state for a checkpoint: %s", exc)
            return False
        if self.saved_epoch is not None and self.epoch <= self.saved_epoch:
            return False
        self.save()
        return True

    def save(self) -> CheckpointInfo:
        """Evaluate the current state and write it as a checkpoint (then prune old ones)."""
        info = save_checkpoint(
            self.store,
            runtime=self.runtime,
            model=self.model,
            optimizer=self.averager.optimizer,
            epoch=self.epoch,
            run=self.run,
            task=self.task,
            task_config=self.task_config,
            metric=self.spec.metric,
            samples=round(self.samples_at_epoch(self.epoch)),
            # of the state downloaded last (none after a restore: then no peer's state is in the model)
            averaged_peers=self.averager.last_download_peers or None,
            peer_spread=self.averager.last_download_spread,
        )
        self.saved_epoch = info.epoch
        self.averager.state_sharing_priority = info.epoch
        return info

    def shutdown(self) -> None:
        self.averager.shutdown()

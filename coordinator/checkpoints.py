"""Checkpoints: the coordinator keeps each run's latest model, so that a swarm that empties loses nothing.

Runs inside the run's swarm peer process (``coordinator.swarm``), the only coordinator process that may
import torch. A :class:`Checkpointer` holds a hivemind ``TrainingStateAverager`` with the task's model
and optimizer on the run's state-averaging key. Every ``interval`` seconds it downloads the newest state
from the volunteers (exactly what a late-joining peer downloads) and writes it to
``DATA_DIR/checkpoints/<run>/latest.pt`` atomically. It also *serves* that state: it declares it for
state sharing with its epoch as priority, so a volunteer who joins an empty swarm resumes from the
checkpoint, while one who joins a live swarm still prefers the fresher state of its peers. It never
joins an averaging round, so the coordinator stays out of the training itself.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("coordinator.checkpoints")


class Checkpointer:
    """Keeps and serves the latest state of one run.

    :param dht: the swarm peer's DHT (already joined to the run's swarm).
    :param hivemind_run_id: the run's hivemind ``run_id`` (state averaging uses ``<run_id>_state_averager``).
    :param task: the run's task name; :param task_config: its validated config.
    :param directory: where checkpoints are written.
    :param interval: seconds between downloads of the swarm's state.
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
    ):
        import torch
        from hivemind.optim.state_averager import TrainingStateAverager

        from workers.tasks import load_task

        torch.set_num_threads(1)
        spec = load_task(task)
        config = spec.make_config(task_config)
        runtime = spec.build_runtime(config)
        self.model = runtime.build_model()
        make_optimizer = getattr(runtime, "make_optimizer", None)

        def optimizer_factory(params: Any) -> Any:
            if make_optimizer is not None:
                return make_optimizer(params)
            return torch.optim.AdamW(params, lr=getattr(config, "lr", 1e-3))

        self.directory = directory
        self.interval = interval
        self.path = directory / "latest.pt"
        self.averager = TrainingStateAverager(
            dht=dht,
            optimizer=optimizer_factory,
            params=self.model.parameters(),
            prefix=f"{hivemind_run_id}_state_averager",
            min_matchmaking_time=matchmaking_time,
            start=True,
        )
        self.next_save = time.monotonic() + interval
        self.saved_epoch: int | None = None
        self.restore()

    @property
    def epoch(self) -> int:
        return int(self.averager.local_epoch)

    def restore(self) -> bool:
        """Load ``latest.pt`` (if any) and offer it to joining peers."""
        import torch

        if not self.path.exists():
            self.averager.state_sharing_priority = 0
            return False
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
            with torch.no_grad():
                for param, saved in zip(self.averager.main_parameters, state["parameters"], strict=True):
                    param.copy_(saved)
            self.averager.optimizer.load_state_dict(state["optimizer"])
            self.averager.local_epoch = int(state["epoch"])
        except Exception as exc:  # a damaged checkpoint is kept for inspection, never silently used
            damaged = self.path.with_suffix(".damaged")
            os.replace(self.path, damaged)
            logger.error("checkpoint %s could not be loaded (%s); moved to %s", self.path, exc, damaged)
            return False
        self.saved_epoch = self.epoch
        self.averager.state_sharing_priority = self.epoch
        logger.info("restored checkpoint at epoch %d from %s", self.epoch, self.path)
        return True

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

    def save(self) -> None:
        import torch

        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        state = {
            "epoch": self.epoch,
            "parameters": [p.detach().clone() for p in self.averager.main_parameters],
            "optimizer": self.averager.optimizer.state_dict(),
            "saved_at": time.time(),
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.saved_epoch = self.epoch
        self.averager.state_sharing_priority = self.epoch
        logger.info("checkpoint at epoch %d written to %s", self.epoch, self.path)

    def shutdown(self) -> None:
        self.averager.shutdown()

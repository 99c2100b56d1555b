"""Checkpoints: the coordinator keeps each run's model, evaluated, so that a swarm that empties loses nothing
and anyone can see what the model learned.

A checkpoint is a directory ``DATA_DIR/checkpoints/<run>/epoch-00000042/`` holding

* ``model.safetensors``: the model's parameters by name (``model.state_dict()``);
* ``optimizer.safetensors``: the optimizer's tensors (Adam's moments), whose structure is in the manifest;
* ``samples.png``: the model's drawings of the task's fixed showcase prompts (image tasks);
* ``manifest.json``: format, run, task and task config, epoch, samples (epoch x target batch), the
  task's metrics when it was saved, each showcase prompt's answer, how many peers' parameters were
  averaged (``averaged_peers``) and how far apart they were (``peer_spread``), and the SHA-256 and size
  of every other file. It is written last.

Writing is atomic: every file goes into a hidden temporary directory, is fsynced, the manifest follows,
and one ``rename`` makes the checkpoint appear complete (then the parent directory is fsynced). The last
``keep`` checkpoints are kept. Reading verifies every checksum: a damaged or partial checkpoint is
skipped, never loaded; the swarm peer renames one it finds to ``*.corrupt`` and resumes from the one
before.

:class:`CheckpointStore` (this module's torch-free half) lists, verifies, reads and writes checkpoints;
the web process uses it to serve the gallery. :class:`Checkpointer` runs inside the run's swarm peer
process (``coordinator.swarm``, the only coordinator process that imports torch): it holds a hivemind
``TrainingStateAverager`` with the task's model and optimizer on the run's state-averaging key, downloads
the state of up to :data:`CONSENSUS_PEERS` volunteers every ``interval`` seconds, checks each (as a
late-joining peer checks what it downloads), averages the parameters of those at the epoch most of them
hold (the optimizer's statistics are the first one's), evaluates the mean and writes it. Between two
averaging rounds every peer's model has drifted from the swarm's by its own steps; the mean is close to
what the next round gives. It also *serves* the latest checkpoint's state with its epoch as priority, so
a volunteer who joins an empty swarm resumes from it, while one who joins a live swarm still prefers the
fresher state of its peers. It never joins an averaging round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.optim import SamplesPerEpoch

logger = logging.getLogger("coordinator.checkpoints")

FORMAT = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
PUBLISHED_MARKER = "published"
"""An empty file in a checkpoint's directory: an organizer published it, so pruning keeps it."""
OPTIMIZER_FILE = "optimizer.safetensors"
SAMPLES_FILE = "samples.png"
DEFAULT_KEEP = 5
"""Checkpoints kept per run (older ones are deleted after each save)."""
CONSENSUS_PEERS = 4
"""Peers whose parameters a checkpoint averages (fewer when fewer answer, or fewer are at the epoch most of
them hold). In ``tests/perf/bench_learning_swarm.py`` the mean of two real peers' models beat one peer's own
at 21 of 23 points from 40k samples on (+3.1 points of prompt accuracy on average, a lower held-out loss at
all 23); each save downloads one model's state per peer asked."""
_NAME = re.compile(r"^epoch-(\d{8})$")


def checkpoint_directory(data_dir: Path, run: str) -> Path:
    """Where a run's checkpoints live."""
    return data_dir / "checkpoints" / run


def generate_endpoint_file(data_dir: Path, run: str) -> Path:
    """Where a run's swarm peer publishes the loopback port and secret of its ``generate`` service."""
    return data_dir / "swarm" / f"{run}.generate.json"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or damaged; ``detail`` says what and where."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclass
class CheckpointInfo:
    """One checkpoint as found on disk: its directory, epoch, manifest and whether its checksums hold."""

    path: Path
    epoch: int
    manifest: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def valid(self) -> bool:
        return self.problem is None

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.manifest.get("metrics") or {})

    @property
    def samples_png(self) -> Path | None:
        path = self.path / SAMPLES_FILE
        return path if SAMPLES_FILE in (self.manifest.get("files") or {}) else None

    def summary(self) -> dict[str, Any]:
        """What the gallery and ``checkpoints list --json`` show."""
        m = self.manifest
        return {
            "epoch": self.epoch,
            "samples": m.get("samples"),
            "saved_at": m.get("saved_at"),
            "metric": m.get("metric"),
            "metrics": self.metrics,
            "prompts": [
                {k: v for k, v in p.items() if k != "image"}
                for p in m.get("prompts") or []
                if isinstance(p, dict)
            ],
            "has_samples_png": self.samples_png is not None,
            "bytes": sum(int(f.get("bytes", 0)) for f in (m.get("files") or {}).values()),
            "valid": self.valid,
            "problem": self.problem,
        }


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointStore:
    """The checkpoints of one run in ``directory`` (torch-free).

    :param directory: ``DATA_DIR/checkpoints/<run>``.
    :param keep: how many checkpoints :meth:`prune` keeps.
    """

    def __init__(self, directory: Path, *, keep: int = DEFAULT_KEEP):
        self.directory = directory
        self.keep = max(1, keep)
        self._verified: dict[Path, tuple[Any, ...]] = {}

    def _candidates(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def path_for(self, epoch: int) -> Path:
        return self.directory / f"epoch-{epoch:08d}"

    def _fingerprint(self, path: Path, files: dict[str, Any]) -> tuple[Any, ...]:
        stats = []
        for name in [MANIFEST, *sorted(files)]:
            st = (path / name).stat()
            stats.append((name, st.st_size, st.st_mtime_ns))
        return tuple(stats)

    def read(self, path: Path, *, verify: bool = True) -> CheckpointInfo:
        """The checkpoint in ``path``; ``problem`` says what is wrong with it, if anything."""
        match = _NAME.match(path.name)
        epoch = int(match.group(1)) if match else -1
        info = CheckpointInfo(path=path, epoch=epoch)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise CheckpointError(f"{path / MANIFEST}: not a format-{FORMAT} checkpoint manifest")
            info.manifest = manifest
            if manifest.get("epoch") != epoch:
                raise CheckpointError(f"{path}: the manifest says epoch {manifest.get('epoch')}")
            files = manifest.get("files")
            if not isinstance(files, dict) or MODEL_FILE not in files:
                raise CheckpointError(f"{path / MANIFEST}: lists no {MODEL_FILE}")
            if verify:
                fingerprint = self._fingerprint(path, files)
                if self._verified.get(path) != fingerprint:
                    for name, meta in files.items():
                        if "/" in name or name.startswith("."):
                            raise CheckpointError(f"{path / MANIFEST}: bad file name {name!r}")
                        actual = sha256_of(path / name)
                        if actual != meta.get("sha256"):
                            raise CheckpointError(f"{path / name}: checksum mismatch (damaged or incomplete)")
                    self._verified[path] = fingerprint
        except FileNotFoundError as exc:
            info.problem = f"{exc.filename}: missing"
        except (OSError, ValueError) as exc:
            info.problem = f"{path}: unreadable ({exc})"
        except CheckpointError as exc:
            info.problem = exc.detail
        return info

    def checkpoints(self, *, verify: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint, newest first, damaged ones included (with their ``problem``)."""
        return [self.read(path, verify=verify) for _, path in self._candidates()]

    def valid(self) -> list[CheckpointInfo]:
        return [info for info in self.checkpoints() if info.valid]

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint whose checksums hold (damaged ones are skipped)."""
        for _, path in self._candidates():
            info = self.read(path)
            if info.valid:
                return info
            logger.warning("skipping damaged checkpoint: %s", info.problem)
        return None

    def find(self, epoch: int) -> CheckpointInfo:
        """The checkpoint of ``epoch``, verified.

        :raises CheckpointError: when there is none or it is damaged.
        """
        path = self.path_for(epoch)
        if not path.is_dir():
            known = ", ".join(str(e) for e, _ in self._candidates()) or "none"
            raise CheckpointError(f"no checkpoint at epoch {epoch} in {self.directory} (epochs: {known})")
        info = self.read(path)
        if not info.valid:
            raise CheckpointError(f"the checkpoint at epoch {epoch} is damaged: {info.problem}")
        return info

    def write(self, *, epoch: int, files: dict[str, bytes], manifest: dict[str, Any]) -> CheckpointInfo:
        """Write a checkpoint atomically; an existing one of the same epoch is replaced.

        :param files: file name -> contents (``model.safetensors`` required).
        :param manifest: fields to record; ``format``, ``epoch`` and ``files`` are filled in here.
        """
        if MODEL_FILE not in files:
            raise ValueError(f"a checkpoint needs {MODEL_FILE}")
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=f".epoch-{epoch:08d}.", dir=self.directory))
        try:
            listed = {}
            for name, data in files.items():
                _write_synced(staging / name, data)
                listed[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            record = {**manifest, "format": FORMAT, "epoch": epoch, "files": listed}
            _write_synced(staging / MANIFEST, json.dumps(record, indent=1, sort_keys=True).encode())
            _fsync_dir(staging)
            final = self.path_for(epoch)
            if final.exists():
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(staging, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.read(final)

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep`` valid checkpoints, and staging leftovers of crashed writes.

        A checkpoint an organizer published for download (:meth:`set_published`) is never pruned.
        """
        removed = []
        kept = 0
        for _, path in self._candidates():
            info = self.read(path)
            if info.valid and kept < self.keep:
                kept += 1
                continue
            if info.valid and not (path / PUBLISHED_MARKER).exists():
                shutil.rmtree(path, ignore_errors=True)
                self._verified.pop(path, None)
                removed.append(path)
        if self.directory.is_dir():
            for entry in self.directory.iterdir():
                if entry.name.startswith(".epoch-") and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed

    @staticmethod
    def set_published(info: CheckpointInfo, published: bool) -> None:
        """Mark (or unmark) a checkpoint as published: :meth:`prune` keeps it while it is."""
        marker = info.path / PUBLISHED_MARKER
        if published:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def quarantine(self, info: CheckpointInfo) -> Path:
        """Rename a damaged checkpoint to ``*.corrupt`` (kept for inspection, never read again)."""
        target = info.path.with_name(f"{info.path.name}.corrupt")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(info.path, target)
        self._verified.pop(info.path, None)
        return target


# ------------------------------------------------------------------------------------ torch half


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

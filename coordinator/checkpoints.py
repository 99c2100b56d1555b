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

This module is torch-free: :class:`CheckpointStore` lists, verifies, reads and writes checkpoints, so the
web process serves the gallery and ``volunteer-coordinator checkpoints`` exports from it without torch. The
run's swarm peer process evaluates and writes them (:mod:`coordinator.swarm.checkpointer`).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volunteer_app.digests import file_sha256

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
                        actual = file_sha256(path / name)
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

"""``volunteer-coordinator checkpoints list|export RUN``: look at and take out a run's saved models.

``list RUN`` prints every checkpoint of the run, newest first, with its samples, metric and whether its
checksums hold (``--json`` for scripts). ``export RUN [--epoch N] [--output DIR]`` copies an intact
checkpoint (the newest, or epoch N) into a directory that loads anywhere volunteer-app is installed::

    from workers.export import load_model
    model, runtime = load_model("shapes-epoch-00000042")

The export holds the model weights (``model.safetensors``), the showcase drawings and a manifest with
the task, its config and every file's SHA-256; ``--with-optimizer`` adds the optimizer state. Neither
command needs torch or a running ``serve``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from coordinator.checkpoints import (
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAMPLES_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    checkpoint_directory,
)
from coordinator.errors import Conflict, NotFound
from coordinator.settings import CoordinatorSettings


def add_checkpoints_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``checkpoints list|export`` to a ``volunteer-coordinator`` subparsers object; returns the parser.

    Dispatch with :func:`cmd_checkpoints` (``args.command == "checkpoints"``).
    """
    parser = subparsers.add_parser("checkpoints", help="list and export a run's saved models")
    actions = parser.add_subparsers(dest="checkpoints_command", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    listing = actions.add_parser("list", help="a run's checkpoints, newest first, with their metrics")
    listing.add_argument("run", help="run name")
    listing.add_argument("--json", action="store_true", help="print JSON")
    export = actions.add_parser("export", help="copy a checkpoint into a directory that loads anywhere")
    export.add_argument("run", help="run name")
    export.add_argument(
        "--epoch", type=int, default=None, help="the checkpoint's epoch (default: the newest)"
    )
    export.add_argument(
        "--output", type=Path, default=None, help="directory to create (default: ./RUN-epoch-NNNNNNNN)"
    )
    export.add_argument("--with-optimizer", action="store_true", help="include the optimizer state")
    export.add_argument("--json", action="store_true", help="print what was written as JSON")
    for sub in (listing, export):
        sub.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            help="coordinator data directory; env VOLUNTEER_COORDINATOR_DATA_DIR",
        )
    return parser


def _store(args: argparse.Namespace) -> CheckpointStore:
    settings = CoordinatorSettings(**({"data_dir": args.data_dir} if args.data_dir is not None else {}))
    if not settings.data_dir.is_dir():
        raise NotFound(f"no coordinator data directory at {settings.data_dir}", code="no_data_dir")
    directory = checkpoint_directory(settings.data_dir, args.run)
    if not directory.is_dir():
        raise NotFound(
            f"run {args.run!r} has no checkpoints in {settings.data_dir} (the swarm peer of a run saves one "
            "every checkpoint interval while volunteers train)",
            code="no_checkpoints",
        )
    return CheckpointStore(directory)


def _when(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def cmd_list(args: argparse.Namespace) -> int:
    infos = _store(args).checkpoints()
    if args.json:
        print(json.dumps([{"path": str(i.path), **i.summary()} for i in infos], indent=2))
        return 0
    if not infos:
        print(f"run {args.run} has no checkpoints yet")
        return 0
    print(f"{'EPOCH':>8} {'SAMPLES':>10} {'SAVED':<16} {'METRIC':<24} STATE")
    for info in infos:
        summary = info.summary()
        metric = summary["metric"]
        value = summary["metrics"].get(metric) if metric else None
        shown = f"{metric} {value:.3f}" if isinstance(value, (int, float)) else "-"
        state = "ok" if info.valid else f"DAMAGED: {info.problem}"
        samples = summary["samples"] if summary["samples"] is not None else "-"
        print(f"{info.epoch:>8} {samples:>10} {_when(summary['saved_at']):<16} {shown:<24} {state}")
    return 0


def _copy_run_files(manifest: dict[str, Any], staging: Path) -> dict[str, dict[str, Any]]:
    """Copy the files the run's task config names (``tiny-lm``'s text: its model's vocabulary comes from it)
    into the export, named by field and digest; ``workers.export.load_model`` finds them by SHA-256."""
    from workers.tasks import TaskConfigError, UnknownTaskError, load_task

    values = manifest.get("task_config") or {}
    try:
        digests = load_task(str(manifest.get("task"))).file_digests(values)
    except (UnknownTaskError, TaskConfigError):
        return {}
    copied = {}
    for field, sha256 in digests.items():
        name = f"{field}.{sha256[:16]}"
        shutil.copyfile(str(values[field]), staging / name)
        digest = hashlib.sha256((staging / name).read_bytes()).hexdigest()
        if digest != sha256:
            raise CheckpointError(f"the run's file {values[field]} no longer matches its SHA-256 {sha256}")
        copied[name] = {"sha256": sha256, "bytes": (staging / name).stat().st_size}
    return copied


def export_checkpoint(info: CheckpointInfo, output: Path, *, with_optimizer: bool = False) -> dict[str, Any]:
    """Copy ``info`` (already verified) into ``output`` with a manifest of its own; returns that manifest.

    :raises Conflict: when ``output`` exists and is not empty.
    """
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise Conflict(f"{output} already exists; choose another --output", code="output_exists")
    names = [MODEL_FILE, SAMPLES_FILE] + ([OPTIMIZER_FILE] if with_optimizer else [])
    names = [n for n in names if n in info.manifest["files"]]
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        files = {}
        for name in names:
            shutil.copyfile(info.path / name, staging / name)
            digest = hashlib.sha256((staging / name).read_bytes()).hexdigest()
            if digest != info.manifest["files"][name]["sha256"]:
                raise CheckpointError(f"{info.path / name} changed while it was copied; try again")
            files[name] = info.manifest["files"][name]
        files.update(_copy_run_files(info.manifest, staging))
        keep = ("run", "task", "task_config", "epoch", "samples", "saved_at", "metric", "metrics", "prompts")
        manifest = {key: info.manifest.get(key) for key in keep}
        if with_optimizer:
            manifest["optimizer"] = info.manifest.get("optimizer")
        manifest.update(format=info.manifest.get("format"), files=files, exported_at=time.time())
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if output.exists():
            output.rmdir()
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def cmd_export(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        info = store.find(args.epoch) if args.epoch is not None else store.latest()
    except CheckpointError as exc:
        raise NotFound(exc.detail, code="checkpoint_not_found") from exc
    if info is None:
        raise NotFound(f"run {args.run!r} has no intact checkpoint to export", code="checkpoint_not_found")
    output = args.output or Path(f"{args.run}-epoch-{info.epoch:08d}")
    manifest = export_checkpoint(info, output, with_optimizer=args.with_optimizer)
    if args.json:
        print(json.dumps({"path": str(output.resolve()), "epoch": info.epoch, "files": manifest["files"]}))
    else:
        size = sum(f["bytes"] for f in manifest["files"].values())
        print(
            f"exported the checkpoint of epoch {info.epoch} to {output} ({size / 1e6:.1f} MB); load it with:"
        )
        print("    from workers.export import load_model")
        print(f'    model, runtime = load_model("{output}")')
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """The handler of ``volunteer-coordinator checkpoints ...``."""
    try:
        return {"list": cmd_list, "export": cmd_export}[args.checkpoints_command](args)
    except CheckpointError as exc:
        raise NotFound(exc.detail, code="checkpoint_not_found") from exc

"""Load an exported checkpoint (``volunteer-coordinator checkpoints export RUN``) in any Python session::

    from workers.export import load_model
    model, runtime = load_model("shapes-epoch-00000042")

``runtime`` is the task's runtime built from the run's config, ``model`` its model with the checkpoint's
weights, in eval mode on the CPU. Then, for ``shapes-dalle``, ``runtime.sample(model, ["a big red circle
in the center"], temperature=0)`` returns the drawing as an ``(1, 32, 32, 3)`` array, and
``runtime.answer_prompts(model, [...])`` also judges it; for ``tiny-lm``, ``runtime.sample(model, "The ")``
continues a text. Every file's SHA-256 is checked against the export's manifest first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"


class ExportError(Exception):
    """The directory is not an intact exported checkpoint."""


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The export's manifest, after checking every file it lists against its SHA-256.

    :raises ExportError: for a missing manifest or a damaged file.
    """
    directory = Path(path)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError as exc:
        raise ExportError(f"{directory} holds no {MANIFEST}: not an exported checkpoint") from exc
    except (OSError, ValueError) as exc:
        raise ExportError(f"{directory / MANIFEST} is unreadable: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise ExportError(f"{directory / MANIFEST} lists no {MODEL_FILE}")
    for name, meta in files.items():
        if "/" in name or name.startswith("."):
            raise ExportError(f"{directory / MANIFEST}: bad file name {name!r}")
        try:
            digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        except OSError as exc:
            raise ExportError(f"{directory / name} is missing or unreadable") from exc
        if digest != meta.get("sha256"):
            raise ExportError(f"{directory / name} does not match its checksum: damaged or incomplete")
    return manifest


def load_model(path: str | Path) -> tuple[Any, Any]:
    """``(model, runtime)`` of an exported checkpoint directory (see the module docs).

    :raises ExportError: for a damaged export or one whose weights do not fit its task's model.
    """
    from safetensors.torch import load_file

    from workers.tasks import load_task

    manifest = read_manifest(path)
    spec = load_task(str(manifest["task"]))
    runtime = spec.build_runtime(spec.make_config(manifest.get("task_config") or {}))
    model = runtime.build_model()
    try:
        model.load_state_dict(load_file(str(Path(path) / MODEL_FILE)), strict=True)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ExportError(f"{Path(path) / MODEL_FILE} does not fit the {spec.name} model: {exc}") from exc
    model.eval()
    return model, runtime

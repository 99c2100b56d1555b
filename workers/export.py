"""Load an exported checkpoint (``volunteer-coordinator checkpoints export RUN``, or a gallery download)
in any Python session::

    from workers.export import load_model
    model, runtime = load_model("shapes-epoch-00000042")        # the folder, or the downloaded .zip

``runtime`` is the task's runtime built from the run's config, ``model`` its model with the checkpoint's
weights, in eval mode on the CPU. Then, for ``shapes-dalle``, ``runtime.sample(model, ["a big red circle
in the center"], temperature=0)`` returns the drawing as an ``(1, 32, 32, 3)`` array, and
``runtime.answer_prompts(model, [...])`` also judges it; for ``tiny-lm``, ``runtime.sample(model, "The ")``
continues a text.

A checkpoint is data from whoever published it, so loading one runs none of its code: its task must be
installed here and is looked up by name (a module path is refused, never imported); the weights are
safetensors (never pickle); the folder or archive may hold only the files its manifest lists (an extra
file, such as an ``evil.py`` beside the manifest, is refused), each no larger than it says and matching its
SHA-256; an archive is read entry by entry with its sizes bounded (:data:`MAX_EXPORT_BYTES`), never
extracted by the names it holds; and a task config that names a file (``tiny-lm``'s text) gets the copy
the export carries, found by its SHA-256, never the path the manifest names.
"""

from __future__ import annotations

import json
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from volunteer_app.digests import file_sha256

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
MAX_MANIFEST_BYTES = 1 << 20
MAX_EXPORT_BYTES = 16 * 2**30
"""The largest export loaded (all its files together); pass ``max_bytes`` to load a larger one."""
MAX_FILES = 32
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class ExportError(Exception):
    """The folder or archive is not an intact exported checkpoint, or would not be safe to load."""


def _listed_files(manifest: Any, where: str, max_bytes: int) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` (name -> {"sha256", "bytes"}), checked for shape, names and total size."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise ExportError(f"{where} lists no {MODEL_FILE}")
    if len(files) > MAX_FILES:
        raise ExportError(f"{where} lists {len(files)} files; an export holds at most {MAX_FILES}")
    total = 0
    for name, meta in files.items():
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or name == MANIFEST:
            raise ExportError(f"{where}: bad file name {str(name)[:80]!r}")
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
            raise ExportError(f"{where}: no SHA-256 for {name}")
        size = meta.get("bytes")
        if isinstance(size, int) and size >= 0:
            total += size
    if total > max_bytes:
        raise ExportError(f"{where} lists {total} bytes of files; the limit is {max_bytes} (max_bytes)")
    return files


def _parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ExportError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise ExportError(f"{where} is unreadable: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ExportError(f"{where} is not a manifest")
    return manifest


def read_manifest(path: str | Path, *, max_bytes: int = MAX_EXPORT_BYTES) -> dict[str, Any]:
    """An export folder's manifest, after checking the folder: no file the manifest does not list, and
    every listed file within the size limits and matching its SHA-256.

    :raises ExportError: for a missing or oversized manifest, an unlisted or damaged file, a bad name.
    """
    directory = Path(path)
    manifest_path = directory / MANIFEST
    try:
        if manifest_path.is_symlink():
            raise ExportError(f"{manifest_path} is a symbolic link: refusing it")
        with open(manifest_path, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as exc:
        raise ExportError(f"{directory} holds no {MANIFEST}: not an exported checkpoint") from exc
    except OSError as exc:
        raise ExportError(f"{manifest_path} is unreadable: {exc}") from exc
    manifest = _parse_manifest(raw, str(manifest_path))
    files = _listed_files(manifest, str(manifest_path), max_bytes)
    present = {entry.name for entry in directory.iterdir()}
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise ExportError(
            f"{directory} holds {', '.join(extra[:5])}, which its manifest does not list: an export holds only "
            "its listed files, so it is not loaded"
        )
    for name, meta in files.items():
        file = directory / name
        if file.is_symlink() or not file.is_file():
            raise ExportError(f"{file} is missing, or not a regular file")
        size = file.stat().st_size
        if isinstance(meta.get("bytes"), int) and size != meta["bytes"]:
            raise ExportError(f"{file} has {size} bytes, not the {meta['bytes']} its manifest lists")
        if size > max_bytes:
            raise ExportError(f"{file} is larger than {max_bytes} bytes (max_bytes)")
        if file_sha256(file) != meta["sha256"]:
            raise ExportError(f"{file} does not match its checksum: damaged or incomplete")
    return manifest


def _unpack(archive: Path, into: Path, *, max_bytes: int) -> Path:
    """Copy a zipped export's listed files into ``into`` (named by the manifest, checked sizes); returns
    the folder. Entries are read from the archive by name, never extracted by the names it holds."""
    try:
        bundle = zipfile.ZipFile(archive)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ExportError(f"{archive} is not a readable zip archive: {exc}") from exc
    with bundle:
        infos = [i for i in bundle.infolist() if not i.is_dir()]
        if len(infos) > MAX_FILES + 1:
            raise ExportError(f"{archive} holds {len(infos)} files; an export holds at most {MAX_FILES + 1}")
        if sum(i.file_size for i in infos) > max_bytes:
            raise ExportError(f"{archive} unpacks to more than {max_bytes} bytes (max_bytes): not loaded")
        folders = {i.filename.rsplit("/", 1)[0] if "/" in i.filename else "" for i in infos}
        manifests = [i for i in infos if i.filename.rsplit("/", 1)[-1] == MANIFEST]
        if len(manifests) != 1 or len(folders) != 1:
            raise ExportError(f"{archive} is not one exported checkpoint (one folder with one {MANIFEST})")
        prefix = manifests[0].filename[: -len(MANIFEST)]
        if manifests[0].file_size > MAX_MANIFEST_BYTES:
            raise ExportError(f"{archive}: its {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = _parse_manifest(bundle.read(manifests[0]), f"{archive}:{MANIFEST}")
        files = _listed_files(manifest, f"{archive}:{MANIFEST}", max_bytes)
        names = {i.filename[len(prefix) :]: i for i in infos}
        extra = sorted(set(names) - set(files) - {MANIFEST})
        if extra:
            raise ExportError(
                f"{archive} holds {', '.join(n[:60] for n in extra[:5])}, which its manifest does not list: not "
                "loaded"
            )
        (into / MANIFEST).write_bytes(bundle.read(manifests[0]))
        for name in files:
            info = names.get(name)
            if info is None:
                raise ExportError(f"{archive} lacks {name}, which its manifest lists")
            with bundle.open(info) as source, open(into / name, "wb") as target:
                copied = 0
                while chunk := source.read(1 << 20):
                    copied += len(chunk)
                    if copied > info.file_size or copied > max_bytes:
                        raise ExportError(f"{archive}: {name} unpacks to more than it declares: not loaded")
                    target.write(chunk)
    return into


def load_model(path: str | Path, *, max_bytes: int = MAX_EXPORT_BYTES) -> tuple[Any, Any]:
    """``(model, runtime)`` of an exported checkpoint: its folder or its zip archive (see the module docs).

    :param max_bytes: the largest export to load, all files together.
    :raises ExportError: for a damaged or unsafe export, a task not installed here, or weights that do not
      fit the task's model.
    """
    source = Path(path)
    if source.is_file() and zipfile.is_zipfile(source):
        with tempfile.TemporaryDirectory(prefix="volunteer-export-") as scratch:
            return _load_folder(_unpack(source, Path(scratch), max_bytes=max_bytes), max_bytes=max_bytes)
    return _load_folder(source, max_bytes=max_bytes)


def _load_folder(directory: Path, *, max_bytes: int) -> tuple[Any, Any]:
    from safetensors.torch import load_file

    from workers.tasks import TaskConfigError, UnknownTaskError, load_task

    manifest = read_manifest(directory, max_bytes=max_bytes)
    try:
        spec = load_task(str(manifest.get("task")))
        by_digest = {meta["sha256"]: str(directory / name) for name, meta in manifest["files"].items()}
        values = manifest.get("task_config") or {}
        if not isinstance(values, dict):
            raise ExportError(f"{directory / MANIFEST}: task_config is not an object")
        config = spec.make_config(spec.bind_files(values, by_digest))
    except UnknownTaskError as exc:
        raise ExportError(f"{directory}: {exc}") from exc
    except TaskConfigError as exc:
        raise ExportError(f"{directory}: the export's task config cannot be used here: {exc}") from exc
    runtime = spec.build_runtime(config)
    model = runtime.build_model()
    try:
        model.load_state_dict(load_file(str(directory / MODEL_FILE)), strict=True)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ExportError(f"{directory / MODEL_FILE} does not fit the {spec.name} model: {exc}") from exc
    model.eval()
    return model, runtime

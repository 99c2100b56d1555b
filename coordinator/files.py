"""The files a run's peers need (``tiny-lm``'s text), kept by the coordinator and named by content.

When an organizer creates a run from the server's shell with a task config that names a file
(``runs create --config text_path=corpus.txt``; the task's ``TaskSpec.file_fields``), the coordinator
copies the file into ``DATA_DIR/files/<sha256>``, records the digest in the config (``text_sha256``) and
points the config's path at its own copy, so the run outlives the original file. It serves the copy to
anyone who can read the run at ``GET /api/v1/runs/{name}/files/{sha256}``; agents fetch it into their
cache and check the digest (``volunteer_app.agent.cache``). Over HTTP a run may not name files: that would
let whoever holds the organizer token read any file of the server through the coordinator.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.errors import Invalid
from volunteer_app.protocol import RunFile

CHUNK = 1 << 20


class RunFileStore:
    """``DATA_DIR/files``: one file per SHA-256, written once (a temporary name, fsync, rename)."""

    def __init__(self, root: Path):
        self.root = root

    def path_of(self, sha256: str) -> Path:
        return self.root / sha256

    def add(self, source: Path, *, field: str) -> tuple[str, Path]:
        """Copy ``source`` in; return its SHA-256 and the stored copy's path.

        :raises Invalid: when ``source`` cannot be read (named after the config field ``field``).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        fd, temporary = tempfile.mkstemp(dir=self.root, prefix=".incoming-")
        try:
            with open(source, "rb") as reader, os.fdopen(fd, "wb") as writer:
                while chunk := reader.read(CHUNK):
                    digest.update(chunk)
                    writer.write(chunk)
                writer.flush()
                os.fsync(writer.fileno())
            sha256 = digest.hexdigest()
            stored = self.path_of(sha256)
            if stored.exists():
                os.unlink(temporary)
            else:
                os.chmod(temporary, 0o644)
                os.replace(temporary, stored)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            detail = f"cannot copy {str(source)!r} into the coordinator's files: {exc.strerror or exc}"
            raise Invalid(
                detail, code="invalid_task_config", fields={f"task_config.{field}": detail}
            ) from exc
        return sha256, stored

    def size(self, sha256: str) -> int | None:
        with contextlib.suppress(OSError):
            return self.path_of(sha256).stat().st_size
        return None


def store_run_files(spec: Any, values: dict[str, Any], *, store: RunFileStore) -> dict[str, Any]:
    """``values`` (a validated task config) with each file it names copied into ``store``: the digest
    field set, the path field pointing at the stored copy."""
    bound = dict(values)
    for path_field, digest_field in spec.file_fields.items():
        source = bound.get(path_field)
        if source is None:
            continue
        sha256, stored = store.add(Path(str(source)), field=path_field)
        expected = bound.get(digest_field)
        if expected is not None and expected != sha256:  # the file changed since it was validated
            detail = f"{source!r} has SHA-256 {sha256}, not the configured {expected}"
            raise Invalid(detail, code="invalid_task_config", fields={f"task_config.{digest_field}": detail})
        bound[path_field], bound[digest_field] = str(stored), sha256
    return bound


def run_files(task: str, task_config: Mapping[str, Any], *, store: RunFileStore) -> list[RunFile]:
    """The files a run's peers must fetch, as listed to agents (none for tasks that name no file)."""
    from workers.tasks import TaskConfigError, UnknownTaskError, load_task

    try:
        spec = load_task(task)
        digests = spec.file_digests(task_config)
    except (UnknownTaskError, TaskConfigError):
        return []
    listed = []
    for field, sha256 in digests.items():
        size = store.size(sha256)
        if size is not None:
            listed.append(RunFile(field=field, sha256=sha256, bytes=size))
    return listed


def copy_run_file(store: RunFileStore, sha256: str, destination: Path) -> None:
    """Copy a stored file out (checkpoint exports carry the files their model needs)."""
    shutil.copyfile(store.path_of(sha256), destination)

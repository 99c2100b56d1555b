"""The files a worker reads for a run: only the agent's checked copies, inside the agent's cache.

A run's task config comes from its coordinator, which a volunteer does not trust. Its file fields
(``TaskSpec.file_fields``, e.g. ``tiny-lm``'s ``text_path``) hold the organizer's path on the
coordinator's server; that path is never opened here. The agent fetched each file the run lists into its
cache and checked its SHA-256 (``volunteer_app.agent.cache``), and hands the worker ``files`` (SHA-256 ->
cached path). :func:`task_config` replaces each file field by the cached copy of the file with the
config's digest, after checking that the copy really lies inside ``cache_dir`` (no symbolic link out).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.tasks.base import TaskConfigError, TaskSpec


def checked_files(files: Mapping[str, str], cache_dir: str | None) -> dict[str, str]:
    """``files`` with every path resolved, after checking that each is a regular file inside ``cache_dir``.

    :raises TaskConfigError: for a path outside the cache (or any path when there is no cache).
    """
    if not files:
        return {}
    if cache_dir is None:
        raise TaskConfigError(
            "*", {"*": "the run needs files, but the agent gave no cache to read them from"}
        )
    root = Path(cache_dir).resolve()
    checked: dict[str, str] = {}
    for digest, path in files.items():
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(root) or not resolved.is_file() or os.path.islink(path):
            raise TaskConfigError(
                "*", {"*": f"refusing {path!r}: a run's files are read from the agent's cache only"}
            )
        checked[digest] = str(resolved)
    return checked


def task_config(
    spec: TaskSpec, values: Mapping[str, Any], *, files: Mapping[str, str], cache_dir: str | None
) -> Any:
    """The validated config of a run's task, its files bound to the agent's checked copies.

    :raises TaskConfigError: for an invalid config, a missing file, or a file outside the cache.
    """
    return spec.make_config(spec.bind_files(values, checked_files(files, cache_dir)))

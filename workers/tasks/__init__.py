"""Training tasks. ``load_task`` finds one by name, among installed tasks only, without importing torch.

Built-in tasks are ``shapes-dalle`` (the flagship text-to-image transformer) and ``tiny-lm``.
Organizers bring their own as an installed entry point in the ``volunteer_app.tasks`` group
(``my-task = "my_pkg.my_task:TASK"`` in their package's metadata, installed where it runs).

A task is only ever looked up by its *name* in that closed list, never imported by a module path: the
name travels over the wire (a coordinator's run config, a checkpoint's manifest), and importing whatever
module such a name holds would run code of the sender's choosing (``Downloads.volunteer_setup:TASK``
imports ``~/Downloads/volunteer_setup.py`` from a volunteer's home directory). docs/security.md.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points

from workers.tasks.base import TaskConfigError, TaskRuntime, TaskSpec, UnknownTaskError

BUILTIN_TASKS: dict[str, str] = {
    "shapes-dalle": "workers.tasks.shapes_dalle:TASK",
    "tiny-lm": "workers.tasks.tiny_lm:TASK",
}

TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
"""What a task name looks like (an entry point's name): no ``:``, ``/`` or spaces."""

__all__ = [
    "BUILTIN_TASKS",
    "TaskConfigError",
    "TaskRuntime",
    "TaskSpec",
    "UnknownTaskError",
    "available_tasks",
    "load_task",
]


def _installed() -> dict[str, str]:
    """Task name -> ``module:attr`` of every installed task; a built-in name cannot be taken over."""
    targets = {ep.name: ep.value for ep in entry_points(group="volunteer_app.tasks")}
    targets.update(BUILTIN_TASKS)
    return targets


def available_tasks() -> list[str]:
    """Names of the built-in tasks and of every installed ``volunteer_app.tasks`` entry point."""
    return sorted(_installed())


def load_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` of the installed task ``name``. Never imports torch itself.

    :raises UnknownTaskError: when no installed task has that name (a module path is not a name: it is
      refused without importing anything).
    """
    shown = repr(name[:80]) if isinstance(name, str) else repr(type(name).__name__)
    target = _installed().get(name) if isinstance(name, str) and TASK_NAME.fullmatch(name) else None
    if target is None:
        raise UnknownTaskError(
            f"unknown task {shown}; installed tasks: {', '.join(available_tasks())} (tasks are named, never "
            "imported by path: install a task as a `volunteer_app.tasks` entry point)"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownTaskError(f"the installed task {name!r} cannot be imported: {exc}") from exc
    spec = getattr(module, attr or "TASK", None)
    if not isinstance(spec, TaskSpec):
        raise UnknownTaskError(f"the installed task {name!r} ({target}) is not a TaskSpec")
    return spec

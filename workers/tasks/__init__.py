"""Training tasks. ``load_task`` finds one by name, entry point or dotted path, without importing torch.

Built-in tasks are ``shapes-dalle`` (the flagship text-to-image transformer) and ``tiny-lm``.
Organizers bring their own either as an installed entry point in the ``volunteer_app.tasks`` group
(``my-task = "my_pkg.my_task:TASK"``) or by dotted path (``--task my_pkg.my_task:TASK``, or just
``my_pkg.my_task`` when the module's spec is called ``TASK``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from workers.tasks.base import TaskConfigError, TaskRuntime, TaskSpec, UnknownTaskError

BUILTIN_TASKS: dict[str, str] = {
    "shapes-dalle": "workers.tasks.shapes_dalle:TASK",
    "tiny-lm": "workers.tasks.tiny_lm:TASK",
}

__all__ = [
    "BUILTIN_TASKS",
    "TaskConfigError",
    "TaskRuntime",
    "TaskSpec",
    "UnknownTaskError",
    "available_tasks",
    "load_task",
]


def available_tasks() -> list[str]:
    """Names of the built-in tasks and of every installed ``volunteer_app.tasks`` entry point."""
    names = set(BUILTIN_TASKS)
    names.update(ep.name for ep in entry_points(group="volunteer_app.tasks"))
    return sorted(names)


def load_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` for ``name`` (a task name or ``module[:ATTR]``). Never imports torch itself."""
    target = BUILTIN_TASKS.get(name)
    if target is None:
        for ep in entry_points(group="volunteer_app.tasks"):
            if ep.name == name:
                target = ep.value
                break
    if target is None:
        if "." not in name and ":" not in name:
            raise UnknownTaskError(
                f"unknown task {name!r}; known tasks: {', '.join(available_tasks())} "
                "(or give a dotted path such as my_pkg.my_task:TASK)"
            )
        target = name
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownTaskError(f"cannot import task module {module_name!r}: {exc}") from exc
    spec = getattr(module, attr or "TASK", None)
    if not isinstance(spec, TaskSpec):
        raise UnknownTaskError(f"{target!r} is not a TaskSpec (expected a module attribute such as TASK)")
    return spec

"""The import rule of ARCHITECTURE.md, checked in fresh interpreters so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import python_env

FORBIDDEN = {
    "volunteer_app": {
        "textual",
        "fastapi",
        "starlette",
        "torch",
        "hivemind",
        "tui",
        "coordinator",
        "workers",
    },
    "volunteer_app.cli": {
        "textual",
        "fastapi",
        "starlette",
        "torch",
        "hivemind",
        "tui",
        "coordinator",
        "workers",
    },
    "volunteer_app.agent.server": {
        "textual",
        "fastapi",
        "starlette",
        "torch",
        "hivemind",
        "tui",
        "coordinator",
        "workers",
    },
    "volunteer_app.control_client": {
        "textual",
        "fastapi",
        "starlette",
        "torch",
        "hivemind",
        "tui",
        "coordinator",
        "workers",
    },
    "tui": {"fastapi", "starlette", "torch", "hivemind", "coordinator", "workers"},
    "tui.app": {"fastapi", "starlette", "torch", "hivemind", "coordinator", "workers"},
    "tui.web": {"fastapi", "starlette", "torch", "hivemind", "coordinator", "workers"},
    "coordinator": {"torch", "hivemind", "textual", "tui"},
    "coordinator.api": {"torch", "hivemind", "textual", "tui"},
    "coordinator.cli": {"torch", "hivemind", "textual", "tui"},
    "coordinator.accounts": {"torch", "hivemind", "textual", "tui"},
    "coordinator.credit": {"torch", "hivemind", "textual", "tui"},
    "coordinator.monitoring": {"torch", "hivemind", "textual", "tui"},
    "coordinator.checkpoints": {"torch", "hivemind", "textual", "tui"},
    "coordinator.checkpoint_cli": {"torch", "hivemind", "textual", "tui"},
    # the web process starts the swarm peers through this module
    "coordinator.swarm.manager": {"torch", "hivemind", "textual", "tui"},
    # the swarm peer's process has torch and hivemind, imported inside the functions that use them only
    "coordinator.swarm": {"torch", "hivemind", "textual", "tui"},
    "coordinator.swarm.peer": {"torch", "hivemind", "textual", "tui"},
    "coordinator.swarm.checkpointer": {"torch", "hivemind", "textual", "tui"},
    "coordinator.swarm.spotchecker": {"torch", "hivemind", "textual", "tui"},
    "coordinator.swarm.generate": {"torch", "hivemind", "textual", "tui"},
    "workers": {"torch", "hivemind", "textual", "fastapi", "tui", "coordinator"},
    "workers.tasks": {"torch", "hivemind", "textual", "fastapi", "numpy", "tui", "coordinator"},
}


def _loaded_after_import(module: str) -> set[str]:
    code = f"import importlib, json, sys; importlib.import_module({module!r}); print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), check=True
    ).stdout
    return {name.split(".")[0] for name in json.loads(out)}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_package_imports_only_what_its_row_allows(module: str) -> None:
    try:
        __import__(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            pytest.fail(f"{module} does not exist")
        raise
    leaked = _loaded_after_import(module) & FORBIDDEN[module]
    assert not leaked, f"importing {module} pulled in {sorted(leaked)}"


def test_validating_a_run_in_the_web_process_does_not_import_torch() -> None:
    code = (
        "import json, sys; from coordinator.runs import validate_task_config; "
        "validate_task_config('shapes-dalle', {'preset': 'tiny'}); validate_task_config('tiny-lm', {}); "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), check=True
    ).stdout
    assert not {"torch", "hivemind"} & {name.split(".")[0] for name in json.loads(out)}

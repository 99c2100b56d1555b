"""The import rule of ARCHITECTURE.md, checked in fresh interpreters so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import python_env

AGENT_SIDE = {"textual", "fastapi", "starlette", "torch", "hivemind", "tui", "coordinator", "workers"}
"""What the volunteer's agent and CLI must never import."""
TUI_SIDE = {"fastapi", "starlette", "torch", "hivemind", "coordinator", "workers"}
WEB_PROCESS = {"torch", "hivemind", "textual", "tui"}
"""What the coordinator's modules must never import."""

FORBIDDEN = {
    "volunteer_app": AGENT_SIDE,
    "volunteer_app.cli": AGENT_SIDE,
    "volunteer_app.agent.server": AGENT_SIDE,
    "volunteer_app.control_client": AGENT_SIDE,
    "tui": TUI_SIDE,
    "tui.app": TUI_SIDE,
    "tui.web": TUI_SIDE,
    "coordinator": WEB_PROCESS,
    "coordinator.api": WEB_PROCESS,
    "coordinator.cli": WEB_PROCESS,
    "coordinator.accounts": WEB_PROCESS,
    "coordinator.credit": WEB_PROCESS,
    "coordinator.monitoring": WEB_PROCESS,
    "coordinator.checkpoints": WEB_PROCESS,
    "coordinator.checkpoint_cli": WEB_PROCESS,
    # the web process starts the swarm peers through this module
    "coordinator.swarm.manager": WEB_PROCESS,
    # the swarm peer's process has torch and hivemind, imported inside the functions that use them only
    "coordinator.swarm": WEB_PROCESS,
    "coordinator.swarm.peer": WEB_PROCESS,
    "coordinator.swarm.checkpointer": WEB_PROCESS,
    "coordinator.swarm.spotchecker": WEB_PROCESS,
    "coordinator.swarm.generate": WEB_PROCESS,
    "workers": {"torch", "hivemind", "textual", "fastapi", "tui", "coordinator"},
    "workers.tasks": {"torch", "hivemind", "textual", "fastapi", "numpy", "tui", "coordinator"},
}


def _loaded_by(code: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after ``code``, which prints ``sys.modules``."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), check=True
    ).stdout
    return {name.split(".")[0] for name in json.loads(out)}


def _loaded_after_import(module: str) -> set[str]:
    return _loaded_by(
        f"import importlib, json, sys; importlib.import_module({module!r}); print(json.dumps(sorted(sys.modules)))"
    )


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
    assert not {"torch", "hivemind"} & _loaded_by(code)

"""The command line's layout holds: the UIs find the agent through its files without importing the agent, and
``python -m volunteer_app.cli`` is the ``volunteer-app`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import python_env


def _modules_after(code: str, tmp_path: Path) -> list[str]:
    program = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True,
        env=python_env(VOLUNTEER_CONFIG_DIR=str(tmp_path)), timeout=120,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def test_a_ui_finds_the_agent_without_importing_the_supervisor(tmp_path: Path) -> None:
    loaded = _modules_after(
        "import tui.app\n"
        "from volunteer_app.control_client import AgentNotRunning, locate_agent\n"
        "from volunteer_app.settings import AgentSettings\n"
        "try:\n    locate_agent(AgentSettings())\nexcept AgentNotRunning:\n    pass",
        tmp_path,
    )
    assert "volunteer_app.agentfiles" in loaded
    assert not [m for m in loaded if m == "volunteer_app.agent" or m.startswith("volunteer_app.agent.")]


def test_a_shell_command_loads_neither_the_app_nor_the_agent_service(tmp_path: Path) -> None:
    loaded = _modules_after(
        "from volunteer_app.cli import main\ntry:\n    main(['status'])\nexcept SystemExit:\n    pass",
        tmp_path,
    )
    assert not [m for m in loaded if m.split(".")[0] in ("tui", "textual", "torch", "hivemind")]
    assert "volunteer_app.agent.service" not in loaded


def test_python_dash_m_is_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", "--version"], capture_output=True, text=True,
        env=python_env(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("volunteer-app ")

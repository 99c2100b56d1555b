"""Running a script of real hivemind peers in a process of its own, for the tests of :mod:`workers.compat`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import python_env


def run_peer_script(script: str, *args: str, timeout: float) -> tuple[Any, str]:
    """Run ``script`` (hivemind peers need a process of their own) and return the JSON of its last output
    line, with its log (stderr) for assertion messages."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, env=python_env(), timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr

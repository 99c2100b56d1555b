"""Running a script of real hivemind peers in a process of its own, for the tests of :mod:`workers.compat`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import python_env

MAKE_STATE_AVERAGER = r"""
def make(dht, fill, cls=None, **options):
    # a Linear(4, 4) filled with `fill` and a state averager of it (cls, default GuardedStateAverager) with
    # the script's PREFIX, in groups of two
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    averager = (cls or compat.GuardedStateAverager)(
        dht=dht, optimizer=partial(torch.optim.SGD, lr=0.1), params=model.parameters(),
        prefix=PREFIX, target_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0, start=True, **options)
    return model, averager
"""
"""A script fragment: ``make(dht, fill, cls=None, **options)`` for scripts that import ``partial``, ``torch``
and ``workers.compat`` and set ``PREFIX``."""


def start_peer_script(script: str, *args: str) -> subprocess.Popen[str]:
    """Start ``script`` in a process of its own, its output and log piped; see :func:`first_maddrs` and
    :func:`peer_outcome`."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip


def first_maddrs(peer: subprocess.Popen[str]) -> list[str]:
    """The first line a started script prints: its DHT's addresses as JSON, for its partners to join."""
    assert peer.stdout is not None
    line = peer.stdout.readline()
    assert line, peer.communicate(timeout=60)[1][-2000:]
    addresses: list[str] = json.loads(line)
    return addresses


def peer_outcome(peer: subprocess.Popen[str], timeout: float = 120) -> tuple[Any, str]:
    """Wait for a started script; the JSON of its last output line, with its log (stderr)."""
    out, err = peer.communicate(timeout=timeout)
    assert peer.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1]), err


def run_peer_script(script: str, *args: str, timeout: float) -> tuple[Any, str]:
    """Run ``script`` (hivemind peers need a process of their own) and return the JSON of its last output
    line, with its log (stderr) for assertion messages."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, env=python_env(), timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr

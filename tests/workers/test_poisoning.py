"""A real 3-peer swarm on loopback in which one peer poisons everything it sends into averaging.

The two honest peers run the worker's own optimizer (``workers.collab.build_optimizer``, robust averaging
installed); the poisoner (``tests/workers/poison_peer.py``, a test-only wrapper) replaces every tensor part
it sends with NaN, 1e6 and +inf in turn. The honest peers must keep learning: finite parameters, and a loss at the
end well below the loss at the start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env

HELPER = Path(__file__).with_name("poison_peer.py")


class SwarmPeerProcess:
    def __init__(self, args: dict[str, Any], started: list[subprocess.Popen[Any]]):
        self.lines: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, str(HELPER), json.dumps(args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(), start_new_session=True,
        )  # fmt: skip
        started.append(self.process)
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr or []), daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_line(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if key in line:
                    return line
            if self.process.poll() is not None and not any(key in line for line in self.lines):
                time.sleep(0.5)  # let the pump read what is left
                if not any(key in line for line in self.lines):
                    break
            time.sleep(0.2)
        raise AssertionError(f"no {key!r} line: {self.lines[-5:]} {''.join(self.stderr)[-3000:]}")

    def losses(self) -> list[float]:
        return [line["loss"] for line in self.lines if "loss" in line]

    def epochs(self) -> list[int]:
        return [line["epoch"] for line in self.lines if "epoch" in line]


def run_swarm(
    *, poison: str | None, steps: int, mode: str, started: list[subprocess.Popen[Any]], defence: bool = True
) -> list[SwarmPeerProcess]:
    """Start three peers (the third poisons when asked), wait until they finish; returns them."""
    common = {
        "steps": steps,
        "mode": mode,
        "seed": 0,
        "run_id": f"poison-{os.getpid()}-{time.monotonic_ns()}",
    }
    first = SwarmPeerProcess({**common, "index": 0, "defence": defence}, started)
    maddrs = first.wait_line("maddrs", 60)["maddrs"]
    peers = [first]
    for index in (1, 2):
        args = {**common, "index": index, "initial_peers": maddrs, "defence": defence}
        if index == 2 and poison:
            args["poison"] = poison
        peers.append(SwarmPeerProcess(args, started))
    for peer in peers:
        peer.wait_line("done", 240)
    for peer in peers:
        peer.process.wait(timeout=60)
    return peers


def window_mean(values: list[float], start: int, size: int = 8) -> float:
    chunk = values[start : start + size] if start >= 0 else values[start:]
    return sum(chunk) / len(chunk)


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_honest_peers_keep_learning_while_one_poisons_averaging(kill_leftovers: list[Any]) -> None:
    # parameters averaged every round (local updates); the poison is NaN, 1e6 and +inf, part by part
    # (tests/perf/bench_poisoning.py runs the gradients mode and the undefended swarm too)
    mode, poison = "local", "mixed"
    peers = run_swarm(poison=poison, steps=48, mode=mode, started=kill_leftovers)
    honest, poisoner = peers[:2], peers[2]
    for peer in honest:
        losses = peer.losses()
        done = peer.wait_line("done", 1)
        assert done["finite_parameters"], "".join(peer.stderr)[-2000:]
        assert all(loss == loss and loss < 100 for loss in losses), losses  # finite, never blown up
        start, end = window_mean(losses, 0), window_mean(losses, -8)
        assert end < 0.8 * start, (mode, start, end, losses)
        # the swarm did average (the poisoner took part), else this would test nothing
        assert done["epoch"] >= 2, done
    # the honest peers saw the poison and left it out (hivemind's averagers log to stderr)
    seen = "".join("".join(peer.stderr) for peer in honest)
    assert "left a non-finite contribution out of the average" in seen, seen[-3000:]
    assert poisoner.wait_line("done", 1)["epoch"] >= 1
    for peer in peers:
        if peer.process.poll() is None:
            os.killpg(peer.process.pid, signal.SIGKILL)

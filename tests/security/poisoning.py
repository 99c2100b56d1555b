"""A real three-peer swarm on loopback, optionally with one poisoning peer, for the poisoning test and benchmark.

A ``serve`` with one ``shapes-dalle tiny`` run and three ``volunteer-app join`` processes, one CPU thread
each. With ``poison`` set, the third volunteer ("mallory") runs the hostile copy of the software in
``tests/security/poisoner`` (``sitecustomize``: reversed, amplified contributions and garbage averages).
The honest peers' training losses (their status lines) are sampled every few seconds.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import python_env, start_serve, stop_serve
from tests.workers.test_collaborative_training import Peer

POISONER = Path(__file__).resolve().parent / "poisoner"
UNDEFENDED = Path(__file__).resolve().parent / "undefended"
HONEST = ("alice", "bob")
LATE = "carol"


def run_swarm(
    root: Path,
    *,
    poison: str | None,
    mode: str,
    seconds: float,
    sample_every: float = 5.0,
    undefended: bool = False,
    late_joiner: bool = False,
) -> dict[str, Any]:
    """Train for ``seconds`` after all three peers have averaged together once. Returns ``curves``
    (``{name: [(seconds, loss)]}`` of the honest peers), ``final`` (every peer's last status), and from
    the honest workers' logs ``left_out`` (rounds in which their reductions left contributions out) and
    ``refusals`` (rounds in which they refused another reducer's answers). ``undefended``: the honest
    peers average as plain hivemind does (``tests/security/undefended``), for the "before" figures.
    ``late_joiner``: then an honest fourth volunteer, ``LATE``, joins the trained swarm (downloading its
    state); ``late`` is her first status with a loss, and ``late_refused_states`` the states her worker
    refused to load."""
    data = root / "data"
    extra = ["--local-updates"] if mode == "local" else []
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=256",
         "--target-batch-size", "192", "--matchmaking-time", "2", "--averaging-timeout", "20", *extra],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    peers: list[Peer] = []
    try:
        honest_env = None
        if undefended:
            honest_env = {"PYTHONPATH": os.pathsep.join([str(UNDEFENDED), python_env()["PYTHONPATH"]])}
        for name in HONEST:
            peers.append(Peer(url, "shapes", name, root, env=honest_env))
        hostile_env = None
        if poison:
            path = os.pathsep.join([str(POISONER), python_env()["PYTHONPATH"]])
            hostile_env = {"PYTHONPATH": path, "VOLUNTEER_POISON": poison}
        peers.append(Peer(url, "shapes", "mallory", root, env=hostile_env))
        for peer in peers[:2]:
            peer.wait_for(
                "an averaging round of the whole swarm",
                lambda s: s.get("averaging_rounds", 0) >= 1 and s.get("swarm_size") == 3,
                300,
            )
        start = time.monotonic()
        curves: dict[str, list[tuple[float, float]]] = {name: [] for name in HONEST}
        while (elapsed := time.monotonic() - start) < seconds:
            for peer in peers[:2]:
                loss = peer.status.get("loss")
                if loss is not None:
                    curves[peer.name].append((round(elapsed, 1), float(loss)))
                if not undefended:  # an undefended peer may well break: that is the figure
                    assert peer.process.poll() is None, f"{peer.name} exited: {peer.worker_log()}"
            time.sleep(sample_every)
        final = {peer.name: {**peer.status, "exited": peer.process.poll() is not None} for peer in peers}
        left_out = {peer.name: _log_count(peer, "averaging: left out") for peer in peers[:2]}
        refusals = {peer.name: _log_count(peer, "outlandish part", "non-finite part") for peer in peers[:2]}
        result = {"curves": curves, "final": final, "left_out": left_out, "refusals": refusals}
        if late_joiner:
            late = Peer(url, "shapes", LATE, root, env=honest_env)
            peers.append(late)
            result["late"] = late.wait_for("a first loss", lambda s: s.get("first_loss") is not None, 300)
            result["late_refused_states"] = _log_count(late, "refused the state peer")
            result["late_log"] = late.worker_log()
        return result
    finally:
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.kill()
            os.system(f"pkill -9 -f {peer.config_dir}/ >/dev/null 2>&1")
        stop_serve(process)
        for p in started:
            if p.poll() is None:
                p.kill()


def _log_count(peer: Peer, *needles: str) -> int:
    """Lines of this peer's worker log that contain any of ``needles``."""
    logs = list((peer.config_dir / "logs").glob("*.log"))
    lines = "".join(log.read_text(errors="replace") for log in logs).splitlines()
    return sum(1 for line in lines if any(needle in line for needle in needles))

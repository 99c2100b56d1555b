"""The poisoned swarm's loss beside an honest one's: ``ulimit -n 4096; .venv/bin/python tests/perf/bench_poisoning.py``.

Three real hivemind peers on loopback train shapes-dalle (tiny) with the worker's optimizer, same seeds,
same samples (``tests/workers/poison_peer.py``). Runs, one after the other:

* ``honest``: nobody poisons;
* ``poisoned``: the third peer replaces every part it sends into averaging by NaN, 1e6 and +inf in turn,
  with the robust averaging of ``workers/robust.py`` on every peer;
* ``undefended`` (``--undefended``): the same poison against plain hivemind averaging, to show what the
  defence prevents.

Prints the mean loss of the two honest peers (peers 0 and 1) per window of steps for each run, side by
side, and the final figures. ``--mode gradients`` averages gradients instead of parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.workers.test_poisoning import run_swarm


def curve(peers: list[Any], window: int) -> list[float]:
    honest = [peer.losses() for peer in peers[:2]]
    length = min(len(losses) for losses in honest)
    points = []
    for start in range(0, length, window):
        chunk = [loss for losses in honest for loss in losses[start : start + window]]
        points.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--mode", default="local", choices=["local", "gradients", "diloco"])
    parser.add_argument("--poison", default="mixed", choices=["nan", "inf", "huge", "mixed"])
    parser.add_argument(
        "--undefended", action="store_true", help="also run the poison against plain hivemind"
    )
    args = parser.parse_args()
    runs: list[tuple[str, str | None, bool]] = [("honest", None, True), ("poisoned", args.poison, True)]
    if args.undefended:
        runs.append(("undefended", args.poison, False))
    curves: dict[str, list[float]] = {}
    finite: dict[str, bool] = {}
    for name, poison, defence in runs:
        started: list[subprocess.Popen[Any]] = []
        t0 = time.monotonic()
        try:
            peers = run_swarm(
                poison=poison, steps=args.steps, mode=args.mode, started=started, defence=defence
            )
        finally:
            for process in started:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
        curves[name] = curve(peers, args.window)
        finite[name] = all(peer.wait_line("done", 1)["finite_parameters"] for peer in peers[:2])
        print(
            f"# {name}: {time.monotonic() - t0:.0f} s, epochs {[p.wait_line('done', 1)['epoch'] for p in peers]}"
        )
    print(f"mode {args.mode}, poison {args.poison}, 3 peers, honest peers' mean loss per {args.window} steps")
    print("steps      " + "".join(f"{name:>12}" for name in curves))
    for i in range(max(len(c) for c in curves.values())):
        row = "".join(f"{(c[i] if i < len(c) else math.nan):>12.3f}" for c in curves.values())
        print(f"{i * args.window:>4}-{(i + 1) * args.window - 1:<5} {row}")
    for name, points in curves.items():
        print(
            f"{name}: first window {points[0]:.3f}, last {points[-1]:.3f}, finite parameters: {finite[name]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

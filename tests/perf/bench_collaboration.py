"""Benchmarks of collaboration on ``shapes-dalle tiny``, each with real peers on loopback.

    python tests/perf/bench_collaboration.py compression [--samples 6000]
    python tests/perf/bench_collaboration.py latency
    python tests/perf/bench_collaboration.py quality [--samples 30000]

* ``compression``: 2 peers train until they have seen ``--samples`` together, once per compression
  (none, fp16, 8bit): averaging bytes sent per trained sample, and the training loss reached.
* ``latency``: time from starting ``volunteer-app join`` (a fresh volunteer: registration, profiling,
  joining) to its first trained sample and to its first completed averaging round, joining a swarm
  that is already training.
* ``quality``: prompt accuracy of the shared model after ``--samples`` samples trained by 1 peer, and by
  2 peers (half each): collaboration must not cost quality.

Prints figures; asserts nothing. Peers run one thread each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import python_env, start_serve, stop_serve  # noqa: E402


class Peer:
    def __init__(self, url: str, run: str, name: str, root: Path, *extra: str):
        env = python_env(VOLUNTEER_BENCHMARK_SECONDS="2", VOLUNTEER_STATUS_INTERVAL="1")
        self.started = time.time()
        self.lines: list[dict[str, Any]] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "volunteer_app.cli", "join", "--coordinator", url, "--run", run, "--name", name,
             "--config-dir", str(root / name), "--listen-host", "127.0.0.1", "--max-threads", "1", "--json", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def last(self) -> dict[str, Any]:
        statuses = [line for line in self.lines if line.get("event") in ("status", "summary")]
        return statuses[-1] if statuses else {}

    def summary(self) -> dict[str, Any]:
        return next((line for line in self.lines if line.get("event") == "summary"), {})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)
        try:
            self.process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Swarm:
    """A coordinator with one run; peers join it."""

    def __init__(
        self, root: Path, *, target_batch_size: int, compression: str = "fp16", local_updates: bool = False
    ):
        self.root = root
        self.data = root / "data"
        self.started: list[Any] = []
        subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(self.data), "--name", "bench",
             "--task", "shapes-dalle", "--preset", "tiny", "--target-batch-size", str(target_batch_size),
             "--compression", compression, "--matchmaking-time", "2",
             *(["--local-updates", "--average-state-every", "1"] if local_updates else [])],
            check=True, env=python_env(), capture_output=True,
        )  # fmt: skip
        self.serve, self.url = start_serve(self.data, self.started, "--log-level", "warning")
        self.peers: list[Peer] = []

    def join(self, name: str, *extra: str) -> Peer:
        peer = Peer(self.url, "bench", name, self.root, *extra)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        stop_serve(self.serve)


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def compression(args: argparse.Namespace) -> None:
    print(f"compression: 2 peers, {args.samples} samples in total, target batch 512")
    for name in ("none", "fp16", "8bit"):
        root = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        swarm = Swarm(root, target_batch_size=512, compression=name)
        try:
            peers = [swarm.join(f"p{i}") for i in range(2)]
            wait(
                lambda peers=peers: sum(p.last().get("samples_total", 0) for p in peers) >= args.samples,
                900,
                "samples",
            )
            states = [p.last() for p in peers]
            samples = sum(s["samples_total"] for s in states)
            sent = sum(s["bytes_sent"] for s in states)
            rounds = min(s["averaging_rounds"] for s in states)
            loss = sum(s["loss"] for s in states) / len(states)
            print(
                f"  {name:<5} {sent / samples:9.0f} bytes/sample  ({sent / 2**20:.1f} MiB over {rounds} rounds)   "
                f"training loss {loss:.3f} at {samples} samples"
            )
        finally:
            swarm.close()
            shutil.rmtree(root, ignore_errors=True)


def latency(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    swarm = Swarm(root, target_batch_size=256)
    try:
        first = swarm.join("first")
        wait(
            lambda: (
                first.last().get("averaging_rounds", 0) >= 0 and first.last().get("samples_total", 0) > 500
            ),
            300,
            "the first peer",
        )
        for attempt in range(args.repeats):
            newcomer = swarm.join(f"newcomer{attempt}")
            wait(
                lambda p=newcomer: p.last().get("first_round_at") is not None,
                300,
                "the newcomer's first round",
            )
            s = newcomer.last()
            print(
                f"  join -> first sample {s['first_sample_at'] - newcomer.started:5.1f} s,  "
                f"-> first averaging round {s['first_round_at'] - newcomer.started:5.1f} s  "
                f"(loaded the swarm's state at epoch {s['loaded_state_epoch']})"
            )
            newcomer.stop()
    finally:
        swarm.close()
        shutil.rmtree(root, ignore_errors=True)


def quality(args: argparse.Namespace) -> None:
    mode = "local updates, parameters averaged" if args.local_updates else "gradients averaged"
    print(
        f"prompt accuracy after {args.samples} samples ({mode} every {args.target_batch_size} samples; "
        "greedy decoding of held-out prompts):"
    )
    for peers in (1, 2):
        root = Path(tempfile.mkdtemp(prefix=f"bench-quality-{peers}-"))
        swarm = Swarm(root, target_batch_size=args.target_batch_size, local_updates=args.local_updates)
        try:
            per_peer = args.samples // peers
            joined = [swarm.join(f"p{i}", "--samples", str(per_peer), "--evaluate") for i in range(peers)]
            wait(lambda joined=joined: all(p.summary() for p in joined), 3600, "training to finish")
            metrics = [p.summary()["eval_metrics"] for p in joined]
            samples = sum(p.summary()["samples_total"] for p in joined)
            accuracy = sum(m.get("prompt_accuracy", 0.0) for m in metrics) / len(metrics)
            loss = sum(m.get("loss", 0.0) for m in metrics) / len(metrics)
            print(
                f"  {peers} peer(s): prompt accuracy {accuracy:.3f}, held-out loss {loss:.3f} "
                f"({samples} samples trained)"
            )
        finally:
            swarm.close()
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which", required=True)
    c = sub.add_parser("compression")
    c.add_argument("--samples", type=int, default=6000)
    la = sub.add_parser("latency")
    la.add_argument("--repeats", type=int, default=2)
    q = sub.add_parser("quality")
    q.add_argument("--samples", type=int, default=30000)
    q.add_argument("--target-batch-size", type=int, default=512)
    q.add_argument("--local-updates", action="store_true", help="local optimizer steps, parameter averaging")
    args = parser.parse_args()
    {"compression": compression, "latency": latency, "quality": quality}[args.which](args)


if __name__ == "__main__":
    # `timeout` and CI send SIGTERM: unwind through the cleanup code instead of leaving peers behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()

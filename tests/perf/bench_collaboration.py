"""Benchmarks of collaboration on ``shapes-dalle tiny``, each with real peers on loopback.

    python tests/perf/bench_collaboration.py compression [--samples 6000]
    python tests/perf/bench_collaboration.py latency
    python tests/perf/bench_collaboration.py quality [--samples 120000] [--mode diloco|local|gradients]
    python tests/perf/bench_collaboration.py leave [--modes local gradients]

* ``compression``: 2 peers train until they have seen ``--samples`` together, once per compression
  (none, fp16, 8bit): averaging bytes sent per trained sample, and the training loss reached.
* ``latency``: time from starting ``volunteer-app join`` (a fresh volunteer: registration, profiling,
  joining) to its first trained sample and to its first completed averaging round, joining a swarm
  that is already training.
* ``quality``: the learning curve (prompt accuracy on ``--eval-prompts`` held-out captions, greedy
  decoding, against samples trained) of one plain process trained alone (``bench_learning.py single``,
  the same task config) and of a 2-peer swarm with the coordinator's default run settings (or
  ``--mode``/``--target-batch-size``), side by side at an equal sample budget. The swarm's curve comes
  from the coordinator's own checkpoints, copied as they appear and evaluated after training (so the
  evaluation takes no CPU from the peers), plus each peer's final evaluation.
* ``leave``: per update mode, 3 peers train; one is killed (SIGKILL, no goodbye) while the other two are
  in an averaging round; how long the survivors go without a completed round, how many rounds fail,
  and their samples/s in the 60 s before and after.

Prints figures; asserts nothing. Peers run one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
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
            [sys.executable, "-m", "volunteer_app.cli", "join", "--foreground", "--coordinator", url, "--run", run, "--name", name,
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


def parse_config(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as a dict, each value parsed as JSON when it can be."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


class Swarm:
    """A coordinator with one run (created over the API, as the dashboard does); peers join it.

    :param config: task config fields (``preset`` defaults to tiny); :param optimizer: the run's
      ``OptimizerSettings`` fields (the coordinator's defaults otherwise); :param env: extra environment
      for ``serve``.
    """

    def __init__(
        self,
        root: Path,
        *,
        config: dict[str, Any] | None = None,
        optimizer: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ):
        import httpx

        self.root = root
        self.data = root / "data"
        self.started: list[Any] = []
        # init first: tests.conftest.start_serve reads serve's output line by line behind select(), and a
        # first serve that also creates the data dir prints two lines at once (the second one is then missed)
        subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "init", "--data-dir", str(self.data)],
            check=True, env=python_env(), capture_output=True,
        )  # fmt: skip
        self.serve, self.url = start_serve(
            self.data, self.started, "--log-level", "warning", env=python_env(**(env or {})), timeout=240
        )
        admin = (self.data / "admin-token").read_text().strip()
        body = {
            "name": "bench",
            "task": "shapes-dalle",
            "task_config": {"preset": "tiny", **(config or {})},
            "optimizer": optimizer or {},
        }
        created = httpx.post(
            f"{self.url}/api/v1/runs", json=body, headers={"Authorization": f"Bearer {admin}"}, timeout=30
        )
        if created.status_code != 201:
            raise SystemExit(f"could not create the run: {created.text}")
        self.run = created.json()
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
        swarm = Swarm(
            root, optimizer={"target_batch_size": 512, "grad_compression": name, "state_compression": name}
        )
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
    swarm = Swarm(root, optimizer={"target_batch_size": 256})
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


def _archive_checkpoints(source: Path, archive: Path, stop: threading.Event) -> None:
    """Copy every new intact checkpoint directory from ``source`` into ``archive`` until ``stop``."""
    archive.mkdir(parents=True, exist_ok=True)
    while not stop.is_set():
        if source.is_dir():
            for entry in source.iterdir():
                if entry.name.startswith("epoch-") and not entry.name.endswith(".corrupt"):
                    target = archive / entry.name
                    if not target.exists() and (entry / "manifest.json").exists():
                        try:
                            shutil.copytree(entry, target)
                        except (OSError, shutil.Error):
                            shutil.rmtree(target, ignore_errors=True)  # pruned while copying: skip it
        stop.wait(2.0)


def _evaluate_archive(archive: Path, eval_prompts: int) -> list[tuple[int, float, float]]:
    """(samples, prompt accuracy, held-out loss) of every archived checkpoint, evaluated now."""
    import torch

    from coordinator.checkpoints import CheckpointStore
    from coordinator.swarm.checkpointer import build_model_for, load_model_file

    torch.set_num_threads(2)
    curve = []
    for info in sorted(CheckpointStore(archive).valid(), key=lambda i: i.epoch):
        manifest = dict(info.manifest)
        manifest["task_config"] = {**manifest["task_config"], "eval_prompts": eval_prompts}
        runtime, model = build_model_for(manifest)
        load_model_file(model, info.path / "model.safetensors")
        metrics = runtime.evaluate(model)
        curve.append((int(manifest["samples"]), metrics["prompt_accuracy"], metrics["loss"]))
    return curve


def _first_reaching(curve: list[tuple[int, float, float]], target: float) -> int | None:
    return next((samples for samples, accuracy, _ in curve if accuracy >= target), None)


def quality(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    config = {"preset": "tiny", **parse_config(args.config)}
    print(
        f"learning curves, {args.samples} samples in all, prompt accuracy on {args.eval_prompts} held-out "
        f"captions (greedy); task config {config}"
    )
    try:
        # 1. one plain process, alone (no hivemind), the same task config (or its curve from an earlier run)
        plain_log = args.plain_log or root / "plain.jsonl"
        done = plain_log.exists() and any('"summary"' in line for line in plain_log.read_text().splitlines())
        started = time.monotonic()
        if done:
            print(f"  (the plain process's curve is read from {plain_log})")
        else:
            plain_log.unlink(missing_ok=True)
            subprocess.run(
                [sys.executable, str(REPO / "tests" / "perf" / "bench_learning.py"), "single", "--samples",
                 str(args.samples), "--eval-every", str(args.eval_every), "--eval-prompts", str(args.eval_prompts),
                 "--threads", "1", "--out", str(plain_log), "--config", *args.config],
                check=True, env=python_env(), stdout=subprocess.DEVNULL,
            )  # fmt: skip
        plain_seconds = time.monotonic() - started
        lines = [json.loads(line) for line in plain_log.read_text().splitlines()]
        plain = [(r["samples"], r["prompt_accuracy"], r["loss"]) for r in lines if "prompt_accuracy" in r]

        # 2. a 2-peer swarm with the coordinator's default settings (unless told otherwise)
        optimizer: dict[str, Any] = {}
        if args.mode:
            optimizer["update_mode"] = args.mode
        if args.target_batch_size:
            optimizer["target_batch_size"] = args.target_batch_size
        swarm = Swarm(
            root / "swarm",
            config={**parse_config(args.config), "eval_prompts": 16, "eval_samples": 64},
            optimizer=optimizer,
            env={"VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL": str(args.checkpoint_interval)},
        )
        archive, stop = root / "archive", threading.Event()
        copier = threading.Thread(
            target=_archive_checkpoints,
            args=(swarm.data / "checkpoints" / "bench", archive, stop),
            daemon=True,
        )
        copier.start()
        try:
            per_peer = args.samples // 2
            started = time.monotonic()
            joined = [swarm.join(f"p{i}", "--samples", str(per_peer), "--evaluate") for i in range(2)]
            wait(lambda: all(p.summary() for p in joined), 6 * 3600, "training to finish")
            swarm_seconds = time.monotonic() - started
            summaries = [p.summary() for p in joined]
        finally:
            time.sleep(args.checkpoint_interval + 5)  # the swarm peer's last checkpoint of the final state
            stop.set()
            copier.join()
            swarm.close()
        curve = _evaluate_archive(archive, args.eval_prompts)
        samples = sum(s["samples_total"] for s in summaries)
        sent = sum(s["bytes_sent"] for s in summaries)
        final = [s.get("eval_metrics") or {} for s in summaries]

        print(f"  one process alone ({plain_seconds:.0f} s, 1 thread):")
        for n, accuracy, loss in plain:
            print(f"    {n:>7} samples  accuracy {accuracy:.3f}  loss {loss:.3f}")
        print(
            f"  2-peer swarm ({swarm_seconds:.0f} s, 1 thread each; {sent / max(1, samples):.0f} bytes sent/sample):"
        )
        for n, accuracy, loss in curve:
            print(f"    {n:>7} samples  accuracy {accuracy:.3f}  loss {loss:.3f}  (checkpoint)")
        finals = ", ".join(f"{m.get('prompt_accuracy', float('nan')):.3f}" for m in final)
        print(f"    {samples:>7} samples  final evaluation of each peer's model: accuracy {finals}")
        for target in (0.5, 0.8):
            print(
                f"  samples to reach accuracy {target}: one process {_first_reaching(plain, target)}, "
                f"swarm {_first_reaching(curve, target)}"
            )
        if plain and curve:
            budget_plain = plain[-1]
            budget_swarm = max(curve, key=lambda point: point[0])
            print(
                f"  at the budget: one process {budget_plain[1]:.3f} ({budget_plain[0]} samples), swarm "
                f"{budget_swarm[1]:.3f} ({budget_swarm[0]} samples): difference "
                f"{100 * (budget_swarm[1] - budget_plain[1]):+.1f} points"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _leave_once(mode: str) -> str:
    root = Path(tempfile.mkdtemp(prefix=f"bench-leave-{mode}-"))
    swarm = Swarm(root, optimizer={"update_mode": mode} if mode != "default" else {})
    try:
        peers = [swarm.join(f"p{i}") for i in range(3)]
        wait(lambda: all(p.last().get("averaging_rounds", 0) >= 3 for p in peers), 900, "rounds")
        victim, survivors = peers[0], peers[1:]
        # kill the victim just after a survivor's round count moved: the next round is being formed
        rounds = survivors[0].last()["averaging_rounds"]
        wait(lambda: survivors[0].last()["averaging_rounds"] > rounds, 300, "a round")
        before = [(p.last()["samples_total"], p.last()["failed_rounds"]) for p in survivors]
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.killpg(victim.process.pid, signal.SIGKILL)
        start_rounds = [p.last()["averaging_rounds"] for p in survivors]

        def survivors_averaged() -> bool:
            return all(p.last()["averaging_rounds"] > r for p, r in zip(survivors, start_rounds, strict=True))

        wait(survivors_averaged, 600, "a completed round after the kill")
        recovered = time.monotonic() - killed_at
        time.sleep(max(0.0, 60 - recovered))
        after = [(p.last()["samples_total"], p.last()["failed_rounds"]) for p in survivors]
        elapsed = time.monotonic() - killed_at
        rate = sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) / elapsed
        failed = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        return (
            f"  {mode:<9} survivors' next completed round {recovered:5.1f} s after the kill; {failed} failed "
            f"round(s); {rate:.0f} samples/s for both survivors in the minute after"
        )
    finally:
        swarm.close()
        shutil.rmtree(root, ignore_errors=True)


def leave(args: argparse.Namespace) -> None:
    print("a peer leaving mid-round: 3 peers, one killed while the others average (SIGKILL, no goodbye)")
    for mode in args.modes:
        print(_leave_once(mode), flush=True)


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
    q.add_argument(
        "--samples", type=int, default=120_000, help="samples in all (the swarm's peers: half each)"
    )
    q.add_argument(
        "--eval-every", type=int, default=10_000, help="samples between the plain process's evaluations"
    )
    q.add_argument("--eval-prompts", type=int, default=256, help="held-out captions drawn per evaluation")
    q.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="task config for both")
    q.add_argument(
        "--mode", choices=["gradients", "local", "diloco"], default=None, help="default: the run default"
    )
    q.add_argument("--target-batch-size", type=int, default=None, help="default: the run default")
    q.add_argument(
        "--checkpoint-interval", type=float, default=20.0, help="seconds between swarm checkpoints"
    )
    q.add_argument(
        "--plain-log",
        type=Path,
        default=None,
        help="keep the plain process's curve here (reused when complete)",
    )
    lv = sub.add_parser("leave")
    lv.add_argument("--modes", nargs="+", default=["default"], help="update modes (default: the run default)")
    args = parser.parse_args()
    {"compression": compression, "latency": latency, "quality": quality, "leave": leave}[args.which](args)


if __name__ == "__main__":
    # `timeout` and CI send SIGTERM: unwind through the cleanup code instead of leaving peers behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()

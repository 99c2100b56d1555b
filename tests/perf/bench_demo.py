"""Speed to quality: how soon after ``volunteer-app demo`` starts does the swarm's model draw well?

    python tests/perf/bench_demo.py                      # the default demo (its default duration)
    python tests/perf/bench_demo.py --duration 840 --preset tiny   # the runs' model, 15 minutes
    python tests/perf/bench_demo.py --config lr=3e-3 --keep        # another peak rate; keep the logs

Runs the demo exactly as ``volunteer-app demo --json`` does (a coordinator on loopback and N local peers
with the coordinator's default run settings), copies every checkpoint the coordinator's swarm peer saves
while it runs, and afterwards evaluates each on ``--eval-prompts`` held-out captions (greedy decoding),
so the evaluation takes no CPU from the peers. Prints prompt accuracy against wall time since the demo
started, when it first reached ``--target``, the demo's own final figures, and how busy the machine was
(the load average, and the CPU that processes outside the demo took: this machine is shared, and
wall-clock figures are only comparable at similar load), and where the demo's own CPU went: the peers'
training loops against hivemind's helper processes, p2pd and the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.perf.bench_collaboration import _archive_checkpoints  # noqa: E402

ROLES = (
    "training loops",
    "workers' hivemind processes (DHT, averagers)",
    "p2pd daemons",
    "coordinator (API, swarm peer)",
    "the demo and its agents",
)


def _role(info: dict[str, Any], parent: dict[str, Any] | None) -> str:
    """Which part of the demo a process of its tree is (ROLES)."""
    command = " ".join(info.get("cmdline") or [info.get("name") or ""])
    parent_command = " ".join((parent or {}).get("cmdline") or [])
    if (info.get("name") or "").startswith("p2pd") or "/p2pd" in command:
        return ROLES[2]
    if "workers.worker" in command:
        return ROLES[1] if "workers.worker" in parent_command else ROLES[0]
    if "coordinator." in command or "coordinator." in parent_command:
        return ROLES[3]
    return ROLES[4]


class LoadMeter:
    """Samples the load average, the CPU used by processes outside this one's tree, and the CPU each part
    of the demo takes (``ROLES``: the training loops against what hivemind and the coordinator cost)."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self.loads: list[float] = []
        self.others: list[float] = []
        self.by_role: dict[str, float] = dict.fromkeys(ROLES, 0.0)
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ours(self) -> set[int]:
        import psutil

        me = psutil.Process()
        return {me.pid, *(p.pid for p in me.children(recursive=True))}

    def _snapshot(self) -> dict[int, dict[str, Any]]:
        import psutil

        procs = {}
        for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "cpu_times"]):
            if proc.info.get("cpu_times") is not None:
                procs[proc.info["pid"]] = proc.info
        return procs

    def _run(self) -> None:
        before, at = self._snapshot(), time.monotonic()
        while not self._stop.wait(self.interval):
            now, now_at = self._snapshot(), time.monotonic()
            ours = self._ours()
            used = 0.0
            for pid, info in now.items():
                cpu = info["cpu_times"].user + info["cpu_times"].system
                old = before.get(pid)
                delta = cpu - (old["cpu_times"].user + old["cpu_times"].system) if old else 0.0
                if pid in ours:
                    self.by_role[_role(info, now.get(info["ppid"]))] += delta
                else:
                    used += delta
            self.others.append(used / (now_at - at))
            self.loads.append(os.getloadavg()[0])
            self.seconds += now_at - at
            before, at = now, now_at

    def __enter__(self) -> LoadMeter:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def add_demo_arguments(parser: argparse.ArgumentParser, *, duration_help: str) -> None:
    """The options of the demo a benchmark runs (this one's and ``bench_quality.py``'s)."""
    parser.add_argument("--duration", type=float, default=None, help=duration_help)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--preset", default=None, help="the demo's model preset (default: the demo's)")
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument(
        "--config", nargs="*", default=[], metavar="KEY=VALUE", help="task config overrides, e.g. lr=3e-3"
    )
    parser.add_argument("--keep", action="store_true", help="keep the demo's directory (logs, checkpoints)")
    parser.add_argument("--target-batch-size", type=int, default=None, help="samples per averaging round")
    parser.add_argument(
        "--run-args",
        default="",
        help="more `volunteer-coordinator runs create` arguments, e.g. '--matchmaking-time 1 --compression none'",
    )


def demo_options(args: argparse.Namespace, root: Path) -> Any:
    """The ``DemoOptions`` that ``args`` (``add_demo_arguments``) ask for, writing under ``root``."""
    from volunteer_app.demo import DemoOptions

    options = DemoOptions(
        peers=args.peers,
        json=True,
        data_dir=root / "demo",
        drawings_path=root / "drawings.png",
        task_config=dict(item.split("=", 1) for item in args.config),
        target_batch_size=args.target_batch_size,
        run_args=shlex.split(args.run_args),
    )
    if args.duration is not None:
        options.duration = args.duration
    if args.preset is not None:
        options.preset = args.preset
    return options


def run_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the demo as ``args`` say, archive every checkpoint its coordinator saves, then evaluate each one.

    Returns what ``report`` prints: the demo's summary, the checkpoints' curve (``at`` seconds after the
    start, ``samples``, ``accuracy``, ``loss``, ``peers``, ``spread``), when ``args.target`` was first
    reached, the load figures, and the last checkpoint's task config (the run's exact schedule)."""
    import torch

    from coordinator.checkpoints import CheckpointStore
    from coordinator.swarm.checkpointer import build_model_for, load_model_file
    from volunteer_app.demo import RUN, run_demo

    root = Path(tempfile.mkdtemp(prefix="bench-demo-"))
    options = demo_options(args, root)
    archive, stop = root / "archive", threading.Event()
    source = root / "demo" / "coordinator" / "checkpoints" / RUN
    copier = threading.Thread(target=_archive_checkpoints, args=(source, archive, stop), daemon=True)
    copier.start()
    started_wall = time.time()
    started = time.monotonic()
    try:
        with LoadMeter() as load:
            summary = run_demo(options)
        total = time.monotonic() - started
    finally:
        stop.set()
        copier.join()
    torch.set_num_threads(2)
    reached = None
    curve: list[dict[str, Any]] = []
    task_config: dict[str, Any] = {}
    for info in sorted(CheckpointStore(archive).valid(), key=lambda i: i.epoch):
        manifest = dict(info.manifest)
        task_config = dict(manifest["task_config"])
        manifest["task_config"] = {**manifest["task_config"], "eval_prompts": args.eval_prompts}
        runtime, model = build_model_for(manifest)
        load_model_file(model, info.path / "model.safetensors")
        metrics = runtime.evaluate(model)
        # the checkpoint holds the state the swarm peer downloaded just before saved_at
        at = float(manifest["saved_at"]) - started_wall - float(manifest.get("evaluation_seconds") or 0.0)
        curve.append(
            {
                "at": at,
                "samples": int(manifest["samples"]),
                "accuracy": float(metrics["prompt_accuracy"]),
                "loss": float(metrics["loss"]),
                "peers": int(manifest.get("averaged_peers") or 1),
                "spread": manifest.get("peer_spread"),
            }
        )
        if reached is None and metrics["prompt_accuracy"] >= args.target:
            reached = at
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "options": options,
        "summary": summary,
        "total": total,
        "curve": curve,
        "reached": reached,
        "loads": list(load.loads),
        "others": list(load.others),
        "by_role": dict(load.by_role),
        "seconds": load.seconds,
        "task_config": task_config,
        "root": root,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print what ``run_and_evaluate`` measured."""
    options, summary = result["options"], result["summary"]
    print(
        f"\ndemo: {args.peers} peers, preset {options.preset}, {options.duration:.0f} s of training, "
        f"{result['total']:.0f} s from start to summary"
    )
    print(
        f"  final: prompt accuracy {summary.get('prompt_accuracy')} ({summary.get('drawings_from')}), "
        f"showcase prompts "
        f"drawn right {summary.get('drawings_correct')}, {summary.get('samples')} samples, averaging rounds "
        f"{summary.get('averaging_rounds')} ({summary.get('failed_rounds')} failed; the busiest peer's count)"
    )
    print(f"  prompt accuracy of the swarm's checkpoints on {args.eval_prompts} held-out captions:")
    for point in result["curve"]:
        whose = f"mean of {point['peers']} peers" if point["peers"] > 1 else "one peer's model"
        spread = point["spread"]
        print(
            f"    {point['at']:6.0f} s  {point['samples']:>7} samples  accuracy {point['accuracy']:.3f}  "
            f"loss {point['loss']:.3f}  {whose}" + (f" (spread {spread:.4f})" if spread is not None else "")
        )
    reached = result["reached"]
    print(
        f"  first reached {args.target}: {'never' if reached is None else f'{reached:.0f} s after the start'}"
    )
    loads, others = result["loads"], result["others"]
    if loads:
        print(
            f"  machine: load average {sum(loads) / len(loads):.1f} on {os.cpu_count()} CPUs; processes "
            f"outside the demo used {sum(others) / len(others):.2f} CPUs on average"
        )
    if result["seconds"]:
        print(f"  the demo's CPU, in cores, averaged over {result['seconds']:.0f} s from start to summary:")
        for role in ROLES:
            print(f"    {result['by_role'][role] / result['seconds']:5.2f}  {role}")
    print(
        json.dumps({"summary": {k: v for k, v in summary.items() if k != "drawings"}, "reached_at": reached})
    )
    if args.keep:
        print(f"kept: {result['root']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_demo_arguments(parser, duration_help="training seconds (default: the demo's)")
    args = parser.parse_args()
    report(run_and_evaluate(args), args)


if __name__ == "__main__":
    main()

"""``volunteer-app demo``: a whole swarm on this machine in one command.

It starts a coordinator on loopback with a temporary data directory (``volunteer-coordinator serve``
in a child process), creates a ``shapes-dalle`` run, then runs N agents exactly as volunteers run
them (each registers, profiles, joins, and trains in its own worker process with its own hivemind
peer), and shows them train together. At the end the first peer evaluates the shared model and a
summary is printed (``--json``: peers, samples, averaging rounds, loss at start and end, prompt
accuracy). The temporary directory is removed afterwards unless ``--keep`` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from volunteer_app.settings import AgentSettings
from volunteer_app.supervisor import Agent, AgentError, AgentStatus

RUN = "shapes-demo"


class DemoError(Exception):
    pass


@dataclass
class DemoOptions:
    peers: int = 2
    duration: float = 90.0
    json: bool = False
    keep: bool = False
    preset: str = "tiny"
    target_batch_size: int = 512
    threads: int | None = None
    data_dir: Path | None = None
    port: int = 0


class Coordinator:
    """A ``volunteer-coordinator serve`` child process on loopback."""

    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.log_path = data_dir / "serve.log"

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.cli", *args],
            capture_output=True,
            text=True,
            env=self._env(),
            check=False,
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL", "2")
        env.setdefault("VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL", "30")
        env.setdefault("VOLUNTEER_COORDINATOR_LIMITS__REGISTER_PER_MINUTE", "600")
        env.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
        return env

    def create_run(self, *, preset: str, target_batch_size: int) -> None:
        result = self._cli(
            "runs", "create", "--data-dir", str(self.data_dir), "--name", RUN, "--task", "shapes-dalle",
            "--preset", preset, "--target-batch-size", str(target_batch_size), "--matchmaking-time", "2",
            "--averaging-timeout", "30", "--description", "the volunteer-app demo run",
            # Local updates: every peer takes an optimizer step per 64 samples and the swarm averages the
            # parameters every epoch. A short demo then learns visibly (tests/perf/bench_collaboration.py
            # quality, 2 peers, 30k samples: held-out loss 0.99 vs 1.70 with gradient averaging).
            "--local-updates", "--average-state-every", "1",
        )  # fmt: skip
        if result.returncode != 0:
            raise DemoError(f"could not create the demo run: {result.stderr.strip()}")

    def start(self, timeout: float = 60.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - the child writes to it until stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(self.data_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=self._env(), start_new_session=True,
        )  # fmt: skip
        log.close()
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.5)
            if ready:
                line = self.process.stdout.readline()
                if "serving at " in line:
                    self.url = line.split("serving at ", 1)[1].split()[0]
                    return self.url
            if self.process.poll() is not None:
                break
        raise DemoError(f"the coordinator did not start; see {self.log_path}")

    def wait_for_swarm(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(f"{self.url}/api/v1/runs/{RUN}", timeout=5).json()["initial_peers"]:
                    return
            time.sleep(0.5)
        raise DemoError(
            f"the run's swarm peer did not come up; see {self.data_dir / 'swarm' / (RUN + '.log')}"
        )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            self.process.kill()


def _threads_per_peer(peers: int, requested: int | None) -> int:
    if requested:
        return requested
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    return max(1, cores // peers)


def _messenger(out: Any, who: str) -> Callable[[str], None]:
    return lambda text: out.message(text, who=who)


async def _run_agents(options: DemoOptions, url: str, root: Path, out: Any) -> list[AgentStatus]:
    threads = _threads_per_peer(options.peers, options.threads)
    agents = []
    for i in range(options.peers):
        settings = AgentSettings(
            config_dir=root / f"peer-{i}",
            max_threads=threads,
            listen_host="127.0.0.1",
            benchmark_seconds=2.0,
            device="auto",
        )
        name = f"peer-{i}"
        agents.append(
            Agent(
                settings=settings,
                coordinator=url,
                run=RUN,
                name=name,
                duration=options.duration,
                evaluate_on_stop=i == 0,
                on_message=_messenger(out, name),
            )
        )
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for agent in agents:
            agent.request_stop("interrupted")

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, stop_all)
        loop.add_signal_handler(signal.SIGTERM, stop_all)
    tasks = [asyncio.create_task(agent.run()) for agent in agents]
    while not all(t.done() for t in tasks):
        statuses = [a.status for a in agents]
        footer = f"coordinator {url}  ·  dashboard {url}/dashboard/  ·  Ctrl-C stops"
        if hasattr(out, "update"):
            out.update(statuses, footer)
        else:
            out.status(statuses)
        await asyncio.sleep(0.5)
    errors = []
    for agent, task in zip(agents, tasks, strict=True):
        exc = task.exception()
        if isinstance(exc, AgentError):
            errors.append(f"{agent.name}: {exc}")
        elif exc is not None:
            raise exc
    if errors:
        raise DemoError("; ".join(errors))
    return [a.status for a in agents]


def summarize(statuses: list[AgentStatus], coordinator_url: str, seconds: float) -> dict[str, Any]:
    evaluated = next((s.eval_metrics for s in statuses if s.eval_metrics), {})
    losses_start = [s.first_loss for s in statuses if s.first_loss is not None]
    losses_end = [s.loss for s in statuses if s.loss is not None]
    return {
        "peers": len(statuses),
        "seconds": round(seconds, 1),
        "samples": sum(s.samples_total for s in statuses),
        "samples_credited": sum(s.samples_credited for s in statuses),
        "samples_per_second": round(sum(s.samples_total for s in statuses) / max(1.0, seconds), 1),
        "averaging_rounds": max((s.averaging_rounds for s in statuses), default=0),
        "global_epoch": max((s.global_epoch for s in statuses), default=0),
        "loss_start": round(sum(losses_start) / len(losses_start), 4) if losses_start else None,
        "loss_end": round(sum(losses_end) / len(losses_end), 4) if losses_end else None,
        "eval_loss": evaluated.get("loss"),
        "prompt_accuracy": evaluated.get("prompt_accuracy"),
        "bytes_sent": sum(s.bytes_sent for s in statuses),
        "coordinator": coordinator_url,
    }


def run_demo(options: DemoOptions) -> dict[str, Any]:
    from volunteer_app.display import JsonLines, LiveDisplay

    if options.peers < 1:
        raise DemoError("--peers must be at least 1")
    if options.duration <= 0:
        raise DemoError("--duration must be positive")
    root = options.data_dir or Path(tempfile.mkdtemp(prefix="volunteer-demo-"))
    coordinator = Coordinator(root / "coordinator", options.port)
    out: Any = (
        JsonLines()
        if options.json
        else LiveDisplay(f"volunteer-app demo · {options.peers} peers · shapes-dalle ({options.preset})")
    )
    started = time.monotonic()
    try:
        out.message(f"starting a coordinator on loopback (data in {root})")
        coordinator.create_run(preset=options.preset, target_batch_size=options.target_batch_size)
        url = coordinator.start()
        coordinator.wait_for_swarm()
        out.message(f"coordinator ready at {url}; dashboard at {url}/dashboard/")
        if options.json:
            statuses = asyncio.run(_run_agents(options, url, root, out))
        else:
            with out:
                statuses = asyncio.run(_run_agents(options, url, root, out))
        summary = summarize(statuses, url, time.monotonic() - started)
    finally:
        coordinator.stop()
        if not options.keep and options.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if options.json:
        out.emit("summary", **summary)
    else:
        print_summary(summary)
    return summary


def _loss_range(start: float | None, end: float | None) -> str | None:
    if start is None or end is None:
        return None
    return f"{start:.3f} → {end:.3f}"


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="demo summary", show_header=False)
    rows = [
        ("peers", summary["peers"]),
        ("samples trained", f"{summary['samples']} in {summary['seconds']:.0f} s, start-up included"),
        ("samples credited", summary["samples_credited"]),
        ("averaging rounds", summary["averaging_rounds"]),
        ("loss", _loss_range(summary["loss_start"], summary["loss_end"])),
        ("held-out loss", None if summary["eval_loss"] is None else round(summary["eval_loss"], 3)),
        (
            "prompt accuracy",
            None if summary["prompt_accuracy"] is None else f"{summary['prompt_accuracy']:.1%}",
        ),
    ]
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)

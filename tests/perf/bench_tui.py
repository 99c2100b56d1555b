"""What the app costs while the agent trains: the app's own CPU, and the worker's throughput with the app
attached against without, side by side in one run.

    python tests/perf/bench_tui.py [--seconds 90] [--rounds 2] [--screen contribute] [--size 120x40]

A coordinator and an agent training ``shapes-dalle tiny`` on one thread run on
loopback. Then, in ``--rounds`` rounds of four windows ordered without / with / with / without (so that
drift cancels out), the worker's samples/s is measured from the agent's counters, and in the "with"
windows the installed ``volunteer-app`` runs in a real terminal (tmux, ``--size``) on ``--screen``, its
process's CPU read with psutil. Targets: the app under 3 % of one core; samples/s with the app at least
0.98 of without. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import python_env, start_serve, stop_serve  # noqa: E402
from volunteer_app.control import JoinCommand, SettingsCommand  # noqa: E402
from volunteer_app.control_client import AgentConnection, get_state, locate_agent  # noqa: E402
from volunteer_app.settings import AgentSettings  # noqa: E402

KEYS = {"contribute": "1", "model": "2", "leaderboard": "3", "machine": "4", "settings": "5", "log": "6"}


def call(settings: AgentSettings, *commands: Any) -> None:
    async def run() -> None:
        async with AgentConnection(locate_agent(settings)) as agent:
            for command in commands:
                await agent.call(command, timeout=600)

    asyncio.run(run())


def samples(settings: AgentSettings) -> int:
    state = get_state(locate_agent(settings))
    assert state.contribution is not None
    return state.contribution.samples_total


class TerminalApp:
    """``volunteer-app`` in a tmux session; ``process`` is the app's own Python process."""

    def __init__(self, env: dict[str, str], size: tuple[int, int]):
        self.base = ["tmux", "-L", f"bench-tui-{uuid.uuid4().hex[:8]}"]
        app = Path(sys.executable).parent / "volunteer-app"
        exports = " ".join(f"{k}='{v}'" for k, v in env.items())
        subprocess.run(
            [*self.base, "-f", os.devnull, "new-session", "-d", "-s", "app", "-x", str(size[0]), "-y", str(size[1]),
             f"env {exports} {app}; sleep 600"],
            check=True, env={**os.environ, "TERM": "xterm-256color"},
        )  # fmt: skip
        self.process = self._find()

    def _find(self) -> psutil.Process:
        pane = int(subprocess.run([*self.base, "display", "-p", "-t", "app", "#{pane_pid}"],
                                  capture_output=True, text=True, check=True).stdout)  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for proc in [psutil.Process(pane), *psutil.Process(pane).children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    command = proc.cmdline()
                    # the app's own Python (not the shell that started it)
                    if "python" in Path(command[0]).name and any(
                        p.endswith("volunteer-app") for p in command
                    ):
                        return proc
            time.sleep(0.1)
        raise RuntimeError(f"the app did not start:\n{self.screen()}")

    def screen(self) -> str:
        return subprocess.run(
            [*self.base, "capture-pane", "-p", "-t", "app"], capture_output=True, text=True
        ).stdout

    def wait(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.screen():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the app never showed {text!r}:\n{self.screen()}")
            time.sleep(0.2)

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "app", *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


def window(settings: AgentSettings, seconds: float, app: TerminalApp | None) -> tuple[float, float | None]:
    """Samples/s of the worker over ``seconds`` and, with an app, the app's CPU in % of one core."""
    cpu_before = app.process.cpu_times() if app is not None else None
    start_samples, start = samples(settings), time.monotonic()
    time.sleep(seconds)
    end_samples, elapsed = samples(settings), time.monotonic() - start
    cpu = None
    if app is not None and cpu_before is not None:
        after = app.process.cpu_times()
        cpu = 100 * ((after.user - cpu_before.user) + (after.system - cpu_before.system)) / elapsed
    return (end_samples - start_samples) / elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each measuring window")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of without/with/with/without windows")
    parser.add_argument(
        "--screen", choices=sorted(KEYS), default="contribute", help="the screen the app shows"
    )
    parser.add_argument("--size", default="120x40", help="terminal size, COLUMNSxROWS")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of training before measuring")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("this benchmark runs the app in tmux: apt-get install tmux")
    size = tuple(int(v) for v in args.size.lower().split("x"))
    root = Path(tempfile.mkdtemp(prefix="bench-tui-"))
    data = root / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=256"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    serve, url = start_serve(data, started, env=python_env())
    settings = AgentSettings(config_dir=root / "volunteer")
    env = {"VOLUNTEER_CONFIG_DIR": str(settings.config_dir), "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", "agent", "--background", "--listen-host", "127.0.0.1"],
        check=True, env=python_env(**env, VOLUNTEER_BENCHMARK_SECONDS="2"), capture_output=True,
    )  # fmt: skip
    agent_pid = locate_agent(settings).pid
    try:
        call(
            settings,
            SettingsCommand(values={"max_threads": 1}),
            JoinCommand(coordinator=url, run="shapes", name="bench"),
        )
        deadline = time.monotonic() + 300
        while samples(settings) == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the agent did not start training")
            time.sleep(0.5)
        print(f"training; warming up for {args.warmup:.0f} s", flush=True)
        time.sleep(args.warmup)
        without: list[float] = []
        with_app: list[float] = []
        cpu: list[float] = []
        for round_ in range(args.rounds):
            for attached in (False, True, True, False):
                app = None
                if attached:
                    app = TerminalApp(env, size)  # type: ignore[arg-type]
                    app.wait("Contributing to run shapes")
                    app.keys(KEYS[args.screen])
                    time.sleep(2)  # the screen switch and the first drawing are not the steady state
                try:
                    rate, used = window(settings, args.seconds, app)
                finally:
                    if app is not None:
                        app.close()
                (with_app if attached else without).append(rate)
                if used is not None:
                    cpu.append(used)
                shown = f"app {used:.2f} % of a core" if used is not None else "no app"
                print(f"round {round_ + 1}: {rate:.1f} samples/s, {shown}", flush=True)
        ratio = statistics.mean(with_app) / statistics.mean(without)
        # each round's own ratio (its two windows with the app over its two without): drift between
        # rounds cancels out, and the median is robust to a window that a neighbour's burst slowed down
        per_round = [
            (with_app[2 * r] + with_app[2 * r + 1]) / (without[2 * r] + without[2 * r + 1])
            for r in range(args.rounds)
        ]
        print(
            json.dumps(
                {
                    "screen": args.screen,
                    "size": args.size,
                    "window_seconds": args.seconds,
                    "app_cpu_percent_of_one_core": {
                        "mean": round(statistics.mean(cpu), 2),
                        "max": round(max(cpu), 2),
                    },
                    "samples_per_second_without_app": round(statistics.mean(without), 2),
                    "samples_per_second_with_app": round(statistics.mean(with_app), 2),
                    "ratio_with_over_without": round(ratio, 3),
                    "ratio_per_round": [round(r, 3) for r in per_round],
                    "ratio_median_of_rounds": round(statistics.median(per_round), 3),
                },
                indent=2,
            )
        )
    finally:
        if agent_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent_pid, signal.SIGKILL)
        stop_serve(serve)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

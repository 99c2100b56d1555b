"""Benchmarks of the agent service, with a real coordinator, a real agent and real workers on loopback.

    python tests/perf/bench_agent.py [--seconds 60] [--rounds 20]

* **agent CPU**: the agent process's own CPU time (not its worker's) while it trains, with no control
  client and with 3 attached (each receiving every update), side by side; in % of one core.
* **command latency**: from sending ``pause``/``resume`` on one connection to the change arriving on
  another (what a UI shows), ``--rounds`` times each.
* **join -> first trained sample** with a running agent (its speed test cached by an earlier join), and
  -> first averaging round, joining a swarm in which another volunteer is already training; the
  swarm's global epochs between joining and that round.

Prints figures; asserts nothing. Workers run one thread each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import python_env, start_serve, stop_serve  # noqa: E402
from volunteer_app.control import JoinCommand, LeaveCommand, PauseAgentCommand, ResumeAgentCommand  # noqa: E402
from volunteer_app.control_client import AgentConnection, locate_agent  # noqa: E402
from volunteer_app.settings import AgentSettings  # noqa: E402

RUN = "bench"


def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        check=check,
    )


async def wait_state(connection: AgentConnection, predicate: Any, timeout: float) -> float:
    """Seconds until ``predicate(state)`` holds."""
    started = time.monotonic()
    while not predicate(connection.state):
        if time.monotonic() - started > timeout:
            raise TimeoutError("the agent did not reach the expected state")
        await connection.next_event(1.0)
    return time.monotonic() - started


async def drain(connection: AgentConnection, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await connection.next_event(0.5)


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def measure(url: str, root: Path, seconds: float, rounds: int) -> dict[str, Any]:
    # INFO: the worker logs how long each start-up phase took ("ready in ..."), reported below
    env = python_env(
        VOLUNTEER_CONFIG_DIR=str(root / "ada"), VOLUNTEER_BENCHMARK_SECONDS="2", VOLUNTEER_LOG_LEVEL="INFO"
    )
    settings = AgentSettings(config_dir=root / "ada")
    cli(env, "agent", "--background", "--listen-host", "127.0.0.1")
    address = locate_agent(settings)
    assert address.pid is not None
    join = JoinCommand(coordinator=url, run=RUN, name="ada")
    results: dict[str, Any] = {}
    async with AgentConnection(address) as agent:
        await agent.call({"command": "settings", "values": {"max_threads": 1}})
        # an earlier contribution: registration done and the speed test cached, as on a volunteer's PC
        await agent.call(join, timeout=600)
        await wait_state(agent, lambda s: s.contribution and s.contribution.samples_total > 0, 300)
        await agent.call(LeaveCommand(), timeout=600)

        sent = time.time()
        await agent.call(join, timeout=600)
        await wait_state(agent, lambda s: s.contribution and s.contribution.first_sample_at, 300)
        c = agent.state.contribution
        results["join_to_first_sample_s"] = round(c.first_sample_at - sent, 2)
        log = (settings.logs_dir / f"worker-{RUN}.log").read_text(errors="replace")
        ready = [line.split("ready in ", 1)[1] for line in log.splitlines() if "ready in " in line]
        results["worker_start_up"] = ready[-1] if ready else "(not in the worker log)"
        epoch_at_join = c.global_epoch
        await wait_state(agent, lambda s: s.contribution.first_round_at, 600)
        c = agent.state.contribution
        results["join_to_first_round_s"] = round(c.first_round_at - sent, 2)
        results["epochs_before_first_round"] = c.global_epoch - epoch_at_join

        # agent CPU: no clients but this one (idle between reads), then 3 clients receiving everything
        await asyncio.sleep(5)
        before = cpu_seconds(address.pid)
        await asyncio.sleep(seconds)
        results["agent_cpu_percent_0_clients"] = round(100 * (cpu_seconds(address.pid) - before) / seconds, 2)
        stop = asyncio.Event()
        clients = [await AgentConnection(address).__aenter__() for _ in range(3)]
        drains = [asyncio.create_task(drain(client, stop)) for client in clients]
        before = cpu_seconds(address.pid)
        await asyncio.sleep(seconds)
        results["agent_cpu_percent_3_clients"] = round(100 * (cpu_seconds(address.pid) - before) / seconds, 2)

        # command -> visible state change, seen by another client
        watcher = clients[0]
        latencies = []
        for i in range(rounds):
            pause = i % 2 == 0
            started = time.monotonic()
            await agent.call(PauseAgentCommand() if pause else ResumeAgentCommand())
            await wait_state(watcher, lambda s, pause=pause: s.paused_by_user is pause, 10)
            latencies.append(1000 * (time.monotonic() - started))
            await asyncio.sleep(0.3)
        results["command_latency_ms"] = {
            "median": round(statistics.median(latencies), 1),
            "p95": round(sorted(latencies)[int(0.95 * (len(latencies) - 1))], 1),
            "max": round(max(latencies), 1),
        }
        stop.set()
        await asyncio.gather(*drains, return_exceptions=True)
        for client in clients:
            await client.close()
        await agent.call({"command": "stop"}, timeout=300)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="CPU measurement window (default 60)")
    parser.add_argument("--rounds", type=int, default=20, help="pause/resume round trips (default 20)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    data = root / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", RUN,
         "--task", "shapes-dalle", "--preset", "tiny", "--matchmaking-time", "2", "--averaging-timeout", "20"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    started: list[Any] = []
    serve, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    partner = subprocess.Popen(
        [sys.executable, "-m", "volunteer_app.cli", "join", "--foreground", "--coordinator", url, "--run", RUN,
         "--name", "bob", "--config-dir", str(root / "bob"), "--listen-host", "127.0.0.1", "--max-threads", "1",
         "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=python_env(VOLUNTEER_BENCHMARK_SECONDS="2"),
        start_new_session=True,
    )  # fmt: skip
    try:
        results = asyncio.run(measure(url, root, args.seconds, args.rounds))
        print(json.dumps(results, indent=2))
    finally:
        partner.terminate()
        try:
            partner.wait(timeout=60)
        except subprocess.TimeoutExpired:
            partner.kill()
        stop_serve(serve)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark: heartbeat throughput and latency of one ``serve`` process on SQLite with 1,000 agents.

    python tests/perf/bench_heartbeats.py [--agents 1000] [--seconds 15] [--concurrency 64]

The server runs pinned to CPU 0 and the load generator to CPU 1 (when there are two). Every agent
registers and joins the run with its own RSA peer key; then the agents heartbeat round-robin, and the
trivial endpoint ``GET /api/v1/time`` of the same app is measured in the same run, alternating with the
heartbeats, so the ratio is the figure to compare across machines. The load comes from ``wrk`` (Debian
package) when it is installed, which can drive the server to saturation; otherwise from an httpx client,
which saturates first and so understates the server. Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import PROFILE, python_env, start_serve, stop_serve  # noqa: E402
from volunteer_app.identity import public_key_openssh  # noqa: E402


def _keys(n: int) -> list[str]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    # 1,000 distinct 2048-bit keys take a while; a 2048-bit key is what the coordinator requires.
    return [
        public_key_openssh(rsa.generate_private_key(public_exponent=65537, key_size=2048)) for _ in range(n)
    ]


async def _setup(url: str, agents: int, concurrency: int) -> list[tuple[str, str]]:
    keys = await asyncio.to_thread(_keys, agents)
    sessions: list[tuple[str, str]] = []
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)
    ) as http:

        async def one(i: int) -> None:
            async with semaphore:
                registered = await http.post("/api/v1/volunteers", json={"name": f"agent-{i}"})
                registered.raise_for_status()
                credential = registered.json()["credential"]
                body = {"profile": PROFILE, "agent_version": "bench", "peer_public_key": keys[i]}
                answer = await http.post(
                    "/api/v1/runs/bench/join", json=body, headers={"Authorization": f"Bearer {credential}"}
                )
                answer.raise_for_status()
                sessions.append((credential, answer.json()["session_id"]))

        await asyncio.gather(*(one(i) for i in range(agents)))
    return sessions


async def _load(
    url: str, sessions: list[tuple[str, str]], *, heartbeat: bool, seconds: float, concurrency: int
) -> list[float]:
    latencies: list[float] = []
    failures: dict[str, int] = {}
    errors = 0
    deadline = time.perf_counter() + seconds
    order = list(range(len(sessions)))
    random.shuffle(order)
    counter = 0
    async with httpx.AsyncClient(
        base_url=url, timeout=30, limits=httpx.Limits(max_connections=concurrency)
    ) as http:

        async def worker() -> None:
            nonlocal counter, errors
            while time.perf_counter() < deadline:
                credential, session = sessions[order[counter % len(order)]]
                counter += 1
                start = time.perf_counter()
                try:
                    if heartbeat:
                        response = await http.post(
                            f"/api/v1/sessions/{session}/heartbeat",
                            json={
                                "state": "training",
                                "samples_total": counter,
                                "samples_per_second": 50.0,
                                "loss": 2.0,
                            },
                            headers={"Authorization": f"Bearer {credential}"},
                        )
                    else:
                        response = await http.get("/api/v1/time")
                except httpx.TransportError as exc:
                    errors += 1
                    failures.setdefault(type(exc).__name__, 0)
                    failures[type(exc).__name__] += 1
                    continue
                if response.status_code != 200:
                    errors += 1
                    failures[str(response.status_code)] = failures.get(str(response.status_code), 0) + 1
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if errors:
        print(f"  ({errors} failed requests: {failures})")
    return latencies


WRK_SCRIPT = """
local sessions = {}
for line in io.lines(os.getenv("BENCH_SESSIONS")) do
  local id, credential = line:match("(%S+) (%S+)")
  sessions[#sessions + 1] = {id = id, credential = credential}
end
local body = '{"state":"training","samples_total":1000,"samples_per_second":50.0,"loss":2.0}'
local counter = 0
request = function()
  if os.getenv("BENCH_KIND") == "time" then
    return wrk.format("GET", "/api/v1/time")
  end
  counter = counter + 1
  local s = sessions[(counter % #sessions) + 1]
  return wrk.format("POST", "/api/v1/sessions/" .. s.id .. "/heartbeat",
    {["Authorization"] = "Bearer " .. s.credential, ["Content-Type"] = "application/json"}, body)
end
done = function(summary, latency, requests)
  io.write(string.format("BENCH %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), summary.errors.status, summary.errors.timeout))
end
"""


def _wrk(
    url: str, sessions: list[tuple[str, str]], *, kind: str, seconds: float, concurrency: int, tmp: Path
) -> tuple[float, float, float, int]:
    """(requests/s, p50 ms, p99 ms, failed) from wrk."""
    script = tmp / "heartbeat.lua"
    script.write_text(WRK_SCRIPT)
    listing = tmp / "sessions.txt"
    listing.write_text("".join(f"{session} {credential}\n" for credential, session in sessions))
    command = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:.0f}s", "-s", str(script), url]
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        command = ["taskset", "-c", "1", *command]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "BENCH_SESSIONS": str(listing), "BENCH_KIND": kind},
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("BENCH "))
    requests, duration_us, p50_us, p99_us, status_errors, timeouts = (int(x) for x in line.split()[1:])
    return requests / (duration_us / 1e6), p50_us / 1000, p99_us / 1000, status_errors + timeouts


def _summary(name: str, latencies: list[float], seconds: float) -> tuple[float, float, float]:
    rate = len(latencies) / seconds
    cuts = statistics.quantiles(latencies, n=100)
    p50, p99 = cuts[49] * 1000, cuts[98] * 1000
    print(f"  {name:<22} {rate:8.0f} req/s   p50 {p50:7.1f} ms   p99 {p99:7.1f} ms")
    return rate, p50, p99


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument(
        "--seconds", type=float, default=15.0, help="per measurement (two of each, alternating)"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--httpx", action="store_true", help="use the httpx load generator even if wrk is installed"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-heartbeats-"))
    data = tmp / "data"
    # One load generator registers every agent from one address: lift the per-address registration limit.
    env = python_env(
        VOLUNTEER_COORDINATOR_LIMITS__REGISTER_PER_MINUTE="1000000",
        VOLUNTEER_COORDINATOR_LIMITS__BURST="100000",
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "runs",
            "create",
            "--data-dir",
            str(data),
            "--name",
            "bench",
            "--task",
            "shapes-dalle",
            "--config",
            f"num_shards={args.agents * 4}",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    started: list = []
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})
    try:
        process, url = start_serve(data, started, "--no-swarm", "--log-level", "warning", env=env)
        if pin:
            subprocess.run(
                ["taskset", "-a", "-p", "-c", "0", str(process.pid)], check=True, capture_output=True
            )
        t0 = time.perf_counter()
        try:
            sessions = asyncio.run(_setup(url, args.agents, args.concurrency))
        except Exception:
            print("".join(process.output_lines[-40:]))  # type: ignore[attr-defined]
            raise
        print(
            f"{len(sessions)} agents registered and joined in {time.perf_counter() - t0:.1f} s "
            f"(server pinned to CPU 0: {pin})"
        )
        print(
            f"one serve process, SQLite (WAL), {args.agents} agents, {args.concurrency} concurrent connections:"
        )
        if shutil.which("wrk") and not args.httpx:
            figures: dict[str, list[tuple[float, float, float, int]]] = {"heartbeat": [], "time": []}
            for _ in range(2):
                for kind in ("heartbeat", "time"):
                    figures[kind].append(
                        _wrk(
                            url,
                            sessions,
                            kind=kind,
                            seconds=args.seconds,
                            concurrency=args.concurrency,
                            tmp=tmp,
                        )
                    )
            rows = {}
            for kind, label in (("heartbeat", "POST .../heartbeat"), ("time", "GET /api/v1/time")):
                rate = sum(f[0] for f in figures[kind]) / 2
                p50 = statistics.median(f[1] for f in figures[kind])
                p99 = max(f[2] for f in figures[kind])
                failed = sum(f[3] for f in figures[kind])
                rows[kind] = (rate, p50, p99)
                print(
                    f"  {label:<22} {rate:8.0f} req/s   p50 {p50:7.1f} ms   p99 {p99:7.1f} ms   failed {failed}  (wrk)"
                )
            hb, tr = rows["heartbeat"], rows["time"]
        else:
            results: dict[str, list[float]] = {"heartbeat": [], "time": []}
            for _ in range(2):
                for kind in ("heartbeat", "time"):
                    results[kind] += asyncio.run(
                        _load(
                            url,
                            sessions,
                            heartbeat=kind == "heartbeat",
                            seconds=args.seconds,
                            concurrency=args.concurrency,
                        )
                    )
            hb = _summary("POST .../heartbeat", results["heartbeat"], 2 * args.seconds)
            tr = _summary("GET /api/v1/time", results["time"], 2 * args.seconds)
        print(
            f"  heartbeat / trivial endpoint: throughput {hb[0] / tr[0]:.2f}, p50 latency {hb[1] / tr[1]:.2f}x"
        )
        stop_serve(process)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    # `timeout` and CI send SIGTERM: unwind through the cleanup code instead of leaving peers behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
